//! What idem's consumer and the naive one share: the context a worker runs in, the counters
//! of what workers decided, the crash point, and the rules for a delivery that failed (retry
//! or dead-letter, never drop it silently).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::{BoxError, Disposition, Error};
use idem_sql::SqliteStore;

use super::broker::{Delivery, SimulatedBroker};
use super::faults::CrashPlan;
use super::ledger;

/// A copy that still fails with a retryable error after this many deliveries is dead-lettered,
/// as a broker's redrive policy would, so a broken database cannot keep the demo looping.
const MAX_DELIVERIES: u32 = 20;

/// What the workers decided, counted as they go. The report's ledger numbers do not come from
/// here but from the database; these explain how the database got that way.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Deliveries acked without charging: idem's `Outcome::Duplicate`, or the naive check
    /// finding the ID.
    pub(crate) duplicates_skipped: AtomicU64,
    /// Deliveries whose ID had been processed with a different payload.
    pub(crate) conflicts: AtomicU64,
    /// Simulated crashes between commit and ack.
    pub(crate) crashes: AtomicU64,
    /// Deliveries nacked after a retryable error.
    pub(crate) retries: AtomicU64,
}

impl Tally {
    /// Reads a counter.
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Everything a worker needs; cloned into each worker task.
#[derive(Debug, Clone)]
pub(crate) struct WorkerContext {
    /// Where deliveries come from and acks go.
    pub(crate) broker: Arc<SimulatedBroker>,
    /// The ledger's database (and, for idem, the claims).
    pub(crate) store: SqliteStore,
    /// Which deliveries crash after their commit.
    pub(crate) crashes: CrashPlan,
    /// Shared counters.
    pub(crate) tally: Arc<Tally>,
}

impl WorkerContext {
    /// Called right after the charge committed. Returns `true` if the worker "crashes" here:
    /// it must then neither record anything nor ack, and the broker redelivers the message
    /// once the visibility timeout passes — the window every at-least-once consumer has.
    pub(crate) fn crashes_after_commit(&self, delivery: &Delivery) -> bool {
        let crash = self
            .crashes
            .crashes_after_commit(delivery.copy(), delivery.attempt());
        if crash {
            Tally::bump(&self.tally.crashes);
        }
        crash
    }

    /// Acks a delivery that needed no work.
    pub(crate) fn skip_duplicate(&self, delivery: &Delivery) {
        Tally::bump(&self.tally.duplicates_skipped);
        self.broker.ack(delivery);
    }

    /// A producer bug: same ID, different payload. Dead-lettered with the evidence.
    pub(crate) async fn conflict(&self, delivery: &Delivery, reason: String) -> anyhow::Result<()> {
        Tally::bump(&self.tally.conflicts);
        self.dead_letter(delivery, &reason).await
    }

    /// Records the delivery in `dead_letters` with `reason`, then acks it.
    pub(crate) async fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: &str,
    ) -> anyhow::Result<()> {
        ledger::dead_letter(self.store.pool(), delivery.envelope(), reason).await?;
        self.broker.ack(delivery);
        Ok(())
    }

    /// Acts on a failed attempt by its disposition: retry (nack) while attempts remain,
    /// dead-letter what cannot succeed, stop the run on a misconfiguration.
    pub(crate) async fn failed(&self, delivery: &Delivery, err: Error) -> anyhow::Result<()> {
        match err.disposition() {
            Disposition::Retry if delivery.attempt() < MAX_DELIVERIES => {
                Tally::bump(&self.tally.retries);
                self.broker.nack(delivery);
                Ok(())
            }
            Disposition::Retry => {
                let reason = format!("gave up after {} deliveries: {err}", delivery.attempt());
                self.dead_letter(delivery, &reason).await
            }
            Disposition::Fatal => Err(anyhow::Error::new(err).context(format!(
                "processing {} failed in a way no message can get past",
                delivery.envelope().id
            ))),
            // DeadLetter, and anything a future core adds: keep the message, with its reason.
            _ => self.dead_letter(delivery, &err.to_string()).await,
        }
    }

    /// Gives an error from hand-written SQL the kind the processor would give it, so the naive
    /// consumer retries and dead-letters by the same rules as idem's.
    pub(crate) fn classify(&self, e: BoxError) -> Error {
        idem_core::store::handler_error(&self.store, e)
    }
}
