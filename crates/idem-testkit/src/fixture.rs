//! What a store provides to run the conformance suite.

use std::future::Future;

use idem_core::{
    BatchClaimStore, BoxError, ClaimStore, Migrate, Prune, Savepoints, Stats, TransactionalStore,
};

/// The transaction type of a fixture's store.
pub type TxOf<F> = <<F as StoreFixture>::Store as TransactionalStore>::Tx;

/// An isolated, migrated store on a real server, plus an `effects` table that stands in for
/// the handler's business writes.
pub trait StoreFixture: Sized + Send + Sync + 'static {
    /// The store under test.
    type Store: ClaimStore
        + BatchClaimStore
        + Savepoints
        + Migrate
        + Prune
        + Stats
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static;

    /// Creates a store on its own tables (named after `test`) and migrates it; `None` when the
    /// service is not configured (the test is then skipped, loudly).
    fn setup(test: &str) -> impl Future<Output = Option<Self>> + Send;

    /// The store.
    fn store(&self) -> Self::Store;

    /// Inserts one effect row with `key` inside `tx`: the business write that must commit or
    /// roll back with the claim.
    fn record_effect(
        tx: &mut TxOf<Self>,
        key: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Runs a statement that fails (e.g. reads a table that does not exist) inside `tx`, and
    /// returns its error: what a handler that swallows database errors runs into.
    fn fail_statement(tx: &mut TxOf<Self>) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Committed effect rows with `key`.
    fn count_effects(&self, key: &str) -> impl Future<Output = i64> + Send;

    /// Committed claims of every consumer.
    fn count_claims(&self) -> impl Future<Output = i64> + Send;

    /// Drops the fixture's tables.
    fn teardown(self) -> impl Future<Output = ()> + Send;
}
