//! The check of a `--phases` run: what the processor charged, what the database recorded and
//! what the clients were answered, against the operations asked for.
//!
//! Per operation (its account is its own, its record's key is its key): at most one
//! processor charge and at most one charge row; a charge row carries the ID of the
//! processor's charge for its operation; an answered operation has both, and was answered
//! that ID. Its record ended: finished (with its charge and row) or abandoned (no row; the
//! processor's charge, if any, is the compensation's to undo); none in progress at a recovery
//! point (stuck) after the completers' pass. Only an operation whose client gave up may have
//! no ended record, and then nothing happened for it.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use idem_testkit::fake_processor::Stats;
use serde::Serialize;

use super::Op;
use super::clients::Tally;
use crate::ledger::RunDatabase;

/// The figures of a `--phases` run, in its report.
#[derive(Debug, Default, Serialize)]
pub(crate) struct PhasesFigures {
    /// `http` or `consumer`.
    pub(crate) service: String,
    pub(crate) operations: u64,
    /// Operations whose client was answered.
    pub(crate) answered: u64,
    /// Operations whose client gave up after a failed first attempt (`--give-up-share`).
    pub(crate) given_up: u64,
    /// Operations answered as given up by the service (its completer ran out of attempts).
    pub(crate) answered_abandoned: u64,
    /// Operations never answered (the run stopped their clients at its drain timeout).
    pub(crate) unanswered: u64,
    /// Calls the processor received (every attempt).
    pub(crate) processor_calls: u64,
    /// Charges the processor made.
    pub(crate) processor_effects: u64,
    /// Charges beyond the first for one operation.
    pub(crate) doubled_effects: u64,
    pub(crate) charge_rows: u64,
    /// Charge rows beyond the first for one operation.
    pub(crate) doubled_rows: u64,
    /// Charge rows without the ID of a processor charge made for their operation.
    pub(crate) rows_without_processor_charge: u64,
    /// Answered operations missing their processor charge or their row.
    pub(crate) answered_without_effect: u64,
    /// Answered operations whose answer names another processor charge than their row.
    pub(crate) answers_mismatched: u64,
    /// Operations charged at the processor with no charge row (abandoned after the charge).
    pub(crate) charged_unrecorded: u64,
    /// Charges and rows for accounts no operation has.
    pub(crate) unexpected: u64,
    /// Records by state at the end.
    pub(crate) finished: u64,
    pub(crate) abandoned: u64,
    pub(crate) stuck: u64,
    /// Records in progress with no recovery point: taken, their executor died before the
    /// first point committed, and their client gave up. Nothing happened and the completer
    /// cannot resume them (no point); a retry with the key would take them over.
    pub(crate) in_progress_without_point: u64,
    /// Operations with no record at all (their client gave up before one was taken).
    pub(crate) not_started: u64,
    /// Operations whose record's ending contradicts what happened (finished without its
    /// charge and row, abandoned with a row, no ending though its client did not give up).
    pub(crate) wrong_endings: u64,
    /// HTTP requests the clients sent, the middleware's retries included.
    pub(crate) client_requests: u64,
    /// Answers marked as replays.
    pub(crate) client_replays: u64,
    /// Logical requests sent again with the same key after the middleware gave up.
    pub(crate) client_resends: u64,
    /// `--scramble-foreign-keys`: the run was meant to double charges.
    pub(crate) scrambled_foreign_keys: bool,
    /// Up to 20 operations charged more than once.
    pub(crate) doubled_ids: Vec<String>,
}

/// Checks the run; the findings go into `anomalies`.
pub(crate) async fn check(
    db: &RunDatabase,
    requests_table: &str,
    ops: &[Op],
    stats: &Stats,
    tally: &Tally,
    anomalies: &mut Vec<String>,
) -> Result<PhasesFigures> {
    let rows = db.processor_charge_rows().await?;
    let records = db.request_keys(requests_table).await?;
    let mut rows_by_account: HashMap<&str, Vec<Option<&str>>> = HashMap::new();
    for (account, id) in &rows {
        rows_by_account
            .entry(account.as_str())
            .or_default()
            .push(id.as_deref());
    }
    let mut f = PhasesFigures {
        operations: ops.len() as u64,
        answered: tally.answered.len() as u64,
        given_up: tally.given_up.len() as u64,
        answered_abandoned: tally.abandoned.len() as u64,
        unanswered: tally.unanswered,
        processor_calls: stats.calls,
        processor_effects: stats.total_effects(),
        charge_rows: rows.len() as u64,
        finished: records.finished.len() as u64,
        abandoned: records.abandoned.len() as u64,
        stuck: records.stuck.len() as u64,
        in_progress_without_point: records.unstarted.len() as u64,
        client_requests: tally.requests,
        client_replays: tally.replays,
        client_resends: tally.resends,
        ..Default::default()
    };
    let mut wrong_endings = Vec::new();
    for op in ops {
        let effects = stats.charges_to(&op.account);
        let op_rows = rows_by_account
            .get(op.account.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        if effects.len() > 1 {
            f.doubled_effects += effects.len() as u64 - 1;
            if f.doubled_ids.len() < 20 {
                f.doubled_ids.push(op.key.clone());
            }
        }
        if op_rows.len() > 1 {
            f.doubled_rows += op_rows.len() as u64 - 1;
        }
        for id in op_rows {
            if !id.is_some_and(|id| effects.iter().any(|e| e == id)) {
                f.rows_without_processor_charge += 1;
            }
        }
        if op_rows.is_empty() && !effects.is_empty() {
            f.charged_unrecorded += 1;
        }
        if let Some(answer) = tally.answered.get(&op.account) {
            if effects.is_empty() || op_rows.is_empty() {
                f.answered_without_effect += 1;
            } else if answer.as_deref() != op_rows[0] {
                f.answers_mismatched += 1;
            }
        }
        // How the operation's record ended, against what happened.
        let key = op.key.as_str();
        let wrong = if records.finished.contains(key) {
            (effects.is_empty() || op_rows.is_empty())
                .then_some("finished without its charge and row")
        } else if records.abandoned.contains(key) {
            (!op_rows.is_empty()).then_some("abandoned with a charge row")
        } else if records.stuck.contains(key) {
            None // counted as stuck
        } else {
            // Taken and never at a point, or never taken: nothing may have happened, and only
            // a client that gave up leaves an operation so.
            if !records.unstarted.contains(key) {
                f.not_started += 1;
            }
            if !effects.is_empty() || !op_rows.is_empty() {
                Some("charged or recorded with no ended record")
            } else if !tally.given_up.contains(&op.account) {
                Some("never ended, and its client did not give up")
            } else {
                None
            }
        };
        if let Some(why) = wrong {
            f.wrong_endings += 1;
            if wrong_endings.len() < 5 {
                wrong_endings.push(format!("{key}: {why}"));
            }
        }
        if tally.abandoned.contains(&op.account) && !records.abandoned.contains(key) {
            f.wrong_endings += 1;
            if wrong_endings.len() < 5 {
                wrong_endings.push(format!("{key}: answered as abandoned, its record is not"));
            }
        }
    }
    let known: HashSet<&str> = ops.iter().map(|op| op.account.as_str()).collect();
    f.unexpected = stats
        .charges_by_account
        .iter()
        .filter(|(account, _)| !known.contains(account.as_str()))
        .map(|(_, ids)| ids.len() as u64)
        .sum::<u64>()
        + rows
            .iter()
            .filter(|(account, _)| !known.contains(account.as_str()))
            .count() as u64;
    let records_total = f.finished + f.abandoned + f.stuck + f.in_progress_without_point;
    if records_total > f.operations {
        anomalies.push(format!(
            "{records_total} records for {} operations",
            f.operations
        ));
    }
    for (what, n) in [
        ("processor charges doubled", f.doubled_effects),
        ("charge rows doubled", f.doubled_rows),
        (
            "charge rows without their operation's processor charge",
            f.rows_without_processor_charge,
        ),
        (
            "answered operations without a processor charge or a charge row",
            f.answered_without_effect,
        ),
        (
            "answers naming another processor charge than their row",
            f.answers_mismatched,
        ),
        ("charges or rows for unknown operations", f.unexpected),
        ("records stuck in progress at a recovery point", f.stuck),
        ("operations whose record ended wrong", f.wrong_endings),
        ("operations never answered", f.unanswered),
        ("answers refused (4xx)", tally.refused.len() as u64),
    ] {
        if n > 0 {
            anomalies.push(format!("{n} {what}"));
        }
    }
    if !wrong_endings.is_empty() {
        anomalies.push(format!("first wrong endings: {}", wrong_endings.join(", ")));
    }
    if let Some(first) = tally.refused.first() {
        anomalies.push(format!("first refusal: {first}"));
    }
    Ok(f)
}
