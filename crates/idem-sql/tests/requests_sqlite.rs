//! The idempotent-request conformance suite on a real SQLite database file (always runs:
//! SQLite is embedded).

mod request_extras;

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
request_extras::request_extras!(SqliteFixture);

/// On SQLite a running operation's transaction holds the write lock, so its heartbeat cannot
/// renew the lease meanwhile. A retry after the lease ran out must still be answered at once
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
