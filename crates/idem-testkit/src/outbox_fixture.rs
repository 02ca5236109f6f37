//! What a store provides to run the outbox conformance suite.

use std::future::Future;

use idem_core::outbox::{OutboxStore, RelayStore};
use idem_core::{MessageId, Migrate};

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

    /// A row lock held by a transaction of the fixture's own ([`lock_row`](Self::lock_row)).
    type RowLock: Send;

    /// Locks the outbox row of message `id` with `SELECT … FOR UPDATE` in a transaction of
    /// the fixture's own, open until [`unlock_row`](Self::unlock_row): what a lease or a mark
    /// in flight in another relay looks like to a lease, which skips the row. `None` on an
    /// engine without row locks (SQLite: one transaction writes at a time, so a lease never
    /// skips a row).
    fn lock_row(&self, id: &MessageId) -> impl Future<Output = Option<Self::RowLock>> + Send;

    /// Ends `lock`'s transaction (a rollback), so the row is free again when this returns.
    fn unlock_row(&self, lock: Self::RowLock) -> impl Future<Output = ()> + Send;

    /// The reason stored with dead letter `seq`, read from the dead-letter table directly.
    fn dead_letter_reason(&self, seq: i64) -> impl Future<Output = Option<String>> + Send;

    /// Drops the fixture's tables.
    fn teardown(self) -> impl Future<Output = ()> + Send;
}
