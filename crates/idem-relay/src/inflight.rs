//! One round in flight, as a task of its own: its leased batch published under the relay's
//! shared permits, each confirm marked sent in chunks while later rows still publish, then
//! what failed released or dead-lettered. Several rounds run at once (see
//! [`RelayBuilder::pipeline`](crate::RelayBuilder::pipeline)), each under a lease owner of its
//! own, so the store keeps one round from taking another's rows or a later row of a key
//! another round still holds.

use std::sync::Arc;
use std::time::Duration;

use idem_consumer::RetryPolicy;
use idem_consumer::crash::{self, CrashPoint};
use idem_core::Error;
use idem_core::outbox::{OutboxRow, RelayStore};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Publish;
use crate::metrics::{Instruments, RelayStats};
use crate::round::{self, UnitOutcome};
use crate::verdict::{RETRIES_EXHAUSTED, Verdict};

/// What a round needs of the relay, shared by every round in flight.
pub(crate) struct Shared<S, P> {
    pub(crate) store: Arc<S>,
    pub(crate) publisher: Arc<P>,
    /// Publishes in flight across all rounds: pipelining overlaps the store's work with the
    /// broker's, it does not raise the concurrency the broker sees.
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) backoff: RetryPolicy,
    pub(crate) instruments: Instruments,
    pub(crate) max_attempts: Option<u32>,
}

/// How a round went, for the relay's loop.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// The pipeline slot it ran in, free again.
    pub(crate) slot: usize,
    /// It leased a full batch: more rows are likely waiting.
    pub(crate) full: bool,
    /// What it did, to add to the run's counts.
    pub(crate) stats: RelayStats,
    /// Publishes that reached the broker (confirmed or refused for good).
    pub(crate) reached: usize,
    /// Publishes that failed to reach it (retryable).
    pub(crate) missed: usize,
    /// The store failed (a mark, a release, a dead letter): the rest of the round's rows
    /// stay leased and come back when the relay leases again.
    pub(crate) error: Option<Error>,
}

/// Publishes and settles `rows`, leased by `owner`.
pub(crate) async fn run<S: RelayStore + 'static, P: Publish>(
    shared: Arc<Shared<S, P>>,
    owner: String,
    slot: usize,
    full: bool,
    rows: Vec<OutboxRow>,
    stop: CancellationToken,
) -> Report {
    let mut report = Report {
        slot,
        full,
        ..Report::default()
    };
    let (confirms, confirmed) = mpsc::unbounded_channel();
    let mut units = JoinSet::new();
    for unit in round::plan(rows) {
        units.spawn(round::publish_unit(
            Arc::clone(&shared.publisher),
            Arc::clone(&shared.permits),
            stop.clone(),
            confirms.clone(),
            unit,
        ));
    }
    // The marker's channel closes when the last unit finishes.
    drop(confirms);
    let publishing = async {
        let mut outcomes = Vec::new();
        while let Some(done) = units.join_next().await {
            match done {
                Ok(outcome) => outcomes.push(outcome),
                // Which of its rows the broker confirmed is unknown: they stay leased and are
                // published again (a duplicate at worst).
                Err(e) => tracing::error!(relay = %owner, error = %e, "a publishing task failed"),
            }
        }
        outcomes
    };
    let (outcomes, marked) = tokio::join!(publishing, mark(&shared, &owner, confirmed));
    report.reached += marked.confirmed;
    shared
        .instruments
        .published(&mut report.stats, marked.marked);
    if let Some(e) = marked.error {
        report.error = Some(e);
        return report;
    }
    if let Err(e) = settle(&shared, &owner, outcomes, &mut report).await {
        report.error = Some(e);
    }
    report
}

/// What the marker did.
struct Marked {
    /// Confirms received.
    confirmed: usize,
    /// Rows marked sent.
    marked: usize,
    /// The store error that stopped the marking.
    error: Option<Error>,
}

/// Marks confirmed rows as they arrive: whatever has arrived while the previous mark ran
/// goes in the next statement, so a round's rows are marked in a few chunks rather than
/// after its slowest publish. Stops marking at a store error (the rows stay leased, to be
/// published again) but keeps receiving, so the publishes finish.
async fn mark<S: RelayStore + 'static, P: Publish>(
    shared: &Shared<S, P>,
    owner: &str,
    mut confirmed: mpsc::UnboundedReceiver<i64>,
) -> Marked {
    let mut out = Marked {
        confirmed: 0,
        marked: 0,
        error: None,
    };
    let mut chunk = Vec::new();
    while let Some(seq) = confirmed.recv().await {
        chunk.push(seq);
        while let Ok(seq) = confirmed.try_recv() {
            chunk.push(seq);
        }
        out.confirmed += chunk.len();
        if out.error.is_none() {
            match shared.store.mark_sent(owner, &chunk).await {
                Ok(()) => {
                    crash::reached(CrashPoint::RelayAfterMark);
                    out.marked += chunk.len();
                }
                Err(e) => out.error = Some(e),
            }
        }
        chunk.clear();
    }
    out
}

/// Releases or dead-letters what failed, then releases what was held or not started.
async fn settle<S: RelayStore + 'static, P: Publish>(
    shared: &Shared<S, P>,
    owner: &str,
    outcomes: Vec<UnitOutcome>,
    report: &mut Report,
) -> Result<(), Error> {
    let store = &shared.store;
    let mut unstarted = Vec::new();
    for outcome in outcomes {
        unstarted.extend(outcome.unstarted);
        let Some((row, err)) = outcome.failed else {
            continue;
        };
        let attempts = row.attempts.saturating_add(1);
        let exhausted = shared.max_attempts.is_some_and(|m| attempts >= m);
        // How long the rows held behind it wait: never less than the failed row, so the
        // store cannot hand one of them out before it.
        let held_wait = match Verdict::of(&err) {
            Verdict::DeadLetter(code) => {
                report.reached += 1;
                dead_letter(shared, owner, report, &row, code, &format!("{code}: {err}")).await?;
                Duration::ZERO
            }
            Verdict::Retry if exhausted => {
                report.missed += 1;
                let reason = format!("{RETRIES_EXHAUSTED} after {attempts} attempts: {err}");
                dead_letter(shared, owner, report, &row, RETRIES_EXHAUSTED, &reason).await?;
                Duration::ZERO
            }
            Verdict::Retry => {
                report.missed += 1;
                let wait = shared.backoff.delay(attempts.saturating_add(1));
                store
                    .release(owner, row.seq, &err.to_string(), wait)
                    .await?;
                shared.instruments.failed(&mut report.stats);
                tracing::debug!(seq = row.seq, attempts, retry_in = ?wait, "released to retry");
                wait
            }
        };
        let why = format!("held behind seq {} of its ordering key", row.seq);
        for held in outcome.held {
            store.release(owner, held.seq, &why, held_wait).await?;
            report.stats.released_unpublished += 1;
        }
    }
    for row in unstarted {
        store
            .release(
                owner,
                row.seq,
                "the relay stopped before publishing it",
                Duration::ZERO,
            )
            .await?;
        report.stats.released_unpublished += 1;
    }
    Ok(())
}

async fn dead_letter<S: RelayStore + 'static, P: Publish>(
    shared: &Shared<S, P>,
    owner: &str,
    report: &mut Report,
    row: &OutboxRow,
    code: &'static str,
    reason: &str,
) -> Result<(), Error> {
    shared.store.dead_letter(owner, row.seq, reason).await?;
    shared.instruments.dead_lettered(&mut report.stats, code);
    tracing::debug!(seq = row.seq, id = ?row.message.id(), reason, "dead-lettered");
    Ok(())
}
