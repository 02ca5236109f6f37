//! The naive consumer's rules around a delivery, written by hand as such consumers are: the
//! context a naive worker runs in, the counters of what it decided, its crash point, and what
//! it does with a delivery that failed (retry or dead-letter, never drop it silently). idem's
//! consumer has none of this: its runner decides (`consumer.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_consumer::{Delivery, InMemoryBroker, InMemoryDelivery};
use idem_core::{BoxError, Disposition, Error};
use idem_sql::SqliteStore;

use super::faults::CrashPlan;
use super::ledger;

/// A copy that still fails with a retryable error after this many deliveries is dead-lettered,
/// as a broker's redrive policy would, so a broken database cannot keep the demo looping.
const MAX_DELIVERIES: u32 = 20;

/// What the naive workers decided, counted as they go. The report's ledger numbers do not come
/// from here but from the database; these explain how the database got that way.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Deliveries acked without charging: the naive check found the ID.
    pub(crate) duplicates_skipped: AtomicU64,
    /// Simulated crashes between the charge's commit and the ack.
    pub(crate) crashes: AtomicU64,
    /// Deliveries given back after a retryable error.
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

/// Everything a naive worker needs; cloned into each worker task.
#[derive(Debug, Clone)]
pub(crate) struct WorkerContext {
    /// Where deliveries come from and acks go.
    pub(crate) broker: InMemoryBroker,
    /// The ledger's database.
    pub(crate) store: SqliteStore,
    /// Which deliveries crash after their commit.
    pub(crate) crashes: CrashPlan,
    /// Shared counters.
    pub(crate) tally: Arc<Tally>,
}

/// The message ID a delivery carries, as text.
pub(crate) fn message_id(delivery: &InMemoryDelivery) -> String {
    delivery
        .header("message-id")
        .map(|id| String::from_utf8_lossy(&id).into_owned())
        .unwrap_or_default()
}

impl WorkerContext {
    /// Called right after the charge committed. Returns `true` if the worker "crashes" here:
    /// it must then neither record anything nor ack, and the broker redelivers the message
    /// once the visibility timeout passes — the window every at-least-once consumer has.
    pub(crate) fn crashes_after_commit(&self, delivery: &InMemoryDelivery) -> bool {
        let copy = usize::try_from(delivery.sequence()).unwrap_or(usize::MAX);
        let attempt = delivery.previous_deliveries().saturating_add(1);
        let crash = self.crashes.crashes_after_commit(copy, attempt);
        if crash {
            Tally::bump(&self.tally.crashes);
        }
        crash
    }

    /// Acks a delivery that needed no work.
    pub(crate) async fn skip_duplicate(&self, delivery: InMemoryDelivery) {
        Tally::bump(&self.tally.duplicates_skipped);
        ack(delivery).await;
    }

    /// Records the delivery in `dead_letters` with `reason`, then acks it.
    async fn dead_letter(&self, delivery: InMemoryDelivery, reason: &str) -> anyhow::Result<()> {
        let id = message_id(&delivery);
        ledger::dead_letter(self.store.pool(), &id, delivery.payload(), reason).await?;
        ack(delivery).await;
        Ok(())
    }

    /// Acts on a failed attempt by its disposition: retry (give it back) while attempts
    /// remain, dead-letter what cannot succeed, stop the run on a misconfiguration.
    pub(crate) async fn failed(
        &self,
        delivery: InMemoryDelivery,
        err: Error,
    ) -> anyhow::Result<()> {
        let attempt = delivery.previous_deliveries().saturating_add(1);
        match err.disposition() {
            Disposition::Retry if attempt < MAX_DELIVERIES => {
                Tally::bump(&self.tally.retries);
                delivery.abandon().await;
                Ok(())
            }
            Disposition::Retry => {
                let reason = format!("gave up after {attempt} deliveries: {err}");
                self.dead_letter(delivery, &reason).await
            }
            Disposition::Fatal => Err(anyhow::Error::new(err).context(format!(
                "processing {} failed in a way no message can get past",
                message_id(&delivery)
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

/// Acks; an ack refused because the visibility timeout passed first is the broker's business
/// (the copy was handed out again), not a failure of the worker.
pub(crate) async fn ack(delivery: InMemoryDelivery) {
    let _ = delivery.ack().await;
}
