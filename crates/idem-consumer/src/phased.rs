//! Recovery points from consumer handlers (feature `phases`): a message whose handler makes
//! an external call (a card processor, an email, another idem API) runs as an operation of
//! phases ([`idem_request::Idempotency::run_phases`]) instead of one claim transaction.
//!
//! A plain handler's effects commit with the message's claim, in one transaction. A call to
//! a third party cannot join that transaction, and holding the claim's transaction open
//! while the phases commit through other connections would deadlock on SQLite (one writer)
//! and double the work elsewhere. So a phased message claims nothing in the claims table: its
//! idempotency is the **request record** keyed by the message ID ([`message_key`]) in a scope
//! naming the consumer ([`Phased::scope`]), and each phase boundary is one commit of the
//! phase's writes and the record's recovery point.
//!
//! | delivery | what happens |
//! |---|---|
//! | first | the phases run from [`PhasedHandler::first`]; ack after the last one committed |
//! | redelivery of a finished (or abandoned) message | ack, nothing runs (a duplicate, `debug` log) |
//! | redelivery after the process died mid-phase | once the dead executor's lease is past, the record is taken over and resumed at its last recovery point: a committed local phase never runs again; a foreign call repeats, with the same derived key ([`PhaseCtx::foreign_key`](idem_request::PhaseCtx::foreign_key)) |
//! | redelivery while another live consumer holds the record | retried later with backoff, in place, spending no attempt; never dead-lettered, never acked as done |
//! | same ID, different payload | dead-lettered, reason `conflict` |
//! | a phase fails (`Err`) | its writes roll back, the record keeps its point; retried with backoff (an attempt each), resumed at the point; `retries-exhausted` after the last |
//! | [`Step::Abandon`] | the record is stored abandoned with the phase's writes; ack |
//! | the store is unreachable or refusing | an outage: waited out in place, never a dead letter |
//!
//! The step function sees only the phase and its context, never the message: the
//! [`Completer`](idem_request::Completer) finishes records whose redelivery never came (the
//! broker dead-lettered it, the stream was purged) with the same function
//! ([`Phased::register`]), so whatever a phase needs from the message goes into the first
//! phase's state.
//!
//! ```no_run
//! # async fn demo<Src: idem_consumer::Source>(source: Src) -> Result<(), idem_core::Error> {
//! use std::sync::Arc;
//! use idem_consumer::phased::{Phased, PhasedHandler};
//! use idem_consumer::{Consumer, Json, shutdown};
//! use idem_core::{BoxError, Message, Processor, Recovery};
//! use idem_request::{Idempotency, PhaseCtx, Step};
//! use idem_sql::{SqliteOptions, SqliteStore};
//!
//! #[derive(serde::Deserialize)]
//! struct Payment { account: String, amount_cents: i64 }
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! enum Phase {
//!     Charge { account: String, amount_cents: i64 },
//!     Record { account: String, amount_cents: i64, charge_id: String },
//! }
//!
//! struct Card;
//! impl PhasedHandler<SqliteStore, Payment> for Card {
//!     type Phase = Phase;
//!     type Output = String;
//!     fn first(&self, msg: &Message<Payment>) -> Result<Phase, BoxError> {
//!         let p = msg.payload();
//!         Ok(Phase::Charge { account: p.account.clone(), amount_cents: p.amount_cents })
//!     }
//!     async fn step(&self, phase: Phase, ctx: &mut PhaseCtx<SqliteStore>) -> Result<Step<Phase, String>, BoxError> {
//!         Ok(match phase {
//!             Phase::Charge { account, amount_cents } => {
//!                 let _key = ctx.foreign_key("charge"); // send as Idempotency-Key
//!                 let charge_id = "ch_1".to_owned(); // the processor's answer
//!                 Step::Next(Phase::Record { account, amount_cents, charge_id })
//!             }
//!             Phase::Record { account, amount_cents, charge_id } => {
//!                 sqlx::query("INSERT INTO charges (account, amount_cents, processor_charge_id) VALUES (?, ?, ?)")
//!                     .bind(&account).bind(amount_cents).bind(&charge_id)
//!                     .execute(&mut **ctx.tx()).await?;
//!                 Step::Done(charge_id)
//!             }
//!         })
//!     }
//!     fn abandoned(&self, _recovery: &Recovery) -> String { "gave up".into() }
//! }
//!
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! let processor = Arc::new(Processor::builder(store.clone(), "billing").build()?);
//! let phased = Phased::new(Idempotency::builder(store).build()?, "billing", Card);
//! let stats = Consumer::new(processor, source)
//!     .run_phased(Json::<Payment>::new(), phased, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idem_core::store::RecoveryStore;
use idem_core::{
    BoxError, Error, ErrorKind, IdempotencyKey, Identified, Message, MessageId, Recovery,
    RequestErrorKind, RequestScope,
};
use idem_request::{CompleterBuilder, Idempotency, PhaseCtx, Step};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A consumer handler run as recovery points: the message's first phase, then one phase at
/// a time until [`Step::Done`] or [`Step::Abandon`].
pub trait PhasedHandler<S: RecoveryStore, P>: Send + Sync + 'static {
    /// The operation's phases: a serde enum whose variant names are the recovery points and
    /// whose fields are what each phase needs (see [`Idempotency::run_phases`]).
    type Phase: Serialize + DeserializeOwned + Send + 'static;
    /// What the operation ends with, stored with the record.
    type Output: Serialize + DeserializeOwned + Send + 'static;

    /// The first phase of `msg`, carrying what the later phases need from the message (the
    /// completer resumes without it). `Err` rejects the message: validation lives here, and
    /// an [`Error::reject`] (or any error) dead-letters it, reason `rejected`, before any
    /// record is written.
    fn first(&self, msg: &Message<P>) -> Result<Self::Phase, BoxError>;

    /// Runs one phase: local writes through [`PhaseCtx::tx`], external calls with
    /// [`PhaseCtx::foreign_key`]. Used by the consumer and by the completer alike.
    fn step(
        &self,
        phase: Self::Phase,
        ctx: &mut PhaseCtx<S>,
    ) -> impl Future<Output = Result<Step<Self::Phase, Self::Output>, BoxError>> + Send;

    /// The output stored when the completer gives a record up after its last attempt
    /// ([`CompleterBuilder::max_attempts`]); a redelivery of that message is then a duplicate.
    fn abandoned(&self, recovery: &Recovery) -> Self::Output;
}

/// What [`Phased::process`] did with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PhasedOutcome<R> {
    /// Phases ran (from the first, or resumed at the record's last point) and the operation
    /// ended with [`Step::Done`].
    Done(R),
    /// Phases ran and the operation ended with [`Step::Abandon`]: stored as abandoned.
    Abandoned(R),
    /// The record had ended before (done or abandoned, by an earlier delivery or the
    /// completer): nothing ran.
    Duplicate,
}

/// A [`PhasedHandler`] bound to its record store and scope: what a consumer runs
/// ([`Consumer::run_phased`](crate::Consumer::run_phased)) and the completer resumes
/// ([`register`](Self::register)).
pub struct Phased<S: RecoveryStore + Clone + 'static, H> {
    idem: Idempotency<S>,
    scope: RequestScope,
    name: String,
    handler: Arc<H>,
}

impl<S: RecoveryStore + Clone + 'static, H> std::fmt::Debug for Phased<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phased")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<S: RecoveryStore + Clone + 'static, H> Clone for Phased<S, H> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            scope: self.scope,
            name: self.name.clone(),
            handler: Arc::clone(&self.handler),
        }
    }
}

/// The boxed future of one phase: boxed so the operation's future is provably `Send`.
type StepFuture<'a, P, R> = Pin<Box<dyn Future<Output = Result<Step<P, R>, BoxError>> + Send + 'a>>;

/// Pins a step closure's signature: the future borrows only the phase's context.
fn stepper<S, P, R, F>(f: F) -> F
where
    S: RecoveryStore,
    F: for<'a> FnMut(P, &'a mut PhaseCtx<S>) -> StepFuture<'a, P, R>,
{
    f
}

/// The prefix of a record key that holds a message ID in hex (see [`message_key`]).
const HEX_PREFIX: &str = "~x";

/// The record key of a message ID: the ID itself when it is visible ASCII (an
/// [`IdempotencyKey`]'s alphabet) and does not begin with `~x`; otherwise `~x` and the ID's
/// bytes in hex. One ID, one key, and no two IDs share one. An ID the store's key limit
/// refuses is an [`InvalidMessageId`](ErrorKind::InvalidMessageId), dead-lettered
/// `invalid-id` by the runner.
pub fn message_key(id: &MessageId) -> Result<IdempotencyKey, Error> {
    let bytes = id.as_bytes();
    let plain = std::str::from_utf8(bytes)
        .ok()
        .filter(|s| !s.starts_with(HEX_PREFIX) && s.bytes().all(|b| b.is_ascii_graphic()));
    let key = match plain {
        Some(s) => IdempotencyKey::with_limit(s, usize::MAX),
        None => {
            let mut s = String::with_capacity(HEX_PREFIX.len() + 2 * bytes.len());
            s.push_str(HEX_PREFIX);
            idem_core::hex::push(&mut s, bytes);
            IdempotencyKey::with_limit(&s, usize::MAX)
        }
    };
    key.map_err(invalid_id)
}

fn invalid_id(e: Error) -> Error {
    Error::new(
        ErrorKind::InvalidMessageId,
        format!("the message ID cannot key a recovery record: {e}"),
    )
    .with_source(e)
}

impl<S, H> Phased<S, H>
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: Send,
{
    /// `handler` for consumer `consumer`, its records in `idem`'s store. The scope is
    /// `("idem-consumer/phases", consumer)`: two consumers of the same message keep records
    /// of their own, as their claims would be.
    pub fn new(idem: Idempotency<S>, consumer: &str, handler: H) -> Self {
        Self {
            idem,
            scope: RequestScope::new(["idem-consumer/phases", consumer]),
            name: consumer.to_owned(),
            handler: Arc::new(handler),
        }
    }

    /// The scope of this consumer's records (what [`register`](Self::register) registers).
    pub fn scope(&self) -> RequestScope {
        self.scope
    }

    /// The engine the records live in.
    pub fn idempotency(&self) -> &Idempotency<S> {
        &self.idem
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Runs `msg`'s operation, or resumes it at its last recovery point, or finds it ended.
    ///
    /// Errors, by kind: [`RequestErrorKind::InProgress`] (another executor holds the record;
    /// ask again after [`Error::retry_after`]), [`RequestErrorKind::KeyReused`] (the same ID
    /// was processed with another payload: a conflict), [`ErrorKind::InvalidMessageId`], the
    /// store's own kinds (an outage is [`Error::is_outage`]), and a phase's error as
    /// [`ErrorKind::Handler`] (or the kind of an [`Error`] it returned).
    pub async fn process<P>(&self, msg: &Message<P>) -> Result<PhasedOutcome<H::Output>, Error>
    where
        H: PhasedHandler<S, P>,
    {
        let key = message_key(msg.message_id())?;
        // The payload as published, fingerprinted by the runner: the same bytes are the same
        // message, any other bytes a conflict.
        let input = idem_core::hex::encode(msg.fingerprint().as_bytes());
        let first = self
            .handler
            .first(msg)
            .map_err(|e| match e.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(e) => Error::reject(e),
            })?;
        // Whether a phase ran (a record that had ended runs none), and how the last ended.
        let ran = Arc::new(AtomicBool::new(false));
        let abandoned = Arc::new(AtomicBool::new(false));
        let step = {
            let handler = Arc::clone(&self.handler);
            let abandoned = Arc::clone(&abandoned);
            let ran = Arc::clone(&ran);
            stepper::<S, H::Phase, H::Output, _>(move |phase, ctx| {
                ran.store(true, Ordering::Relaxed);
                let (handler, abandoned) = (Arc::clone(&handler), Arc::clone(&abandoned));
                Box::pin(async move {
                    let step = handler.step(phase, ctx).await?;
                    if matches!(step, Step::Abandon(_)) {
                        abandoned.store(true, Ordering::Relaxed);
                    }
                    Ok(step)
                })
            })
        };
        let result = self
            .idem
            .run_phases(self.scope, &key, &input, first, step)
            .await;
        match result {
            Ok(_) if !ran.load(Ordering::Relaxed) => Ok(PhasedOutcome::Duplicate),
            Ok(out) if abandoned.load(Ordering::Relaxed) => Ok(PhasedOutcome::Abandoned(out)),
            Ok(out) => Ok(PhasedOutcome::Done(out)),
            Err(e) if e.request_kind() == Some(RequestErrorKind::InvalidKey) => Err(invalid_id(e)),
            Err(e) => Err(e),
        }
    }

    /// Registers this handler's records with a completer: a record stuck past its lease
    /// (its redelivery never came) is resumed with the same [`PhasedHandler::step`], and one
    /// past the completer's attempts is given up with [`PhasedHandler::abandoned`].
    pub fn register<P>(&self, builder: CompleterBuilder<S>) -> CompleterBuilder<S>
    where
        H: PhasedHandler<S, P>,
    {
        let resume_with = Arc::clone(&self.handler);
        let give_up_with = Arc::clone(&self.handler);
        builder.operation(
            self.scope,
            format!("{} (phased consumer)", self.name),
            move |idem: Idempotency<S>, stuck| {
                let handler = Arc::clone(&resume_with);
                async move {
                    let step = stepper::<S, H::Phase, H::Output, _>(move |phase, ctx| {
                        let handler = Arc::clone(&handler);
                        Box::pin(async move { handler.step(phase, ctx).await })
                    });
                    idem.resume_phases(stuck, step).await.map(drop)
                }
            },
            move |execution, recovery| {
                let output = give_up_with.abandoned(&recovery);
                async move {
                    let bytes = serde_json::to_vec(&output).map_err(|e| {
                        Error::new(
                            ErrorKind::InvalidConfig,
                            format!("the abandoned output does not serialize: {e}"),
                        )
                        .with_source(e)
                    })?;
                    execution
                        .give_up(&bytes, async |_: &mut S::Tx| Ok::<(), Error>(()))
                        .await
                }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(id: &[u8]) -> String {
        let id = MessageId::with_limit(id, usize::MAX).expect("id");
        message_key(&id).expect("key").as_str().to_owned()
    }

    #[test]
    fn a_visible_ascii_id_is_its_own_key_and_any_other_is_hex() {
        assert_eq!(key_of(b"pay-1"), "pay-1");
        assert_eq!(
            key_of(b"pay 1"),
            "~x7061792031",
            "a space is not visible ASCII"
        );
        assert_eq!(key_of("café".as_bytes()), "~x636166c3a9");
        assert_eq!(key_of(&[0, 255]), "~x00ff");
    }

    #[test]
    fn no_two_ids_share_a_key() {
        // An ID that looks like another's hex form is itself hex-encoded.
        let hexed = key_of(b"pay 1");
        assert_ne!(key_of(hexed.as_bytes()), hexed);
        assert_eq!(key_of(b"~x"), "~x7e78");
    }
}
