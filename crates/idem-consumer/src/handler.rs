//! The user's side effect, run inside the transaction that records the claim.

use std::future::Future;

use idem_core::{BoxError, Message};

/// Handles one message inside the store's transaction `Tx`.
///
/// Write every database effect through `tx`: it commits together with the claim, or not at
/// all. Propagate database errors with `?` (the store recognises deadlocks and serialization
/// failures as transient); return [`Error::reject`](idem_core::Error::reject) for a message
/// that can never succeed (dead-lettered at once) and [`Error::retry`](idem_core::Error::retry)
/// or any other error for one worth retrying. Calls to
/// external systems should carry a key derived from the message ID (see
/// [`Processor::derived_key`](idem_core::Processor::derived_key)), because a call made before a
/// crash still happened.
///
/// A trait rather than a closure so the runner can require its future to be `Send` and run
/// many messages on tokio's worker threads.
pub trait Handler<Tx, P>: Send + Sync + 'static {
    /// What a processed message yields (often `()`).
    type Output: Send + 'static;

    /// Applies `msg`'s effects through `tx`.
    fn handle(
        &self,
        tx: &mut Tx,
        msg: &Message<P>,
    ) -> impl Future<Output = Result<Self::Output, BoxError>> + Send;
}
