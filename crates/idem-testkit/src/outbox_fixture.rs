//! What a store provides to run the outbox conformance suite.

use std::future::Future;

use idem_core::Migrate;
use idem_core::outbox::{OutboxStore, RelayStore};

/// An isolated, migrated store with an outbox on a real server.
pub trait OutboxFixture: Sized + Send + Sync + 'static {
    /// The store under test.
    type Store: OutboxStore + RelayStore + Migrate + Clone + std::fmt::Debug + Send + Sync + 'static;

    /// Creates a store on its own tables (named after `test`) and migrates it; `None` when the
    /// service is not configured (the test is then skipped, loudly).
    fn setup(test: &str) -> impl Future<Output = Option<Self>> + Send;

    /// The store.
    fn store(&self) -> Self::Store;

    /// The same store configured with an outbox table that no one migrated.
    fn unmigrated(&self) -> Self::Store;

    /// The reason stored with dead letter `seq`, read from the dead-letter table directly.
    fn dead_letter_reason(&self, seq: i64) -> impl Future<Output = Option<String>> + Send;

    /// Drops the fixture's tables.
    fn teardown(self) -> impl Future<Output = ()> + Send;
}
