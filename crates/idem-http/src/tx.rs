//! How the handler reaches the execution's transaction: the layer puts a slot holding it in
//! the request's extensions; [`IdemTx`] takes it out for the handler and puts it back when
//! dropped, and after the handler the layer takes it back to complete the record in it.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use http::Extensions;
use idem_core::TransactionalStore;

use crate::execution::StartMark;

/// The execution's transaction while the inner service runs; in the request's extensions.
pub(crate) struct TxSlot<T> {
    tx: Arc<Mutex<Option<T>>>,
    started: StartMark,
}

impl<T> Clone for TxSlot<T> {
    fn clone(&self) -> Self {
        Self {
            tx: Arc::clone(&self.tx),
            started: self.started.clone(),
        }
    }
}

impl<T> TxSlot<T> {
    pub(crate) fn new(tx: Option<T>, started: StartMark) -> Self {
        Self {
            tx: Arc::new(Mutex::new(tx)),
            started,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<T>> {
        // Only ever held for a `take` or a `replace`: a panic cannot leave it half-written.
        self.tx
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn take(&self) -> Option<T> {
        self.lock().take()
    }

    /// Puts a transaction (back) in the slot, for the layer to commit with the response.
    pub(crate) fn put(&self, tx: T) {
        *self.lock() = Some(tx);
    }
}

/// Why [`IdemTx::take`] found no transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TxError {
    /// The request is not an idempotent execution (on this store): it did not pass through an
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) (on this store type), or the layer let it
    /// through without a record (a safe method, an optional route without a key).
    #[error(
        "this request is not an idempotent execution: it is not behind an IdempotencyLayer (on this store), or it carries no Idempotency-Key"
    )]
    NotIdempotent,
    /// Another [`IdemTx`] of this request holds it.
    #[error("the request's idempotent transaction is already taken by another extractor")]
    InUse,
}

/// The transaction of an idempotent execution, for the handler: its writes commit together
/// with the stored response, or roll back with a response that is not stored.
///
/// On the SQL stores that is the database transaction. On Redis it carries no transaction
/// (`idem_redis::RedisTx`): Redis cannot join your database's, so nothing you write is rolled
/// back there; writes that do not go through it (your own pool, an external call) are never
/// rolled back on any store.
///
/// Using it (the first `Deref`, a read or a write) marks the execution started: a 4xx the
/// handler answers afterwards is stored (see [`execution`](crate::execution)).
///
/// Dereferences to the store's transaction (`idem_sql::Tx<E>`), so sqlx
/// queries run on `&mut **tx`. In axum it is an extractor (feature `axum`); elsewhere take it
/// from the request's extensions with [`IdemTx::take`]. It must not outlive the request's
/// handling: dropping it gives the transaction back to the layer, and a transaction still held
/// when the inner service's response is ready cannot commit (the layer answers
/// `500 internal-error` and the writes roll back).
pub struct IdemTx<S: TransactionalStore> {
    tx: Option<S::Tx>,
    slot: TxSlot<S::Tx>,
}

impl<S> IdemTx<S>
where
    S: TransactionalStore + 'static,
    S::Tx: 'static,
{
    /// Takes the transaction the layer left in `extensions`.
    pub fn take(extensions: &Extensions) -> Result<Self, TxError> {
        let slot = extensions
            .get::<TxSlot<S::Tx>>()
            .ok_or(TxError::NotIdempotent)?
            .clone();
        let tx = slot.take().ok_or(TxError::InUse)?;
        Ok(Self { tx: Some(tx), slot })
    }

    /// Whether `extensions` belong to an idempotent execution on store `S`.
    pub fn is_available(extensions: &Extensions) -> bool {
        extensions.get::<TxSlot<S::Tx>>().is_some()
    }
}

impl<S: TransactionalStore> Deref for IdemTx<S> {
    type Target = S::Tx;

    fn deref(&self) -> &S::Tx {
        self.slot.started.mark();
        match &self.tx {
            Some(tx) => tx,
            // Only `Drop` takes it out.
            None => unreachable!("IdemTx used after drop"),
        }
    }
}

impl<S: TransactionalStore> DerefMut for IdemTx<S> {
    fn deref_mut(&mut self) -> &mut S::Tx {
        self.slot.started.mark();
        match &mut self.tx {
            Some(tx) => tx,
            None => unreachable!("IdemTx used after drop"),
        }
    }
}

impl<S: TransactionalStore> Drop for IdemTx<S> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.slot.lock() = Some(tx);
        }
    }
}

impl<S: TransactionalStore> fmt::Debug for IdemTx<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdemTx").finish_non_exhaustive()
    }
}
