//! The user's side effect, run inside the transaction that records the claim: the one handler
//! shape of idem, for one message and for batches, in the processor and in the runner.

use std::future::Future;

use crate::error::BoxError;
use crate::message::Message;

/// Handles one message inside the store's transaction `Tx`.
///
/// Write every database effect through `tx`: it commits together with the claim, or not at
/// all. Propagate database errors with `?` (the store recognises deadlocks and serialization
/// failures as transient); return [`Error::reject`](crate::Error::reject) for a message that
/// can never succeed (dead-lettered at once) and [`Error::retry`](crate::Error::retry) or any
/// other error for one worth retrying. Calls to external systems should carry a key derived
/// from the message ID (see [`Processor::derived_key`](crate::Processor::derived_key)),
/// because a call made before a crash still happened.
///
/// A trait rather than a closure so that its future is known to be `Send`: the runner spawns
/// batches on tokio's worker threads, and rustc cannot yet prove an `AsyncFnMut` closure's
/// higher-ranked future `Send` (rust-lang/rust#151398). For one message,
/// [`Processor::process`](crate::Processor::process) also takes a closure, as sugar.
///
/// ```
/// use idem_core::{BoxError, Handler, Message};
///
/// /// Counts charges into a `Vec` standing in for a transaction.
/// struct Charge;
///
/// impl Handler<Vec<u64>, u64> for Charge {
///     type Output = ();
///     async fn handle(&self, tx: &mut Vec<u64>, msg: &Message<u64>) -> Result<(), BoxError> {
///         tx.push(*msg.payload());
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<Tx, P>: Send + Sync {
    /// What a processed message yields (often `()`).
    type Output: Send;

    /// Applies `msg`'s effects through `tx`.
    fn handle(
        &self,
        tx: &mut Tx,
        msg: &Message<P>,
    ) -> impl Future<Output = Result<Self::Output, BoxError>> + Send;
}

impl<Tx, P, H: Handler<Tx, P> + ?Sized> Handler<Tx, P> for &H {
    type Output = H::Output;

    fn handle(
        &self,
        tx: &mut Tx,
        msg: &Message<P>,
    ) -> impl Future<Output = Result<Self::Output, BoxError>> + Send {
        (**self).handle(tx, msg)
    }
}

/// Handles a whole batch's new messages at once, inside the transaction that claims them:
/// the peak-throughput shape, where a batch's effects are a few statements (one `unnest` or
/// multi-row insert) instead of one per message.
///
/// `msgs` are the batch's new messages only: duplicates and conflicts were settled by the
/// claim and never reach it. An error rolls the whole batch back, claims included; the runner
/// then handles each message as a batch of one, so a poison message is isolated and the rest
/// commit. Lock shared rows in key order first (see
/// [`Processor::process_batch_set`](crate::Processor::process_batch_set)).
///
/// ```
/// use idem_core::{BoxError, Message, SetHandler};
///
/// /// Sums a batch of charges into a `Vec` standing in for a transaction: one write per batch.
/// struct ChargeAll;
///
/// impl SetHandler<Vec<u64>, u64> for ChargeAll {
///     type Output = usize;
///     async fn handle_set(&self, tx: &mut Vec<u64>, msgs: &[&Message<u64>]) -> Result<usize, BoxError> {
///         tx.push(msgs.iter().map(|m| *m.payload()).sum());
///         Ok(msgs.len())
///     }
/// }
/// ```
pub trait SetHandler<Tx, P>: Send + Sync {
    /// What a committed batch yields (often `()`).
    type Output: Send;

    /// Applies the effects of every message in `msgs` through `tx`.
    fn handle_set(
        &self,
        tx: &mut Tx,
        msgs: &[&Message<P>],
    ) -> impl Future<Output = Result<Self::Output, BoxError>> + Send;
}

impl<Tx, P, H: SetHandler<Tx, P> + ?Sized> SetHandler<Tx, P> for &H {
    type Output = H::Output;

    fn handle_set(
        &self,
        tx: &mut Tx,
        msgs: &[&Message<P>],
    ) -> impl Future<Output = Result<Self::Output, BoxError>> + Send {
        (**self).handle_set(tx, msgs)
    }
}
