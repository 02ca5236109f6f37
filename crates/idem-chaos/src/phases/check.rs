//! The check of a `--phases` run: what the processor charged, what the database recorded and
//! what the clients were answered, against the operations asked for.
//!
//! Per operation (its account is its own): at most one processor charge and at most one
//! charge row; a charge row carries the ID of the processor's charge for its operation; an
//! answered operation has both, and was answered that ID. Over the records: none in progress
//! (stuck) after the completers' pass; as many finished as operations with a charge row; an
//! operation charged with no row only if as many records were abandoned; and a record for
//! every operation but those whose client gave up before it took one.

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
    /// Operations charged at the processor with no charge row.
    pub(crate) charged_unrecorded: u64,
    /// Operations answered as given up that have a charge row all the same.
    pub(crate) abandoned_with_row: u64,
    /// Charges and rows for accounts no operation has.
    pub(crate) unexpected: u64,
    /// Records by state at the end.
    pub(crate) finished: u64,
    pub(crate) abandoned: u64,
    pub(crate) stuck: u64,
    /// Operations with no record (their client gave up before one was taken).
    pub(crate) not_started: u64,
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
    let (stuck, finished, abandoned) = db.request_states(requests_table).await?;
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
        finished,
        abandoned,
        stuck,
        client_requests: tally.requests,
        client_replays: tally.replays,
        client_resends: tally.resends,
        ..Default::default()
    };
    let mut with_row = 0u64;
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
        if !op_rows.is_empty() {
            with_row += 1;
        } else if !effects.is_empty() {
            f.charged_unrecorded += 1;
        }
        if tally.abandoned.contains(&op.account) && !op_rows.is_empty() {
            f.abandoned_with_row += 1;
        }
        if let Some(answer) = tally.answered.get(&op.account) {
            if effects.is_empty() || op_rows.is_empty() {
                f.answered_without_effect += 1;
            } else if answer.as_deref() != op_rows[0] {
                f.answers_mismatched += 1;
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
    f.not_started = f.operations.saturating_sub(finished + abandoned + stuck);

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
        ("records stuck in progress", f.stuck),
        (
            "operations answered as abandoned with a charge row",
            f.abandoned_with_row,
        ),
        ("operations never answered", f.unanswered),
        ("answers refused (4xx)", tally.refused.len() as u64),
    ] {
        if n > 0 {
            anomalies.push(format!("{n} {what}"));
        }
    }
    if let Some(first) = tally.refused.first() {
        anomalies.push(format!("first refusal: {first}"));
    }
    if finished != with_row {
        anomalies.push(format!(
            "{finished} records finished but {with_row} operations have a charge row"
        ));
    }
    if f.charged_unrecorded > abandoned {
        anomalies.push(format!(
            "{} operations charged at the processor without a charge row, and only {abandoned} records abandoned",
            f.charged_unrecorded
        ));
    }
    if f.not_started > f.given_up {
        anomalies.push(format!(
            "{} operations have no record, and only {} clients gave up",
            f.not_started, f.given_up
        ));
    }
    if f.answered_abandoned > abandoned {
        anomalies.push(format!(
            "{} operations answered as abandoned, and only {abandoned} records abandoned",
            f.answered_abandoned
        ));
    }
    if finished + abandoned + stuck > f.operations {
        anomalies.push(format!(
            "{} records for {} operations",
            finished + abandoned + stuck,
            f.operations
        ));
    }
    Ok(f)
}
