//! The opt-in local cache of completed records ([`IdempotencyBuilder::local_cache`]): a retry
//! of a request this process completed is replayed without a round trip to the store.
//!
//! What it may hold is the whole design:
//! - **only records whose completion this process committed**: filled by
//!   [`Execution::complete`] after its commit returned, never with a record in progress, a
//!   lookup that found nothing, an abandoned execution, a rolled-back transaction or a commit
//!   whose outcome is unknown (the connection lost during `COMMIT`). A record replayed from
//!   the store is not added either: its remaining TTL is not known here.
//! - **the fingerprint with the key**: a key cached with another request's fingerprint is not
//!   answered; [`Idempotency::start`] asks the store, which decides (a mismatch).
//! - **no entry outlives its record**: each entry expires at the record's TTL counted from
//!   before the execution started (the record's `expires_at` is taken later, on the store's
//!   clock), and sooner with [`LocalCache::max_age`].
//! - **bounded**: by entries ([`LocalCache::new`]) or by the bytes of keys and stored results
//!   ([`LocalCache::bytes`]), with moka's TinyLFU eviction.
//!
//! The trade-off: only this process's completions are in it, so it saves round trips on
//! retries that reach the same process (behind sticky routing, or a single instance) and
//! nothing on others; and a record deleted by an operator is still replayed from the cache
//! until its entry expires.
//!
//! [`IdempotencyBuilder::local_cache`]: crate::IdempotencyBuilder::local_cache
//! [`Execution::complete`]: crate::Execution::complete
//! [`Idempotency::start`]: crate::Idempotency::start

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{Fingerprint, RequestKey};

/// Configures the opt-in local cache of completed records
/// ([`IdempotencyBuilder::local_cache`](crate::IdempotencyBuilder::local_cache)).
///
/// ```
/// use std::time::Duration;
/// use idem_request::LocalCache;
///
/// // At most 64 MiB of keys and stored results, none older than 10 minutes (nor than the
/// // records' TTL).
/// let cache = LocalCache::bytes(64 << 20).max_age(Duration::from_secs(600));
/// # let _ = cache;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCache {
    bound: Bound,
    max_age: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    Entries(u64),
    Bytes(u64),
}

impl LocalCache {
    /// A cache of at most `max_entries` completed records, whatever their results' sizes.
    pub fn new(max_entries: u64) -> Self {
        Self {
            bound: Bound::Entries(max_entries),
            max_age: None,
        }
    }

    /// A cache of at most `max_bytes` of keys and stored results (an entry's weight is its
    /// key's and result's length): the bound to choose when results vary in size.
    pub fn bytes(max_bytes: u64) -> Self {
        Self {
            bound: Bound::Bytes(max_bytes),
            max_age: None,
        }
    }

    /// Expires entries after `age` when that is shorter than the records' TTL: a bound on how
    /// long a record deleted by an operator is still replayed from the cache.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = Some(age);
        self
    }
}

/// A cached completion: the fingerprint it was stored for, its result, and when the entry
/// must be gone.
#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    result: Box<[u8]>,
    expires: Instant,
}

/// Per-entry expiry: each entry at its record's deadline.
struct AtDeadline;

impl moka::Expiry<RequestKey, Arc<Entry>> for AtDeadline {
    fn expire_after_create(
        &self,
        _key: &RequestKey,
        entry: &Arc<Entry>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.expires.saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &RequestKey,
        entry: &Arc<Entry>,
        updated_at: Instant,
        _left: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.expires.saturating_duration_since(updated_at))
    }
}

/// An execution's part in the cache: what to fill when its completion commits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pending {
    fingerprint: Fingerprint,
    /// Taken before the record was looked up: its `expires_at` is counted from later.
    since: Instant,
}

impl Pending {
    /// An execution of a request with `fingerprint` starting now.
    pub(crate) fn now(fingerprint: Fingerprint) -> Self {
        Self {
            fingerprint,
            since: Instant::now(),
        }
    }
}

/// One engine's cache of completed records.
#[derive(Clone)]
pub(crate) struct RecordCache {
    entries: moka::sync::Cache<RequestKey, Arc<Entry>>,
    max_age: Duration,
}

impl std::fmt::Debug for RecordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordCache")
            .field("entries", &self.entries.entry_count())
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl RecordCache {
    /// The cache for records kept `ttl`, or `None` when it could hold nothing.
    pub(crate) fn new(config: LocalCache, ttl: Duration) -> Option<Self> {
        let max_age = config.max_age.map_or(ttl, |age| age.min(ttl));
        let builder = moka::sync::Cache::builder().expire_after(AtDeadline);
        let entries = match config.bound {
            Bound::Entries(0) | Bound::Bytes(0) => return None,
            Bound::Entries(n) => builder.max_capacity(n).build(),
            Bound::Bytes(n) => builder
                .max_capacity(n)
                .weigher(|key: &RequestKey, entry: &Arc<Entry>| {
                    let size = key.key.as_str().len() + entry.result.len();
                    u32::try_from(size).unwrap_or(u32::MAX)
                })
                .build(),
        };
        if max_age.is_zero() {
            return None;
        }
        Some(Self { entries, max_age })
    }

    /// The stored result of `key` when this process completed it for the same `fingerprint`
    /// and its record has not expired; `None` sends the lookup to the store.
    pub(crate) fn replay(&self, key: &RequestKey, fingerprint: &Fingerprint) -> Option<Vec<u8>> {
        let entry = self.entries.get(key)?;
        if entry.fingerprint != *fingerprint || Instant::now() >= entry.expires {
            return None;
        }
        metrics::counter!("idem_request_local_cache_hits_total").increment(1);
        tracing::debug!(key = %crate::engine::KeyDigest(key), "replayed from the local cache");
        Some(entry.result.to_vec())
    }

    /// Records `key`'s completion with `result`, whose commit returned.
    pub(crate) fn fill(&self, key: &RequestKey, pending: Pending, result: &[u8]) {
        let expires = pending.since + self.max_age;
        if expires <= Instant::now() {
            return;
        }
        self.entries.insert(
            key.clone(),
            Arc::new(Entry {
                fingerprint: pending.fingerprint,
                result: result.into(),
                expires,
            }),
        );
    }

    /// Entries held now, after pending evictions ran (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.entry_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{IdempotencyKey, RequestScope};

    fn key(k: &str) -> RequestKey {
        RequestKey::new(RequestScope::new(["t"]), IdempotencyKey::new(k).unwrap())
    }

    #[test]
    fn a_cached_record_replays_only_for_its_own_fingerprint() {
        let c = RecordCache::new(LocalCache::new(10), Duration::from_secs(60)).unwrap();
        let fp = Fingerprint::of("body");
        assert_eq!(c.replay(&key("a"), &fp), None, "a miss is not an answer");
        c.fill(&key("a"), Pending::now(fp), b"result");
        assert_eq!(c.replay(&key("a"), &fp).as_deref(), Some(&b"result"[..]));
        assert_eq!(
            c.replay(&key("a"), &Fingerprint::of("other body")),
            None,
            "another request goes to the store, which decides"
        );
    }

    #[test]
    fn an_entry_expires_at_its_records_ttl_counted_from_before_the_execution() {
        let c = RecordCache::new(LocalCache::new(10), Duration::from_millis(150)).unwrap();
        let fp = Fingerprint::of("body");
        let mut started = Pending::now(fp);
        started.since -= Duration::from_millis(100);
        c.fill(&key("a"), started, b"r");
        assert!(c.replay(&key("a"), &fp).is_some());
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(
            c.replay(&key("a"), &fp),
            None,
            "the entry outlived its record"
        );
        let mut late = Pending::now(fp);
        late.since -= Duration::from_millis(200);
        c.fill(&key("b"), late, b"r");
        assert_eq!(
            c.replay(&key("b"), &fp),
            None,
            "an expired record was cached"
        );
    }

    #[test]
    fn max_age_shortens_but_never_lengthens_the_ttl() {
        let d = Duration::from_secs;
        let age = |c: LocalCache| RecordCache::new(c, d(600)).unwrap().max_age;
        assert_eq!(age(LocalCache::new(1)), d(600));
        assert_eq!(age(LocalCache::new(1).max_age(d(60))), d(60));
        assert_eq!(age(LocalCache::new(1).max_age(d(6000))), d(600));
        assert!(RecordCache::new(LocalCache::bytes(0), d(1)).is_none());
    }

    #[test]
    fn the_bounds_on_entries_and_on_bytes_are_respected() {
        let fp = Fingerprint::of("body");
        let c = RecordCache::new(LocalCache::new(50), Duration::from_secs(60)).unwrap();
        for i in 0..500 {
            c.fill(&key(&format!("k-{i}")), Pending::now(fp), b"r");
        }
        assert!(c.len() <= 50, "{} entries held", c.len());

        let c = RecordCache::new(LocalCache::bytes(10_000), Duration::from_secs(60)).unwrap();
        let result = vec![7u8; 1_000];
        for i in 0..100 {
            c.fill(&key(&format!("k-{i}")), Pending::now(fp), &result);
        }
        c.entries.run_pending_tasks();
        assert!(
            c.entries.weighted_size() <= 10_000,
            "{} bytes held",
            c.entries.weighted_size()
        );
        assert!(c.len() <= 10, "{} entries of 1 kB held", c.len());
    }

    // ---- through the engine, on SQLite ----------------------------------------------------

    use crate::{Idempotency, Start};
    use idem_core::store::RequestStore;
    use idem_core::{Begin, Error, ErrorKind, Fence, Migrate, TransactionalStore};
    use idem_sql::{SqliteOptions, SqliteStore};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// SQLite whose next `COMMIT` goes through but reports a lost connection (outcome
    /// unknown): the completion is stored, and this process cannot know it.
    #[derive(Debug, Clone)]
    struct LosesCommitAnswer {
        inner: SqliteStore,
        lose_next: Arc<AtomicBool>,
    }

    impl TransactionalStore for LosesCommitAnswer {
        type Tx = <SqliteStore as TransactionalStore>::Tx;
        async fn begin(&self) -> Result<Self::Tx, Error> {
            self.inner.begin().await
        }
        async fn commit(&self, tx: Self::Tx) -> Result<(), Error> {
            self.inner.commit(tx).await?;
            if self.lose_next.swap(false, Ordering::SeqCst) {
                return Err(Error::new(
                    ErrorKind::OutcomeUnknown,
                    "connection lost during COMMIT",
                ));
            }
            Ok(())
        }
        async fn rollback(&self, tx: Self::Tx) -> Result<(), Error> {
            self.inner.rollback(tx).await
        }
    }

    impl RequestStore for LosesCommitAnswer {
        fn max_key_len(&self) -> usize {
            self.inner.max_key_len()
        }
        async fn begin_request(
            &self,
            key: &RequestKey,
            fingerprint: &Fingerprint,
            lease: Duration,
            ttl: Duration,
        ) -> Result<Begin, Error> {
            self.inner.begin_request(key, fingerprint, lease, ttl).await
        }
        async fn begin_execution(&self) -> Result<Self::Tx, Error> {
            self.inner.begin_execution().await
        }
        async fn complete_in(
            &self,
            tx: &mut Self::Tx,
            key: &RequestKey,
            fence: Fence,
            result: &[u8],
            ttl: Duration,
        ) -> Result<(), Error> {
            self.inner.complete_in(tx, key, fence, result, ttl).await
        }
        async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
            self.inner.release(key, fence).await
        }
        async fn extend_lease(
            &self,
            key: &RequestKey,
            fence: Fence,
            lease: Duration,
        ) -> Result<bool, Error> {
            self.inner.extend_lease(key, fence, lease).await
        }
    }

    async fn sqlite(dir: &tempfile::TempDir) -> LosesCommitAnswer {
        let inner = SqliteStore::open(dir.path().join("c.db"), SqliteOptions::default())
            .await
            .unwrap();
        inner.migrate().await.unwrap();
        LosesCommitAnswer {
            inner,
            lose_next: Arc::default(),
        }
    }

    /// An operator deletes every record: what the engine answers afterwards came from its
    /// cache (a replay) or from the store (a run).
    async fn delete_records(store: &LosesCommitAnswer) {
        sqlx::query("DELETE FROM idem_requests")
            .execute(store.inner.pool())
            .await
            .unwrap();
    }

    fn engine(store: &LosesCommitAnswer, ttl: Duration) -> Idempotency<LosesCommitAnswer> {
        Idempotency::builder(store.clone())
            .ttl(ttl)
            .lease(Duration::from_millis(50))
            .without_heartbeat()
            .local_cache(LocalCache::new(100))
            .build()
            .unwrap()
    }

    async fn run(
        idem: &Idempotency<LosesCommitAnswer>,
        k: &str,
        fp: Fingerprint,
    ) -> crate::Execution<LosesCommitAnswer> {
        match idem.start(key(k), fp).await.unwrap() {
            Start::Run(e) => e,
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn sqlite_a_committed_completion_is_replayed_from_the_cache_and_nothing_else_is() {
        let dir = tempfile::tempdir().unwrap();
        let store = sqlite(&dir).await;
        let idem = engine(&store, Duration::from_secs(60));
        let fp = Fingerprint::of("body");

        // Completed and committed: replayed from the cache, even with the store emptied.
        run(&idem, "done", fp)
            .await
            .complete(b"stored")
            .await
            .unwrap();
        // Abandoned (rolled back, not stored): never cached.
        run(&idem, "abandoned", fp).await.abandon().await.unwrap();
        // Completion without its transaction: an error, nothing committed.
        let mut e = run(&idem, "no-tx", fp).await;
        let tx = e.take_tx().unwrap();
        store.rollback(tx).await.unwrap();
        assert!(e.complete(b"x").await.is_err());
        // The commit went through but its answer was lost: unknown here, never cached.
        store.lose_next.store(true, Ordering::SeqCst);
        let e = run(&idem, "unknown", fp).await;
        assert_eq!(
            e.complete(b"maybe").await.unwrap_err().kind(),
            ErrorKind::OutcomeUnknown
        );

        delete_records(&store).await;
        match idem.start(key("done"), fp).await.unwrap() {
            Start::Replay(r) => assert_eq!(r, b"stored"),
            other => panic!("a committed completion is replayed from the cache: {other:?}"),
        }
        for k in ["abandoned", "no-tx", "unknown"] {
            run(&idem, k, fp).await.abandon().await.unwrap();
        }
        // Another fingerprint under a cached key goes to the store (here: no record, a run;
        // with the record there, the store's mismatch).
        run(&idem, "done", Fingerprint::of("another body"))
            .await
            .abandon()
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn sqlite_a_different_fingerprint_gets_the_store_s_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let store = sqlite(&dir).await;
        let idem = engine(&store, Duration::from_secs(60));
        run(&idem, "k", Fingerprint::of("a"))
            .await
            .complete(b"r")
            .await
            .unwrap();
        assert!(matches!(
            idem.start(key("k"), Fingerprint::of("b")).await.unwrap(),
            Start::Mismatch
        ));
    }

    #[tokio::test]
    async fn sqlite_an_entry_does_not_outlive_its_record_s_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let store = sqlite(&dir).await;
        let idem = engine(&store, Duration::from_millis(300));
        let fp = Fingerprint::of("body");
        run(&idem, "k", fp).await.complete(b"r").await.unwrap();
        delete_records(&store).await;
        assert!(matches!(
            idem.start(key("k"), fp).await.unwrap(),
            Start::Replay(_)
        ));
        tokio::time::sleep(Duration::from_millis(350)).await;
        run(&idem, "k", fp).await.abandon().await.unwrap();
    }

    /// On the real server: a completion this process committed is replayed from the cache
    /// (even after an operator deleted its record: the documented trade-off), an abandoned
    /// one is not, and another fingerprint gets the store's mismatch.
    #[tokio::test]
    async fn postgres_only_committed_completions_are_replayed_from_the_cache() {
        let test = "postgres_only_committed_completions_are_replayed_from_the_cache";
        let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
            assert_ne!(
                std::env::var("IDEM_TEST_REQUIRE_SERVICES").as_deref(),
                Ok("1"),
                "{test}: IDEM_TEST_POSTGRES_URL not set and services are required"
            );
            eprintln!("SKIPPING {test}: IDEM_TEST_POSTGRES_URL not set");
            return;
        };
        let schema = format!(
            "lc_req_{}_{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        );
        let admin = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .unwrap();
        let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        let store = idem_sql::PostgresStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        let idem = Idempotency::builder(store.clone())
            .local_cache(LocalCache::bytes(1 << 20))
            .build()
            .unwrap();
        let fp = Fingerprint::of("body");
        let Start::Run(e) = idem.start(key("done"), fp).await.unwrap() else {
            panic!("first start runs");
        };
        e.complete(b"stored").await.unwrap();
        let Start::Run(e) = idem.start(key("abandoned"), fp).await.unwrap() else {
            panic!("first start runs");
        };
        e.abandon().await.unwrap();
        assert!(matches!(
            idem.start(key("done"), Fingerprint::of("other"))
                .await
                .unwrap(),
            Start::Mismatch
        ));
        sqlx::query("DELETE FROM idem_requests")
            .execute(&pool)
            .await
            .unwrap();
        match idem.start(key("done"), fp).await.unwrap() {
            Start::Replay(r) => assert_eq!(r, b"stored"),
            other => panic!("expected a replay from the cache: {other:?}"),
        }
        match idem.start(key("abandoned"), fp).await.unwrap() {
            Start::Run(e) => e.abandon().await.unwrap(),
            other => panic!("an abandoned execution was cached: {other:?}"),
        }
        pool.close().await;
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&admin)
            .await
            .unwrap();
    }
}
