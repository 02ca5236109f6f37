//! Settling deliveries: the one place that decides ack, retry, dead letter or abandon.

use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::join_all;
use idem_core::{
    ClaimStore, Clock, Disposition, Error, Fingerprint, Identified, Message, MessageId, Outcome,
    Processor, RequestErrorKind,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::crash::{self, CrashPoint};
use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::decode::Decode;
use crate::id_source::IdSource;
use crate::metrics::Instruments;
use crate::retry::RetryPolicy;
use crate::source::Delivery;

use super::work::Work;

/// Everything a message task needs, shared by all tasks of one run.
pub(crate) struct Ctx<S, C, D, W> {
    pub(crate) processor: std::sync::Arc<Processor<S, C>>,
    pub(crate) decoder: D,
    /// The mode's transactions, around the user's handler.
    pub(crate) work: W,
    pub(crate) id_source: IdSource,
    pub(crate) retry: RetryPolicy,
    pub(crate) consumer: String,
    pub(crate) broker: &'static str,
    pub(crate) instruments: Instruments,
    /// Cancelled on shutdown or after a fatal error: no new fetches, no further retries.
    pub(crate) stop: CancellationToken,
    pub(crate) fatal: Mutex<Option<Error>>,
    pub(crate) after_commit: Option<super::AfterCommit>,
    /// Claims this process committed ([`Consumer::local_cache`](crate::Consumer::local_cache)).
    pub(crate) cache: Option<crate::cache::ClaimCache>,
}

/// How many bytes of a message ID logs and dead-letter details show.
const SHOWN_ID_BYTES: usize = 128;

/// A message ID for span fields and dead-letter details. The ID is validated against the
/// store's limit only later, so this is where an oversized one (poison, up to what the
/// broker carries: megabytes) passes by: it is cut, with its length, instead of becoming a
/// megabyte log field or a dead-letter header the broker refuses.
struct ShownId<'a>(&'a MessageId);

impl std::fmt::Display for ShownId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bytes = self.0.as_bytes();
        if bytes.len() <= SHOWN_ID_BYTES {
            return self.0.fmt(f);
        }
        match MessageId::with_limit(&bytes[..SHOWN_ID_BYTES], usize::MAX) {
            Ok(head) => write!(f, "{head}… ({} bytes)", bytes.len()),
            Err(_) => write!(f, "({} bytes)", bytes.len()),
        }
    }
}

impl<S, C, D, W> Ctx<S, C, D, W>
where
    S: ClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    D: Decode,
    W: Work<S, C, D::Payload>,
{
    fn span<Dl: Delivery>(&self, delivery: &Dl) -> tracing::Span {
        tracing::info_span!(
            "idem.delivery",
            consumer = %self.consumer,
            broker = self.broker,
            origin = %delivery.origin(),
            message_id = tracing::field::Empty,
        )
    }

    /// Reads the ID and decodes the payload, or says why the message is poison.
    fn prepare<Dl: Delivery>(&self, delivery: &Dl) -> Result<Message<D::Payload>, DeadLetter> {
        let raw = self.id_source.extract(delivery)?;
        // The store's own limit is checked by the processor (InvalidMessageId → invalid-id);
        // here only emptiness matters, so no limit is imposed twice.
        let id = MessageId::with_limit(&raw, usize::MAX)
            .map_err(|e| DeadLetter::new(DeadLetterReason::MissingId, e.to_string()))?;
        let bytes = delivery.payload();
        let payload = self.decoder.decode(bytes).map_err(|e| {
            DeadLetter::new(
                DeadLetterReason::Undecodable,
                format!("payload of message {} does not decode: {e}", ShownId(&id)),
            )
        })?;
        // The fingerprint covers the bytes as published, so a re-encoded equal value is still
        // the same message and any byte change is a conflict.
        Ok(Message::with_fingerprint(
            id,
            Fingerprint::of(bytes),
            payload,
        ))
    }

    /// One delivery, per-message mode.
    pub(crate) async fn settle_one<Dl: Delivery>(&self, delivery: Dl) {
        let span = self.span(&delivery);
        async {
            match self.prepare(&delivery) {
                Ok(msg) => {
                    tracing::Span::current().record(
                        "message_id",
                        tracing::field::display(ShownId(msg.message_id())),
                    );
                    let first = delivery.previous_deliveries().saturating_add(1);
                    self.process_with_retries(delivery, msg, first).await;
                }
                Err(dl) => self.dead_letter(delivery, dl, 0).await,
            }
        }
        .instrument(span)
        .await
    }

    /// Many deliveries, one transaction; failures retried one by one.
    pub(crate) async fn settle_batch<Dl: Delivery>(&self, deliveries: Vec<Dl>) {
        let mut ready = Vec::with_capacity(deliveries.len());
        let mut msgs = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            match self.prepare(&d) {
                Ok(m) => {
                    ready.push(d);
                    msgs.push(m);
                }
                Err(dl) => {
                    let span = self.span(&d);
                    self.dead_letter(d, dl, 0).instrument(span).await;
                }
            }
        }
        if let Some(cache) = &self.cache {
            // Redeliveries of what this process committed: acked before the batch's claim.
            let hits = cache.take_answered(&mut ready, &mut msgs);
            join_all(hits.into_iter().map(|(d, msg)| self.cache_hit(d, msg))).await;
        }
        if msgs.is_empty() {
            return;
        }
        let size = msgs.len();
        let claimed_since = std::time::Instant::now();
        let span = tracing::info_span!("idem.batch", consumer = %self.consumer, broker = self.broker, size);
        let result = self
            .work
            .many(&self.processor, &msgs, &self.instruments)
            .instrument(span.clone())
            .await;
        match result {
            Ok(results) => {
                // Settle what committed first: a failing neighbour's retries must not delay
                // those acks past the broker's ack deadline. Then retry the failures together.
                let mut done = Vec::new();
                let mut failed = Vec::new();
                for ((d, msg), r) in ready.into_iter().zip(msgs).zip(results) {
                    let span = self.span(&d);
                    span.record(
                        "message_id",
                        tracing::field::display(ShownId(msg.message_id())),
                    );
                    match r {
                        Ok(outcome) => {
                            if let (Some(c), Outcome::Processed(())) = (&self.cache, &outcome) {
                                c.fill(&msg, claimed_since);
                            }
                            done.push((d, msg, outcome, span));
                        }
                        Err(e) => failed.push((d, msg, e, span)),
                    }
                }
                // Acks in flight together: on brokers whose ack is a round trip (a NATS double
                // ack) a batch would otherwise wait for them one by one.
                join_all(done.into_iter().map(|(d, msg, outcome, span)| async move {
                    self.finish(d, &msg, outcome).instrument(span).await
                }))
                .await;
                join_all(failed.into_iter().map(|(d, msg, e, span)| {
                    let attempt = d.previous_deliveries().saturating_add(1);
                    self.after_failure(d, msg, e, attempt).instrument(span)
                }))
                .await;
            }
            Err(e) => {
                // Nothing committed. The batch's failure says nothing about any one message
                // (often a deadlock or a lost connection), so it costs none of them an attempt:
                // each is processed again on its own, concurrently.
                tracing::warn!(parent: &span, error = %e, "batch did not commit; processing its messages one by one");
                join_all(ready.into_iter().zip(msgs).map(|(d, msg)| {
                    let span = self.span(&d);
                    span.record(
                        "message_id",
                        tracing::field::display(ShownId(msg.message_id())),
                    );
                    let attempt = d.previous_deliveries().saturating_add(1);
                    self.process_with_retries(d, msg, attempt).instrument(span)
                }))
                .await;
            }
        }
    }

    async fn attempt(&self, msg: &Message<D::Payload>) -> Result<Outcome<()>, Error> {
        if self.cache.as_ref().is_some_and(|c| c.answers(msg)) {
            self.instruments.cache_hit();
            return Ok(Outcome::Duplicate);
        }
        let claimed_since = std::time::Instant::now();
        let outcome = self.work.one(&self.processor, msg, &self.instruments).await;
        if let (Some(c), Ok(Outcome::Processed(()))) = (&self.cache, &outcome) {
            c.fill(msg, claimed_since);
        }
        outcome
    }

    /// Settles a delivery the local cache answered: a duplicate of a claim this process
    /// committed.
    async fn cache_hit<Dl: Delivery>(&self, delivery: Dl, msg: Message<D::Payload>) {
        let span = self.span(&delivery);
        span.record(
            "message_id",
            tracing::field::display(ShownId(msg.message_id())),
        );
        self.instruments.cache_hit();
        self.finish(delivery, &msg, Outcome::Duplicate)
            .instrument(span)
            .await;
    }

    async fn process_with_retries<Dl: Delivery>(
        &self,
        delivery: Dl,
        msg: Message<D::Payload>,
        attempt: u32,
    ) {
        match self.attempt(&msg).await {
            Ok(outcome) => self.finish(delivery, &msg, outcome).await,
            Err(e) => self.after_failure(delivery, msg, e, attempt).await,
        }
    }

    /// Retries `msg` after error `e` on attempt `attempt`, until success, a non-retryable
    /// error, the last attempt or shutdown.
    async fn after_failure<Dl: Delivery>(
        &self,
        delivery: Dl,
        msg: Message<D::Payload>,
        mut e: Error,
        mut attempt: u32,
    ) {
        let mut outage_waits = 0u32;
        // Consecutive waits for another consumer's lease on a phased message's record.
        let mut held_waits = 0u32;
        // Held while this message waits out a store outage: the gauge stays raised until the
        // last waiting message gets past it.
        let mut waiting: Option<OutageWait<'_>> = None;
        // Lost connections counted against this message.
        let mut lost = 0u32;
        loop {
            match e.disposition() {
                Disposition::Retry => {}
                Disposition::DeadLetter => {
                    drop(waiting.take());
                    if e.request_kind() == Some(RequestErrorKind::KeyReused) {
                        // A phased message's record has another payload's fingerprint.
                        self.instruments.conflict();
                    }
                    let dl = DeadLetter::from_error(&e, false);
                    return self.dead_letter(delivery, dl, attempt).await;
                }
                _ => {
                    drop(waiting.take());
                    tracing::error!(error = %e, "fatal error; stopping the consumer");
                    self.set_fatal(e);
                    self.instruments.abandoned();
                    return delivery.abandon().await;
                }
            }
            if self.stop.is_cancelled() {
                drop(waiting.take());
                tracing::debug!(error = %e, attempt, "shutting down; leaving the message to redelivery");
                self.instruments.abandoned();
                return delivery.abandon().await;
            }
            // The database, not the message, is the problem: retry in place for as long as
            // the outage lasts (capped backoff), without spending the message's attempts.
            // Dead-lettering would empty the queue into the dead letters, and giving the
            // message back would have brokers that redeliver at once spin on it. A connection
            // lost while the message ran is the exception the verdict below finds.
            let verdict = self.verdict(&e, waiting.as_ref()).await;
            if verdict.held {
                held_waits = held_waits.saturating_add(1);
                self.instruments.held_elsewhere();
            } else {
                held_waits = 0;
            }
            if verdict.outage {
                outage_waits = outage_waits.saturating_add(1);
                match &mut waiting {
                    Some(w) => w.check_limit(self.retry.outage_limit()),
                    None => waiting = Some(OutageWait::begin(&self.instruments, &e)),
                }
            } else {
                drop(waiting.take());
                outage_waits = 0;
            }
            if verdict.spends {
                if e.is_connection_lost() {
                    lost = lost.saturating_add(1);
                    self.instruments.connection_lost();
                }
                if attempt >= self.retry.max_attempts() {
                    drop(waiting.take());
                    let dl = if e.is_connection_lost() {
                        DeadLetter::connection_lost(&e, lost)
                    } else {
                        DeadLetter::from_error(&e, true)
                    };
                    return self.dead_letter(delivery, dl, attempt).await;
                }
            }
            self.instruments.retry();
            let wait = if verdict.held {
                // Not sooner than backoff, not later than the holder's lease runs out.
                let backoff = self.retry.delay(held_waits.saturating_add(1));
                e.retry_after()
                    .map_or(backoff, |at_most| backoff.min(at_most))
            } else if verdict.outage {
                self.retry.delay(outage_waits.saturating_add(1))
            } else {
                self.retry.delay(attempt + 1)
            };
            if verdict.held {
                tracing::debug!(error = %e, retry_in = ?wait, "another consumer holds this message's record; retrying when its lease may have ended");
            } else if !verdict.spends {
                // The outage itself was reported once; per message it is detail.
                tracing::debug!(error = %e, attempt, retry_in = ?wait, "store unavailable; waiting in place");
            } else if e.is_connection_lost() {
                tracing::warn!(error = %e, attempt, retry_in = ?wait, "the connection was lost while processing the message and the store is up (or down past the outage limit); retrying, spending an attempt");
            } else {
                tracing::warn!(error = %e, attempt, retry_in = ?wait, "processing failed; retrying");
            }
            // A zero backoff (a policy that retries at once) needs no timer: not waiting on
            // one also lets the randomized-schedule tests, which have none, explore retries.
            if !wait.is_zero() {
                tokio::select! {
                    _ = self.stop.cancelled() => continue, // handled at the top of the loop
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            if verdict.spends {
                attempt += 1;
            }
            match self.attempt(&msg).await {
                Ok(outcome) => {
                    drop(waiting.take());
                    return self.finish(delivery, &msg, outcome).await;
                }
                Err(next) => e = next,
            }
        }
    }

    /// Whether retryable error `e` is an outage to wait out and whether it spends an attempt.
    ///
    /// Anything but an outage spends one. An outage that struck before the message ran (the
    /// store unreachable or refusing `BEGIN` or the claim), or a refusal of the store's state
    /// (read-only, full) spends none: it says nothing about the message. A connection lost
    /// while the message ran is ambiguous, so the store is probed on another connection: if it
    /// answers, the store is up and the message's own statements likely ended their session
    /// (not an outage; an attempt). If not, it is an outage, which spends no attempt until this
    /// message has waited it out past the outage limit: an outage that strikes every time the
    /// message runs is the message (it crashes the database, and the database restarts).
    ///
    /// A phased message whose record another consumer holds (its lease is live) is neither:
    /// it waits for that lease, spending no attempt, however long the holder takes.
    async fn verdict(&self, e: &Error, waiting: Option<&OutageWait<'_>>) -> Verdict {
        if e.request_kind() == Some(RequestErrorKind::InProgress) {
            return Verdict {
                outage: false,
                spends: false,
                held: true,
            };
        }
        if !e.is_outage() {
            return Verdict {
                outage: false,
                spends: true,
                held: false,
            };
        }
        if !e.is_connection_lost() {
            return Verdict {
                outage: true,
                spends: false,
                held: false,
            };
        }
        let probe = tokio::time::timeout(PROBE_TIMEOUT, self.processor.store().probe()).await;
        match probe {
            Ok(Ok(())) => Verdict {
                outage: false,
                spends: true,
                held: false,
            },
            failed => {
                if let Ok(Err(p)) = failed {
                    tracing::debug!(error = %e, probe = %p, "connection lost and the store does not answer: an outage");
                }
                Verdict {
                    outage: true,
                    spends: waiting.is_some_and(|w| w.over(self.retry.outage_limit())),
                    held: false,
                }
            }
        }
    }

    /// Settles a delivery whose processing reached an outcome.
    async fn finish<Dl: Delivery>(
        &self,
        delivery: Dl,
        msg: &Message<D::Payload>,
        outcome: Outcome<()>,
    ) {
        match outcome {
            Outcome::Processed(_) => {
                self.instruments.processed();
                tracing::debug!(outcome = "processed", "committed");
                if let Some(hook) = &self.after_commit {
                    hook.call();
                }
                self.ack(delivery).await;
            }
            Outcome::Duplicate => {
                self.instruments.duplicate();
                tracing::debug!(
                    outcome = "duplicate",
                    "already processed; acknowledged without running the handler"
                );
                self.ack(delivery).await;
            }
            conflict @ Outcome::Conflict { .. } => {
                self.instruments.conflict();
                let dl = DeadLetter::conflict(msg.message_id(), &conflict);
                self.dead_letter(delivery, dl, 1).await;
            }
        }
    }

    async fn ack<Dl: Delivery>(&self, delivery: Dl) {
        crash::reached(CrashPoint::AfterCommit);
        if let Err(e) = delivery.ack().await {
            self.instruments.ack_failure();
            tracing::warn!(error = %e, "acknowledgement failed after commit; the broker will redeliver and the claim makes that a duplicate");
        }
    }

    async fn dead_letter<Dl: Delivery>(&self, delivery: Dl, dl: DeadLetter, attempts: u32) {
        let dl = dl.with_context(&self.consumer, attempts);
        match delivery.dead_letter(&dl).await {
            Ok(()) => {
                self.instruments.dead_lettered(dl.reason());
                tracing::warn!(outcome = "dead_lettered", reason = %dl.reason(), detail = dl.detail(), "dead-lettered");
            }
            Err(e) => {
                self.instruments.broker_error();
                tracing::error!(error = %e, reason = %dl.reason(), "dead-lettering failed; the message stays unacknowledged for the broker to redeliver");
            }
        }
    }

    fn set_fatal(&self, e: Error) {
        let mut slot = self.fatal.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(super::fatal(e));
        }
        self.stop.cancel();
    }
}

/// How long a probe of the store may take before it counts as unanswered.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a retryable error means for the message: see [`Ctx::verdict`].
#[derive(Debug, Clone, Copy)]
struct Verdict {
    /// The store is down or refusing: wait in place, with the outage raised.
    outage: bool,
    /// The error counts against the message's attempts.
    spends: bool,
    /// Another consumer holds the message's record (a phased message): wait for its lease.
    held: bool,
}

/// One message's share in a store outage; ends it (for this message) when dropped.
struct OutageWait<'a> {
    instruments: &'a Instruments,
    since: Instant,
    /// Whether this message's overrun of the outage limit was counted.
    over_limit: bool,
}

impl<'a> OutageWait<'a> {
    fn begin(instruments: &'a Instruments, e: &Error) -> Self {
        instruments.outage_began(e);
        Self {
            instruments,
            since: Instant::now(),
            over_limit: false,
        }
    }

    /// Whether this message has waited longer than `limit`.
    fn over(&self, limit: Duration) -> bool {
        self.since.elapsed() >= limit
    }

    /// Counts (once) this message's wait going over `limit`.
    fn check_limit(&mut self, limit: Duration) {
        if !self.over_limit && self.over(limit) {
            self.over_limit = true;
            self.instruments
                .outage_limit_exceeded(self.since.elapsed(), limit);
        }
    }
}

impl Drop for OutageWait<'_> {
    fn drop(&mut self) {
        self.instruments.outage_ended();
    }
}

#[cfg(test)]
mod shown_id_tests {
    use super::*;

    #[test]
    fn long_ids_are_cut_with_their_length_and_short_ones_shown_whole() {
        let short = MessageId::new("pay-1").unwrap();
        assert_eq!(ShownId(&short).to_string(), "pay-1");
        let long = MessageId::with_limit("x".repeat(10 << 20), usize::MAX).unwrap();
        let shown = ShownId(&long).to_string();
        assert!(shown.len() < 200, "{} bytes shown", shown.len());
        assert!(
            shown.ends_with(&format!("… ({} bytes)", 10 << 20)),
            "{shown}"
        );
    }
}
