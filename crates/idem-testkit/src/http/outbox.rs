//! The outbox as the suite's `/emit` route finds it: through the store's own
//! [`OutboxStore`] where its type has one, refused where it has none.
//!
//! Which stores have an outbox is idem's decision, made in types: a store implements
//! [`OutboxStore`] only when its transaction is the one the request's response commits in
//! (the SQL stores). `RedisRequestStore` implements none — its `RedisTx` carries no database
//! transaction, so a message could not commit with the effect and the stored response — and a
//! handler written against `S: OutboxStore` does not compile on it. The suite must run every
//! store through one generic handler, so each fixture asks [`StoreOutbox`] for its concrete
//! store type: the store's `enqueue` when the type implements [`OutboxStore`], else
//! [`Enqueue::NoOutbox`]. The Redis checks assert that refusal; should Redis ever implement
//! `OutboxStore`, its fixture would enqueue through it and those checks would fail, and so
//! say that the contract changed.

use std::future::Future;

use idem_core::TransactionalStore;
use idem_core::outbox::{OutboxStore, Outgoing};

/// Why the `/emit` handler could not enqueue.
#[derive(Debug)]
pub enum Enqueue {
    /// The store's type implements no [`OutboxStore`]: it shares no transaction with the
    /// request (Redis).
    NoOutbox,
    /// The store's outbox refused the messages.
    Store(idem_core::Error),
}

impl std::fmt::Display for Enqueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoOutbox => f.write_str(
                "this store implements no OutboxStore: it shares no transaction with the request, so a message could not commit with its effect and stored response",
            ),
            Self::Store(e) => write!(f, "enqueueing: {e}"),
        }
    }
}

/// A store, asked whether its type has an outbox. Call
/// [`enqueue`](StoreOutbox::enqueue) on a *concrete* store type (the fixture's): the inherent
/// method applies where the store implements [`OutboxStore`], the [`NoOutbox`] trait's
/// everywhere else. (Method resolution prefers an inherent method whose bounds hold; in
/// generic code the bound is unknown and the fallback would always win, so only fixtures
/// call it.)
#[derive(Debug)]
pub struct StoreOutbox<'a, S>(pub &'a S);

impl<S: OutboxStore> StoreOutbox<'_, S> {
    /// Enqueues `messages` through the store's outbox in `tx`, the request's transaction.
    pub async fn enqueue(&self, tx: &mut S::Tx, messages: &[Outgoing]) -> Result<(), Enqueue> {
        self.0.enqueue(tx, messages).await.map_err(Enqueue::Store)
    }
}

/// The answer of a store type without an [`OutboxStore`]: [`Enqueue::NoOutbox`].
pub trait NoOutbox<S: TransactionalStore> {
    /// Refuses: the store has no outbox in the request's transaction.
    fn enqueue(
        &self,
        _tx: &mut S::Tx,
        _messages: &[Outgoing],
    ) -> impl Future<Output = Result<(), Enqueue>> + Send {
        std::future::ready(Err(Enqueue::NoOutbox))
    }
}

impl<S: TransactionalStore> NoOutbox<S> for StoreOutbox<'_, S> {}
