//! What a store provides, beyond a [`RequestFixture`], to run the recovery-point conformance
//! suite.

use std::future::Future;

use idem_core::store::RecoveryStore;
use idem_core::{Fingerprint, Migrate, RequestKey};

use crate::request_fixture::RequestFixture;

/// A [`RequestFixture`] whose store keeps recovery points.
pub trait RecoveryFixture: RequestFixture<Store: RecoveryStore + Migrate> {
    /// Whether the store's `take_stuck` skips a record another transaction holds locked
    /// (`FOR UPDATE SKIP LOCKED` on a server). SQLite has one write lock and no row locks:
    /// a second taker waits for the first, so it leaves this `false`.
    const SKIPS_LOCKED_ROWS: bool = true;

    /// Creates the requests table `table` in the shape `migrate` gave it before recovery
    /// points (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, result,
    /// its primary key and `expires_at` index), holding one completed record under
    /// `completed` with `fingerprint`, fence 1 and result `old` that expires in a day, and
    /// returns a store whose requests table it is, not migrated.
    fn legacy_store(
        &self,
        table: &str,
        completed: &RequestKey,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Self::Store> + Send;
}
