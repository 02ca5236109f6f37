//! What a store provides to run the idempotent-request conformance suite.

use std::future::Future;

use idem_core::BoxError;
use idem_core::TransactionalStore;
use idem_core::store::{ReapRequests, RequestStore};

/// The transaction type of a request fixture's store.
pub type RequestTxOf<F> = <<F as RequestFixture>::Store as TransactionalStore>::Tx;

/// An isolated, migrated request store on a real server, plus a way for an operation to write
/// an effect through the store's transaction.
pub trait RequestFixture: Sized + Send + Sync + 'static {
    /// The store under test.
    type Store: RequestStore + ReapRequests + Clone + std::fmt::Debug + Send + Sync + 'static;

    /// Whether completing a record commits in the same transaction as the operation's writes
    /// (SQL stores). Stores without one (Redis) skip the checks that rely on it: their effects
    /// are not rolled back with a refused completion.
    const SHARED_TRANSACTION: bool;

    /// Whether the store takes a record inside the operation's transaction
    /// ([`RequestStore::begin_request_in`], the one-transaction mode: PostgreSQL, MariaDB).
    /// The checks of that mode assert a store without it answers `BeginIn::Unsupported`, and
    /// one with it never does.
    const ONE_TRANSACTION: bool = false;

    /// Whether the store deletes expired records by itself (Redis key expiry), leaving the
    /// reaper nothing to do. Stores that keep expired rows until reaped (SQL) leave it `false`.
    const EXPIRES_ITSELF: bool = false;

    /// Creates a store on its own tables or key prefix (named after `test`) and migrates it;
    /// `None` when the service is not configured (the test is then skipped, loudly).
    fn setup(test: &str) -> impl Future<Output = Option<Self>> + Send;

    /// The store.
    fn store(&self) -> Self::Store;

    /// Writes one effect row with `key` through `tx` (for a store without a shared
    /// transaction, writes it directly).
    fn record_effect(
        &self,
        tx: &mut RequestTxOf<Self>,
        key: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Committed effects with `key`.
    fn count_effects(&self, key: &str) -> impl Future<Output = i64> + Send;

    /// Removes the fixture's tables or keys.
    fn teardown(self) -> impl Future<Output = ()> + Send;
}
