//! What a run found: one summary line and one JSON object.

use std::collections::BTreeMap;

use serde::Serialize;

/// The figures of one run. `anomalies` lists, in words, everything that should not happen;
/// empty means the run proved what it set out to.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Report {
    pub(crate) broker: String,
    /// postgres, mysql or sqlite.
    pub(crate) database: String,
    pub(crate) seed: u64,
    pub(crate) consumers: usize,
    /// `--two-hop`: the second hop's consumers.
    pub(crate) receipt_consumers: usize,
    /// `--relays`: standalone relay processes (0: each consumer relays in process).
    pub(crate) relays: usize,
    /// Publishes, repeats included.
    pub(crate) sent: u64,
    /// Distinct message IDs.
    pub(crate) unique: u64,
    /// Charge rows in the ledger.
    pub(crate) effects: u64,
    /// Distinct IDs sent and never charged.
    pub(crate) lost: u64,
    /// Charges beyond the first for one ID.
    pub(crate) duplicated: u64,
    /// Charges for IDs never sent.
    pub(crate) unexpected: u64,
    pub(crate) dead_lettered: u64,
    /// SIGKILLs plus crash-point aborts.
    pub(crate) kills: u64,
    pub(crate) sigkills: u64,
    pub(crate) crash_point_aborts: u64,
    /// Kills (SIGKILLs and aborts) of the first hop's consumers (with their in-process relay
    /// when there are no `--relays`).
    pub(crate) consumer_kills: u64,
    /// Kills of the second hop's consumers.
    pub(crate) receipt_consumer_kills: u64,
    /// Kills of the standalone relays.
    pub(crate) relay_kills: u64,
    /// Crash-point aborts by point.
    pub(crate) aborts_at: BTreeMap<String, u64>,
    /// Consumer restarts after kills, aborts and failed exits.
    pub(crate) restarts: u64,
    /// Connections cut around COMMIT.
    pub(crate) cuts: u64,
    pub(crate) cuts_before_commit: u64,
    pub(crate) cuts_after_commit: u64,
    /// COMMITs the proxy saw go by, cut or not.
    pub(crate) commits_seen: u64,
    /// Connections the consumers opened through the proxy.
    pub(crate) proxied_connections: u64,
    pub(crate) database_restarts: u64,
    pub(crate) failovers: u64,
    pub(crate) broker_restarts: u64,
    /// Consumer exits with an error status (e.g. start-up against a read-only database).
    pub(crate) failed_exits: u64,
    /// Repeats the broker itself dropped before any consumer saw them.
    pub(crate) broker_dropped_repeats: u64,
    /// Kafka: partitions no consumer held while the drain made no progress (a broker fault,
    /// see `Run::unorphan`); each time the group was made to rebalance.
    pub(crate) broker_orphaned_partitions: u64,
    /// Messages left unacknowledged on the broker at the end (both hops).
    pub(crate) backlog: u64,
    /// `--two-hop`: receipt rows the second consumer recorded.
    pub(crate) receipts: u64,
    /// `--two-hop`: payments with no receipt.
    pub(crate) receipts_lost: u64,
    /// `--two-hop`: receipts beyond the first for one payment.
    pub(crate) receipts_duplicated: u64,
    /// `--two-hop`: receipts for payments never sent.
    pub(crate) receipts_unexpected: u64,
    pub(crate) balance_matches: bool,
    pub(crate) elapsed_secs: f64,
    pub(crate) anomalies: Vec<String>,
    /// Up to 20 of each, for a failure's first look.
    pub(crate) lost_ids: Vec<String>,
    pub(crate) duplicated_ids: Vec<String>,
    /// `--two-hop`: up to 20 payments with no receipt, and with more than one.
    pub(crate) receipts_lost_ids: Vec<String>,
    pub(crate) receipts_duplicated_ids: Vec<String>,
    /// Consumer logs (kept when there is an anomaly or with --keep).
    pub(crate) logs: Option<String>,
    /// `--phases`: the operations' figures.
    pub(crate) phases: Option<crate::phases::check::PhasesFigures>,
}

impl Report {
    pub(crate) fn summary(&self) -> String {
        if let Some(p) = &self.phases {
            return self.phases_summary(p);
        }
        format!(
            "idem-chaos {} {} seed {}: sent {} unique {} effects {} lost {} duplicated {} unexpected {} dead-lettered {}{} kills {} ({} at crash points; {} consumers, {} receipt consumers, {} relays) restarts {} cuts {} db restarts {} failovers {} broker restarts {} in {:.1}s: {}",
            self.broker,
            self.database,
            self.seed,
            self.sent,
            self.unique,
            self.effects,
            self.lost,
            self.duplicated,
            self.unexpected,
            self.dead_lettered,
            if self.receipts > 0 || self.receipts_lost > 0 {
                format!(
                    " receipts {} lost {} duplicated {} unexpected {}",
                    self.receipts,
                    self.receipts_lost,
                    self.receipts_duplicated,
                    self.receipts_unexpected
                )
            } else {
                String::new()
            },
            self.kills,
            self.crash_point_aborts,
            self.consumer_kills,
            self.receipt_consumer_kills,
            self.relay_kills,
            self.restarts,
            self.cuts,
            self.database_restarts,
            self.failovers,
            self.broker_restarts,
            self.elapsed_secs,
            if self.anomalies.is_empty() {
                "OK".to_owned()
            } else {
                format!("ANOMALY: {}", self.anomalies.join("; "))
            }
        )
    }

    /// The summary of a `--phases` run.
    fn phases_summary(&self, p: &crate::phases::check::PhasesFigures) -> String {
        format!(
            "idem-chaos phases {}{} {} seed {}: operations {} answered {} given up {} (not started {}) processor charges {} doubled {} charge rows {} doubled {} without the processor's charge {} records finished {} abandoned {} stuck {} without a point {} client requests {} resends {} replays {} kills {} ({} at crash points) restarts {} in {:.1}s: {}",
            p.service,
            match p.service.as_str() {
                "consumer" => format!(
                    " {} (sent {}, lost {}, duplicated {}, dead-lettered {}, left {})",
                    self.broker,
                    self.sent,
                    self.lost,
                    self.duplicated,
                    self.dead_lettered,
                    self.backlog
                ),
                _ => String::new(),
            },
            self.database,
            self.seed,
            p.operations,
            p.answered,
            p.given_up,
            p.not_started,
            p.processor_effects,
            p.doubled_effects,
            p.charge_rows,
            p.doubled_rows,
            p.rows_without_processor_charge,
            p.finished,
            p.abandoned,
            p.stuck,
            p.in_progress_without_point,
            p.client_requests,
            p.client_resends,
            p.client_replays,
            self.kills,
            self.crash_point_aborts,
            self.restarts,
            self.elapsed_secs,
            if self.anomalies.is_empty() {
                "OK".to_owned()
            } else {
                format!("ANOMALY: {}", self.anomalies.join("; "))
            }
        )
    }

    pub(crate) fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}
