//! The end-of-run report: the ledger's numbers as the database counts them, the broker's and
//! workers' counters that explain them, and a one-line verdict. Human text or one JSON object.

use std::fmt::{Display, Write as _};
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::ledger::Audit;

/// Everything the run found; serialised as is for `--json`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// `"idem"` or `"naive"`.
    pub(crate) mode: &'static str,
    /// The seed all random choices came from.
    pub(crate) seed: u64,
    /// Concurrent workers.
    pub(crate) workers: usize,
    /// Probability that a message was published twice.
    pub(crate) duplicate_rate: f64,
    /// Probability that a worker crashed between commit and ack.
    pub(crate) crash_rate: f64,
    /// Distinct messages the producer emitted.
    pub(crate) messages: u64,
    /// Extra publishes of an already published message (same ID, same payload).
    pub(crate) duplicate_publishes: u64,
    /// Deliveries to workers, redeliveries included.
    pub(crate) deliveries: u64,
    /// Deliveries of a copy delivered before (after a visibility timeout or a retry).
    pub(crate) redeliveries: u64,
    /// Deliveries not acked within the visibility timeout.
    pub(crate) visibility_timeouts: u64,
    /// Acks that came after their delivery's visibility timeout (a slow worker, not a crash):
    /// the copy had usually been handed out again already.
    pub(crate) late_acks: u64,
    /// Crashes between commit and ack: for idem, acks the broker lost on purpose (the consumer
    /// "died" before its ack arrived); for the naive consumer, workers that stopped after the
    /// charge committed.
    pub(crate) simulated_crashes: u64,
    /// Deliveries acked without charging because the ID was already processed.
    pub(crate) duplicates_skipped: u64,
    /// Same ID, different payload: dead-lettered.
    pub(crate) conflicts: u64,
    /// Deliveries retried after a retryable error.
    pub(crate) retries: u64,
    /// Rows in `dead_letters`.
    pub(crate) dead_letters: u64,
    /// Rows in `charges`.
    pub(crate) charges: u64,
    /// Distinct message IDs in `charges`.
    pub(crate) charged_messages: u64,
    /// `charges - charged_messages`: charges beyond the first of their message.
    pub(crate) double_charges: u64,
    /// Messages charged more than once.
    pub(crate) double_charged_messages: u64,
    /// Produced messages with no charge row.
    pub(crate) lost: u64,
    /// Money charged beyond what was requested.
    pub(crate) overcharged_cents: i64,
    /// Sum of all charges.
    pub(crate) charged_cents: i64,
    /// Whether the account balances add up to the charges.
    pub(crate) balances_match: bool,
    /// Every message charged exactly once and the balances add up.
    pub(crate) exactly_once: bool,
    /// Wall time of the whole run.
    pub(crate) elapsed_ms: u64,
    /// The database file, kept for inspection.
    pub(crate) db: String,
}

/// What the consumer and the broker counted while the run went on; the ledger figures come
/// from the database instead.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    /// Deliveries handed out, redeliveries included.
    pub(crate) deliveries: u64,
    /// Deliveries of a copy handed out before.
    pub(crate) redeliveries: u64,
    /// Deliveries whose visibility timeout passed before they were settled.
    pub(crate) visibility_timeouts: u64,
    /// Settlements that came after their delivery's visibility timeout.
    pub(crate) late_acks: u64,
    /// See [`Report::simulated_crashes`].
    pub(crate) simulated_crashes: u64,
    /// Acked without charging: the ID was already processed.
    pub(crate) duplicates_skipped: u64,
    /// Same ID, different payload.
    pub(crate) conflicts: u64,
    /// Retries after retryable errors.
    pub(crate) retries: u64,
}

/// What the run was configured with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunConfig {
    /// `--naive`.
    pub(crate) naive: bool,
    /// `--seed`.
    pub(crate) seed: u64,
    /// `--workers`.
    pub(crate) workers: usize,
    /// `--messages`.
    pub(crate) messages: usize,
    /// `--duplicate-rate`.
    pub(crate) duplicate_rate: f64,
    /// `--crash-rate`.
    pub(crate) crash_rate: f64,
}

impl Report {
    /// Assembles the report; the ledger figures come only from `audit`.
    pub(crate) fn new(
        config: RunConfig,
        duplicate_publishes: u64,
        counts: Counts,
        audit: Audit,
        elapsed: Duration,
        db: &Path,
    ) -> Self {
        let messages = u64::try_from(config.messages).unwrap_or(u64::MAX);
        let exactly_once = audit.double_charges == 0
            && audit.lost == 0
            && audit.charged_messages == messages
            && audit.balances_match;
        Self {
            mode: if config.naive { "naive" } else { "idem" },
            seed: config.seed,
            workers: config.workers,
            duplicate_rate: config.duplicate_rate,
            crash_rate: config.crash_rate,
            messages,
            duplicate_publishes,
            deliveries: counts.deliveries,
            redeliveries: counts.redeliveries,
            visibility_timeouts: counts.visibility_timeouts,
            late_acks: counts.late_acks,
            simulated_crashes: counts.simulated_crashes,
            duplicates_skipped: counts.duplicates_skipped,
            conflicts: counts.conflicts,
            retries: counts.retries,
            dead_letters: audit.dead_letters,
            charges: audit.charges,
            charged_messages: audit.charged_messages,
            double_charges: audit.double_charges,
            double_charged_messages: audit.double_charged_messages,
            lost: audit.lost,
            overcharged_cents: audit.overcharged_cents,
            charged_cents: audit.charged_cents,
            balances_match: audit.balances_match,
            exactly_once,
            elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            db: db.display().to_string(),
        }
    }

    /// The human report.
    pub(crate) fn to_text(&self) -> String {
        let mut out = String::new();
        let how = if self.mode == "naive" {
            "naive consumer: check, charge and mark in three transactions"
        } else {
            "idem consumer: claim and charge in one transaction"
        };
        let _ = writeln!(out, "idem demo — {how}");
        let _ = writeln!(
            out,
            "seed {}, {} workers, duplicate rate {}, crash rate {}\n",
            self.seed, self.workers, self.duplicate_rate, self.crash_rate
        );
        let balances = if self.balances_match {
            "match"
        } else {
            "MISMATCH"
        };
        let rows: [(&str, &dyn Display, &str); 14] = [
            (
                "messages",
                &self.messages,
                "produced, each with a stable ID",
            ),
            (
                "duplicate publishes",
                &self.duplicate_publishes,
                "same ID, same payload",
            ),
            ("deliveries", &self.deliveries, "handed to workers"),
            (
                "redeliveries",
                &self.redeliveries,
                "after a visibility timeout or a retry",
            ),
            (
                "late acks",
                &self.late_acks,
                "slow worker, copy already redelivered",
            ),
            (
                "simulated crashes",
                &self.simulated_crashes,
                "committed, died before the ack",
            ),
            (
                "duplicates skipped",
                &self.duplicates_skipped,
                "acked without charging",
            ),
            ("conflicts", &self.conflicts, "same ID, different payload"),
            ("retries", &self.retries, "after a retryable error"),
            ("dead letters", &self.dead_letters, "rows in dead_letters"),
            ("charges", &self.charges, "rows in charges"),
            (
                "double charges",
                &self.double_charges,
                "charges beyond one per message",
            ),
            ("lost", &self.lost, "messages with no charge"),
            ("balances", &balances, "sum of accounts vs sum of charges"),
        ];
        for (label, value, note) in rows {
            let _ = writeln!(out, "  {label:<20} {value:>8}   {note}");
        }
        let _ = writeln!(
            out,
            "\n  {:.2} s · ledger kept in {}",
            self.elapsed_ms as f64 / 1000.0,
            self.db
        );
        let _ = writeln!(out, "\n{}", self.verdict());
        if self.double_charges > 0 {
            let _ = writeln!(
                out,
                "see for yourself: sqlite3 {} \"SELECT message_id, count(*) FROM charges \
                 GROUP BY 1 HAVING count(*) > 1\"",
                self.db
            );
        }
        out
    }

    /// One line saying whether the consumer was idempotent.
    pub(crate) fn verdict(&self) -> String {
        let dead = if self.dead_letters > 0 {
            format!(
                " ({} dead-lettered, see table dead_letters)",
                self.dead_letters
            )
        } else {
            String::new()
        };
        if self.exactly_once {
            let luck = if self.mode == "naive" {
                " — by luck: no crash or racing duplicate hit the gap between check and mark"
            } else {
                ""
            };
            return format!(
                "verdict: exactly once — every one of {} payments charged once across {} \
                 deliveries ({} duplicates skipped){luck}",
                self.messages, self.deliveries, self.duplicates_skipped
            );
        }
        let mut problems = Vec::new();
        if self.double_charges > 0 {
            problems.push(format!(
                "{} payments charged more than once ({} extra charges, {} overcharged)",
                self.double_charged_messages,
                self.double_charges,
                dollars(self.overcharged_cents)
            ));
        }
        if self.lost > 0 {
            problems.push(format!("{} payments never charged{dead}", self.lost));
        }
        if !self.balances_match {
            problems.push("balances do not add up to the charges".to_string());
        }
        let hint = if self.mode == "naive" {
            ". Run without --naive: the claim commits with the charge."
        } else {
            ""
        };
        format!("verdict: NOT idempotent — {}{hint}", problems.join("; "))
    }
}

/// `1234567` → `$12,345.67`.
fn dollars(cents: i64) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    let cents = cents.unsigned_abs();
    format!(
        "{sign}${}.{:02}",
        crate::format::group_digits(cents / 100),
        cents % 100
    )
}

#[cfg(test)]
mod tests {
    use super::dollars;

    #[test]
    fn dollars_are_grouped() {
        assert_eq!(dollars(0), "$0.00");
        assert_eq!(dollars(5), "$0.05");
        assert_eq!(dollars(123_456_789), "$1,234,567.89");
        assert_eq!(dollars(-100_000), "-$1,000.00");
    }
}
