//! The idempotent-request conformance suite on a real SQLite database file (always runs:
//! SQLite is embedded).

use std::path::PathBuf;

use idem_core::{BoxError, Migrate};
use idem_sql::{SqliteOptions, SqliteStore, TableName};
use idem_testkit::{RequestFixture, RequestTxOf, unique_name};

#[derive(Debug)]
struct SqliteFixture {
    store: SqliteStore,
    dir: PathBuf,
}

impl RequestFixture for SqliteFixture {
    type Store = SqliteStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(unique_name("idem_sqlite_req", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("requests.db"), SqliteOptions::default())
            .await
            .expect("open sqlite")
            .with_requests_table(TableName::new("requests").expect("valid"))
            .expect("plain table");
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, dir })
    }

    fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (key) VALUES (?)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = ?")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

idem_testkit::request_conformance_tests!(SqliteFixture);
crate::request_extras::request_extras!(SqliteFixture);

impl idem_testkit::RecoveryFixture for SqliteFixture {
    const SKIPS_LOCKED_ROWS: bool = false;

    async fn legacy_store(
        &self,
        table: &str,
        completed: &idem_core::RequestKey,
        fingerprint: &idem_core::Fingerprint,
    ) -> SqliteStore {
        let pool = self.store.pool();
        sqlx::query(&format!(
            "CREATE TABLE {table} (scope BLOB NOT NULL, idem_key BLOB NOT NULL, \
             fingerprint BLOB NOT NULL, state INTEGER NOT NULL, fence INTEGER NOT NULL, \
             lease_until INTEGER NOT NULL, expires_at INTEGER NOT NULL, result BLOB, \
             PRIMARY KEY (scope, idem_key))"
        ))
        .execute(pool)
        .await
        .expect("legacy table");
        sqlx::query(&format!(
            "INSERT INTO {table} VALUES (?, ?, ?, 1, 1, 0, \
             CAST(strftime('%s', 'now') AS INTEGER) * 1000000 + 86400000000, 'old')"
        ))
        .bind(&completed.scope.as_bytes()[..])
        .bind(completed.key.as_str().as_bytes())
        .bind(&fingerprint.as_bytes()[..])
        .execute(pool)
        .await
        .expect("legacy row");
        self.store
            .clone()
            .with_requests_table(TableName::new(table).expect("valid"))
            .expect("plain table")
    }
}

idem_testkit::recovery_conformance_tests!(SqliteFixture);
idem_testkit::phases_conformance_tests!(SqliteFixture);

impl idem_testkit::CompleterFixture for SqliteFixture {
    fn refusing_store(&self) -> SqliteStore {
        self.store
            .clone()
            .with_requests_table(TableName::new("no_such_requests").expect("valid"))
            .expect("plain table")
    }
}

idem_testkit::completer_conformance_tests!(SqliteFixture);

/// On SQLite a running operation's transaction that wrote holds the write lock, so its heartbeat
/// cannot renew the lease meanwhile. A retry after the lease ran out must still be answered at once
/// — "in progress", since the holder may still be writing — not wait out the busy timeout;
/// once the holder committed, the retry replays its result. The connection the take-over
/// attempt used gets its busy timeout back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_whose_holder_still_writes_is_in_progress_at_once() {
    use std::time::{Duration, Instant};

    use idem_core::store::RequestStore;
    use idem_core::{
        Begin, Fingerprint, IdempotencyKey, RequestKey, RequestScope, TransactionalStore,
    };

    let test = "a_lapsed_lease_whose_holder_still_writes_is_in_progress_at_once";
    let fx = SqliteFixture::setup(test).await.expect("sqlite");
    let s = SqliteStore::open(
        fx.dir.join("requests.db"),
        SqliteOptions::default().max_connections(2),
    )
    .await
    .expect("open")
    .with_requests_table(TableName::new("requests").expect("valid"))
    .expect("plain table");
    let k = RequestKey::new(
        RequestScope::new(["alice"]),
        IdempotencyKey::new("k-slow").expect("key"),
    );
    let fp = Fingerprint::of(b"body");
    let day = Duration::from_secs(86_400);
    let Begin::Acquired { fence, .. } = s
        .begin_request(&k, &fp, Duration::from_secs(1), day)
        .await
        .expect("begin")
    else {
        panic!("fresh key not acquired");
    };
    let mut tx = s.begin().await.expect("tx");
    fx.record_effect(&mut tx, "slow").await.expect("effect");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let started = Instant::now();
    let retry = s.begin_request(&k, &fp, Duration::from_secs(30), day).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the retry waited {:?} for the write lock",
        started.elapsed()
    );
    assert!(
        matches!(retry, Ok(Begin::InProgress { .. })),
        "a lapsed lease whose holder holds the write lock: {retry:?}"
    );
    s.complete_in(&mut tx, &k, fence, b"slow result", day)
        .await
        .expect("the holder still completes");
    s.commit(tx).await.expect("commit");
    assert_eq!(
        s.begin_request(&k, &fp, Duration::from_secs(30), day)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"slow result".to_vec()
        }
    );
    let (mut a, mut b) = (
        s.pool().acquire().await.expect("conn"),
        s.pool().acquire().await.expect("conn"),
    );
    for conn in [&mut a, &mut b] {
        let ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut **conn)
            .await
            .expect("pragma");
        assert_eq!(ms, 10_000, "busy timeout not restored");
    }
    drop((a, b));
    s.pool().close().await;
    fx.teardown().await;
}

/// An execution's transaction begins deferred: it takes no lock until it writes, so another
/// transaction writes and commits meanwhile. Its completion then still commits — the
/// transaction's snapshot is older than that commit, which SQLite refuses to turn into a write
/// (`SQLITE_BUSY_SNAPSHOT`), so it is begun again with the lock — and a nested `begin()` in
/// it is a savepoint whose writes commit with the stored result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_takes_the_write_lock_only_when_it_writes() {
    use std::time::Duration;

    use idem_core::store::RequestStore;
    use idem_core::{
        Begin, Fingerprint, IdempotencyKey, RequestKey, RequestScope, TransactionalStore,
    };
    use sqlx::Acquire;

    let test = "an_execution_takes_the_write_lock_only_when_it_writes";
    let fx = SqliteFixture::setup(test).await.expect("sqlite");
    let s = fx.store();
    let day = Duration::from_secs(86_400);
    let key = |k: &str| {
        RequestKey::new(
            RequestScope::new(["alice"]),
            IdempotencyKey::new(k).expect("key"),
        )
    };
    let fp = Fingerprint::of(b"body");
    let acquire = async |k: &RequestKey| match s.begin_request(k, &fp, day, day).await {
        Ok(Begin::Acquired { fence, .. }) => fence,
        other => panic!("not acquired: {other:?}"),
    };

    let reader = key("k-reader");
    let fence = acquire(&reader).await;
    let mut tx = s.begin_execution().await.expect("begin");
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&mut *tx)
        .await
        .expect("read");
    assert_eq!(seen, 0);
    // Another writer while the execution's transaction is open: no wait for its lock.
    let mut other = s
        .begin()
        .await
        .expect("BEGIN IMMEDIATE beside a deferred transaction");
    fx.record_effect(&mut other, "other").await.expect("write");
    s.commit(other).await.expect("commit");
    s.complete_in(&mut tx, &reader, fence, b"read 0", day)
        .await
        .expect("completes in a transaction begun again");
    s.commit(tx).await.expect("commit");
    assert_eq!(
        s.begin_request(&reader, &fp, day, day)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"read 0".to_vec()
        }
    );

    let writer = key("k-writer");
    let fence = acquire(&writer).await;
    let mut tx = s.begin_execution().await.expect("begin");
    {
        let mut nested = (&mut *tx).begin().await.expect("savepoint");
        sqlx::query("INSERT INTO effects (key) VALUES ('nested')")
            .execute(&mut *nested)
            .await
            .expect("write");
        nested.commit().await.expect("release the savepoint");
    }
    s.complete_in(&mut tx, &writer, fence, b"wrote", day)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
    assert_eq!(fx.count_effects("nested").await, 1);
    assert_eq!(
        s.begin_request(&writer, &fp, day, day)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"wrote".to_vec()
        }
    );
    fx.teardown().await;
}

/// A lease renewal while a transaction holds the write lock — on SQLite often the renewing
/// execution's own — is refused at once as transient, instead of waiting out the busy
/// timeout on a pooled connection; once the lock is free it renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_under_a_held_write_lock_is_refused_at_once() {
    use std::time::{Duration, Instant};

    use idem_core::store::RequestStore;
    use idem_core::{
        Begin, ErrorKind, Fingerprint, IdempotencyKey, RequestKey, RequestScope, TransactionalStore,
    };

    let test = "a_renewal_under_a_held_write_lock_is_refused_at_once";
    let fx = SqliteFixture::setup(test).await.expect("sqlite");
    let s = fx.store();
    let day = Duration::from_secs(86_400);
    let k = RequestKey::new(
        RequestScope::new(["alice"]),
        IdempotencyKey::new("k-renew").expect("key"),
    );
    let Ok(Begin::Acquired { fence, .. }) = s
        .begin_request(&k, &Fingerprint::of(b"body"), day, day)
        .await
    else {
        panic!("not acquired");
    };
    let mut tx = s.begin_execution().await.expect("begin");
    fx.record_effect(&mut tx, "held").await.expect("write");
    let started = Instant::now();
    let refused = s
        .extend_lease(&k, fence, day)
        .await
        .expect_err("renewed under a held write lock");
    assert_eq!(refused.kind(), ErrorKind::Transient, "{refused}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
    s.rollback(tx).await.expect("rollback");
    assert!(s.extend_lease(&k, fence, day).await.expect("renew"));
    fx.teardown().await;
}
