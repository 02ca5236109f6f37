//! The processing loop: begin → claim → handler → commit, one message or a batch at a time.
//!
//! Everything a broker adapter or the HTTP layer needs sits here, on top of the store traits;
//! no caller writes claim SQL of its own. Begin and claim go to the store as one call
//! ([`ClaimStore::begin_and_claim`], [`BatchClaimStore::begin_and_claim_many`]), so a store
//! whose driver pipelines sends both in one flight.
//!
//! [`BatchClaimStore::begin_and_claim_many`]: crate::BatchClaimStore::begin_and_claim_many

mod batch;
mod builder;

use crate::clock::{Clock, StoreClock};
use crate::derived::DerivedKey;
use crate::error::{BoxError, Error, ErrorKind};
use crate::fingerprint::Fingerprint;
use crate::handler::Handler;
use crate::id::{ConsumerName, MessageId};
use crate::message::{Identified, Message};
use crate::outcome::{Claim, Outcome};
use crate::retention::Retention;
use crate::store::{ClaimRequest, ClaimStore, Prune, prune_all};

pub use batch::SetBatch;
pub use builder::ProcessorBuilder;

/// Whether claims are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimMode {
    Claim,
    Skip,
}

/// Runs handlers so that each message's effects commit exactly once, in the same transaction
/// as its claim.
///
/// ```
/// # async fn demo<S: idem_core::ClaimStore>(store: S) -> Result<(), idem_core::Error> {
/// use idem_core::{Message, MessageId, Outcome, Processor};
///
/// let processor = Processor::builder(store, "billing").build()?;
/// let msg = Message::new(MessageId::new("payment-42")?, br#"{"amount":100}"#.to_vec());
/// match processor.process(&msg, async |tx| {
///     // write the side effect through `tx`; it commits or rolls back with the claim
///     let _ = tx;
///     Ok::<_, idem_core::Error>(())
/// }).await? {
///     Outcome::Processed(()) => { /* ack */ }
///     Outcome::Duplicate => { /* ack, nothing else */ }
///     Outcome::Conflict { .. } => { /* dead-letter: same ID, different payload */ }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Processor<S, C = StoreClock> {
    store: S,
    consumer: ConsumerName,
    retention: Retention,
    max_id_len: usize,
    mode: ClaimMode,
    prune_batch: u32,
    clock: C,
}

impl<S: ClaimStore> Processor<S, StoreClock> {
    /// Starts configuring a processor for `consumer` on `store`.
    pub fn builder(store: S, consumer: impl Into<String>) -> ProcessorBuilder<S, StoreClock> {
        ProcessorBuilder::new(store, consumer)
    }
}

impl<S: ClaimStore, C: Clock> Processor<S, C> {
    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The consumer name claims are recorded under.
    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }

    /// The validated retention.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// Whether this processor writes claims: `false` in naturally idempotent mode
    /// ([`ProcessorBuilder::naturally_idempotent`]), where every message is new and a
    /// redelivery runs the handler again, so nothing may answer it as a duplicate.
    pub fn writes_claims(&self) -> bool {
        self.mode == ClaimMode::Claim
    }

    /// Key for an external side effect of `id` (see [`DerivedKey`]).
    pub fn derived_key(&self, id: &MessageId, step: &str) -> DerivedKey {
        DerivedKey::new(&self.consumer, id, step)
    }

    /// Processes one message: begin, claim, run `handler` inside the same transaction, commit.
    ///
    /// A duplicate or conflict returns without running the handler. A handler error rolls back
    /// the claim together with the handler's writes and is returned with a kind that says
    /// whether to retry or dead-letter.
    pub async fn process<M, T, E, F>(&self, msg: &M, handler: F) -> Result<Outcome<T>, Error>
    where
        M: Identified + ?Sized,
        F: AsyncFnOnce(&mut S::Tx) -> Result<T, E>,
        E: Into<BoxError>,
    {
        self.check_id(msg.message_id())?;
        let (mut tx, claim) = self.begin_claimed_one(msg).await?;
        if let Some(skipped) = claim.skipped() {
            // Nothing was written; end the transaction and report.
            let _ = self.store.rollback(tx).await;
            return Ok(skipped);
        }
        match handler(&mut tx).await {
            Ok(value) => {
                self.store.commit(tx).await?;
                Ok(Outcome::Processed(value))
            }
            Err(e) => {
                // A failed rollback means a broken connection, which the driver discards; the
                // handler's error is the one worth reporting.
                let _ = self.store.rollback(tx).await;
                Err(self.handler_error(e.into()))
            }
        }
    }

    /// [`Processor::process`] with a [`Handler`]: the runner's per-message path, and the
    /// same shape [`Processor::process_batch`] takes.
    pub async fn process_with<P, H>(
        &self,
        msg: &Message<P>,
        handler: &H,
    ) -> Result<Outcome<H::Output>, Error>
    where
        H: Handler<S::Tx, P> + ?Sized,
    {
        self.process(msg, async |tx| handler.handle(tx, msg).await)
            .await
    }

    /// The low-level claim, inside a transaction the caller owns: composes with any code that
    /// already has a transaction. Do the work only on [`Claim::New`], then commit.
    pub async fn claim_in<M>(&self, tx: &mut S::Tx, msg: &M) -> Result<Claim, Error>
    where
        M: Identified + ?Sized,
    {
        self.check_id(msg.message_id())?;
        self.claim_checked(tx, msg).await
    }

    /// The claim for a message whose ID was already checked against the limit; in naturally
    /// idempotent mode every message is new and nothing is written.
    async fn claim_checked<M>(&self, tx: &mut S::Tx, msg: &M) -> Result<Claim, Error>
    where
        M: Identified + ?Sized,
    {
        if self.mode == ClaimMode::Skip {
            return Ok(Claim::New);
        }
        let fingerprint = msg.fingerprint();
        let stored = self
            .store
            .claim(tx, self.claim_request(msg, &fingerprint))
            .await?;
        Ok(Claim::from_stored(stored, fingerprint))
    }

    /// Begins a transaction with the claim of a message whose ID was already checked, through
    /// [`ClaimStore::begin_and_claim`] (one flight on a pipelining store); in naturally
    /// idempotent mode a plain `begin`, and every message is new. On an error no transaction
    /// is left open.
    async fn begin_claimed_one<M>(&self, msg: &M) -> Result<(S::Tx, Claim), Error>
    where
        M: Identified + ?Sized,
    {
        if self.mode == ClaimMode::Skip {
            return Ok((self.store.begin().await?, Claim::New));
        }
        let fingerprint = msg.fingerprint();
        let (tx, stored) = self
            .store
            .begin_and_claim(self.claim_request(msg, &fingerprint))
            .await?;
        Ok((tx, Claim::from_stored(stored, fingerprint)))
    }

    fn claim_request<'a, M>(&'a self, msg: &'a M, fingerprint: &'a Fingerprint) -> ClaimRequest<'a>
    where
        M: Identified + ?Sized,
    {
        ClaimRequest {
            consumer: &self.consumer,
            id: msg.message_id(),
            fingerprint,
            at: self.clock.stamp(),
        }
    }

    /// Deletes this consumer's claims older than [`Retention::prune_age`] (the retention, and
    /// never less than the redelivery window plus the clock margin), in bounded batches, on the
    /// clock claims are stamped with.
    pub async fn prune(&self) -> Result<u64, Error>
    where
        S: Prune,
    {
        prune_all(
            &self.store,
            Some(&self.consumer),
            self.clock.stamp(),
            self.retention.prune_age(),
            self.prune_batch,
        )
        .await
    }

    fn check_id(&self, id: &MessageId) -> Result<(), Error> {
        if id.len() > self.max_id_len {
            return Err(Error::new(
                ErrorKind::InvalidMessageId,
                format!(
                    "message ID is {} bytes, over the limit of {} bytes",
                    id.len(),
                    self.max_id_len
                ),
            ));
        }
        Ok(())
    }

    /// Turns a handler's error into an idem [`Error`]: keeps an explicit idem error's kind (e.g.
    /// [`Error::reject`]), lets the store recognise its driver's errors (a deadlock is
    /// transient, a connection broken under the handler
    /// [`ConnectionLost`](ErrorKind::ConnectionLost)), makes a refusal of the handler's own
    /// statement (a missing table, a privilege, a row-level-security check) this message's
    /// failure rather than a misconfiguration that stops a consumer, and treats anything else
    /// as a retryable handler failure (see [`crate::store::handler_error`]). Public for callers
    /// that drive the transaction themselves with [`Processor::claim_in`].
    pub fn handler_error(&self, e: BoxError) -> Error {
        crate::store::handler_error(&self.store, e)
    }
}
