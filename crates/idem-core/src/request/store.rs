//! The store capabilities of idempotent requests, beside the claim's (re-exported from
//! [`crate::store`]).

use std::future::Future;
use std::time::Duration;

use super::{Begin, BeginIn, Fence, RequestKey};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::store::TransactionalStore;

/// Records of idempotent requests: one per [`RequestKey`], taken under a lease with a fencing
/// token, completed with a stored result, expiring after a TTL.
///
/// Every time (leases, expiry) is measured on the store's own clock — the database server's,
/// or Redis's — so the hosts of a fleet never disagree about whether a lease ran out.
///
/// The contract, which `idem_testkit::request_conformance_tests!` checks on the real server:
/// - [`begin_request`](Self::begin_request) never blocks on a record another executor holds:
///   a live lease is reported at once as [`Begin::InProgress`];
/// - a record whose lease ran out is taken over with a larger [`Fence`]; completion, release
///   and lease extension with an older fence are refused;
/// - a record with a different fingerprint is [`Begin::Mismatch`] and stays untouched;
/// - an expired record counts as absent: the key executes again.
pub trait RequestStore: TransactionalStore {
    /// The longest idempotency key, in bytes, the store's schema holds.
    fn max_key_len(&self) -> usize;

    /// Looks the record up and takes it when it is absent, expired, or its lease ran out: an
    /// in-progress record leased for `lease`, expiring after `ttl` unless completed. Runs on
    /// its own (committed) statements, not in the operation's transaction, so that concurrent
    /// retries see the taken record at once.
    fn begin_request(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Begin, Error>> + Send;

    /// Looks the record up as [`begin_request`](Self::begin_request) does, but takes it inside
    /// a new transaction of the operation's (begun as
    /// [`begin_execution`](Self::begin_execution) begins it) instead of committing the take on
    /// its own: the one-transaction mode, where the operation's writes, the record and
    /// [`complete_in`](Self::complete_in)'s result commit once. Nothing to release and no
    /// lease to renew: rolling the transaction back (or losing its connection, or the process)
    /// frees the key.
    ///
    /// The store must keep the contract of both modes on one table: a lookup in either mode
    /// never waits for a record another transaction holds uncommitted — it answers
    /// [`Begin::InProgress`] at once (a lock taken without waiting: PostgreSQL's
    /// `pg_try_advisory_xact_lock`, MariaDB's zero lock-wait timeout) —, a leased record with a
    /// live lease is in progress, a lapsed one is taken over with a larger fence (the old
    /// holder's completion is then refused), a completed one replays and another fingerprint
    /// is a mismatch. A record held uncommitted cannot be compared with: a lookup with another
    /// fingerprint meanwhile is told it is in progress, and the mismatch once it committed.
    ///
    /// The default answers [`BeginIn::Unsupported`]: the engine then uses the leased mode.
    fn begin_request_in(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<BeginIn<Self::Tx>, Error>> + Send {
        let _ = (key, fingerprint, lease, ttl);
        async { Ok(BeginIn::Unsupported) }
    }

    /// Begins the transaction an execution's operation writes through and its result is
    /// completed in. By default [`begin`](TransactionalStore::begin). A store whose `begin`
    /// takes a lock every writer waits for (SQLite's `BEGIN IMMEDIATE`, its one write lock)
    /// begins it without: the lock is then taken by the operation's first write, and an
    /// operation that never writes never holds it (see `idem_sql`'s SQLite engine).
    fn begin_execution(&self) -> impl Future<Output = Result<Self::Tx, Error>> + Send {
        self.begin()
    }

    /// Completes the record held under `fence` with `result`, expiring `ttl` from now, inside
    /// `tx` — the transaction carrying the operation's writes, so both commit or neither does.
    /// [`RequestErrorKind::LeaseLost`](crate::RequestErrorKind::LeaseLost) when another executor took the
    /// record over: the caller must roll `tx` back.
    fn complete_in(
        &self,
        tx: &mut Self::Tx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Gives the record up (the outcome is not to be stored): the key is free again. Does
    /// nothing when `fence` no longer holds it. A record with a recovery point (see
    /// [`RecoveryStore`](crate::store::RecoveryStore)) is not deleted: its committed phases
    /// stand, so only its lease ends and the next lookup resumes it.
    fn release(
        &self,
        key: &RequestKey,
        fence: Fence,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Extends the lease held under `fence` to `lease` from now (a heartbeat for long
    /// operations). `false` when `fence` no longer holds the record.
    fn extend_lease(
        &self,
        key: &RequestKey,
        fence: Fence,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, Error>> + Send;
}

/// Removes expired request records in bounded batches.
pub trait ReapRequests: Send + Sync {
    /// Deletes at most `limit` records that expired (completed or abandoned ones past their
    /// TTL, in-progress ones past both their TTL and their lease and without a recovery
    /// point), in one short transaction. Returns how many.
    fn reap_batch(&self, limit: u32) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// Deletes every expired record, `batch` at a time.
pub async fn reap_all<S: ReapRequests + ?Sized>(store: &S, batch: u32) -> Result<u64, Error> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = store.reap_batch(batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}
