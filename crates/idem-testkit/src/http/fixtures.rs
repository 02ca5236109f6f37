//! One fixture per real store: an isolated, migrated store (its own SQLite file, PostgreSQL
//! schema, MySQL database or Redis key prefix) with an effects table or counter, plus what the
//! HTTP tests need beyond the store conformance fixture: the outbox too, read as a relay
//! leases it.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use super::outbox::{Enqueue, NoOutbox as _, StoreOutbox};
use crate::isolated::{MySqlDatabase, PgSchema};
use crate::{RequestFixture, RequestTxOf, service_url, services, unique_name};
use idem_core::outbox::{OutboxRow, Outgoing, RelayStore};
use idem_core::{BoxError, Migrate};
use idem_redis::{RedisRequestStore, RedisTx};
use idem_sql::{MySqlStore, PostgresStore, SqliteOptions, SqliteStore};
use redis::aio::ConnectionManager;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;

/// What the HTTP suite needs beside [`RequestFixture`].
pub trait HttpFixture: RequestFixture {
    /// Whether a retry can take over a lapsed lease while the old holder's transaction is
    /// still open after writing. Not on SQLite: a transaction that wrote keeps the database's
    /// write lock, so the retry is told "in progress" until the holder finishes.
    const TAKEOVER_WHILE_HOLDER_RUNS: bool = true;

    /// Request records in the store (any state).
    fn count_records(&self) -> impl Future<Output = i64> + Send;

    /// A store of the same kind whose server is gone (or, for SQLite, whose pool is closed).
    fn down_store(&self) -> impl Future<Output = Self::Store> + Send;

    /// Reads the effects table through `tx` (a read, no write; Redis has nothing to read
    /// through and answers 0).
    fn read_through(
        &self,
        tx: &mut RequestTxOf<Self>,
    ) -> impl Future<Output = Result<i64, BoxError>> + Send;

    /// Enqueues `messages` in `tx` through the store's outbox ([`StoreOutbox`]): the SQL
    /// stores' `OutboxStore`; [`Enqueue::NoOutbox`] where the store's type has none (Redis).
    fn enqueue(
        &self,
        tx: &mut RequestTxOf<Self>,
        messages: &[Outgoing],
    ) -> impl Future<Output = Result<(), Enqueue>> + Send;

    /// The committed, unsent outbox rows in commit order, read as a relay reads them (the
    /// store's [`RelayStore::lease`], by one reader that leases them again on every read);
    /// none where the store has no outbox.
    fn outbox(&self) -> impl Future<Output = Vec<OutboxRow>> + Send;
}

/// The relay name the suite reads the outbox as.
const OUTBOX_READER: &str = "http-suite-reader";

async fn lease_all<S: RelayStore>(store: &S) -> Vec<OutboxRow> {
    let rows = store
        .lease(OUTBOX_READER, 10_000, Duration::from_secs(600))
        .await
        .expect("lease the outbox rows");
    // Leased in commit order, as a relay publishes them.
    assert!(rows.windows(2).all(|w| w[0].seq < w[1].seq), "{rows:?}");
    rows
}

// ---------------------------------------------------------------------------------------- SQLite

/// SQLite: a database file of its own in a temporary directory.
#[derive(Debug)]
pub struct SqliteFx {
    store: SqliteStore,
    dir: PathBuf,
}

impl RequestFixture for SqliteFx {
    type Store = SqliteStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(unique_name("idem_http", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("app.db"), SqliteOptions::default())
            .await
            .expect("open sqlite");
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

impl SqliteFx {
    /// Another store on the same database file, opened with `options`.
    pub async fn store_with(&self, options: SqliteOptions) -> SqliteStore {
        SqliteStore::open(self.dir.join("app.db"), options)
            .await
            .expect("open sqlite")
    }

    /// The lease of `key`'s record (any scope) in microseconds since the Unix epoch.
    pub async fn lease_until(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT lease_until FROM idem_requests WHERE idem_key = ?")
            .bind(key.as_bytes())
            .fetch_one(self.store.pool())
            .await
            .expect("the record's lease")
    }
}

impl HttpFixture for SqliteFx {
    const TAKEOVER_WHILE_HOLDER_RUNS: bool = false;

    async fn read_through(&self, tx: &mut RequestTxOf<Self>) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&mut **tx)
            .await?)
    }

    async fn enqueue(
        &self,
        tx: &mut RequestTxOf<Self>,
        messages: &[Outgoing],
    ) -> Result<(), Enqueue> {
        StoreOutbox(&self.store).enqueue(tx, messages).await
    }

    async fn outbox(&self) -> Vec<OutboxRow> {
        lease_all(&self.store).await
    }

    async fn count_records(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_requests")
            .fetch_one(self.store.pool())
            .await
            .expect("count records")
    }

    async fn down_store(&self) -> SqliteStore {
        let store = SqliteStore::open(self.dir.join("app.db"), SqliteOptions::default())
            .await
            .expect("open sqlite");
        store.pool().close().await;
        store
    }
}

// ------------------------------------------------------------------------------------ PostgreSQL

/// PostgreSQL through idem-sql: a schema of its own (`IDEM_TEST_POSTGRES_URL`).
#[derive(Debug)]
pub struct PgFx {
    store: PostgresStore,
    schema: PgSchema,
}

impl RequestFixture for PgFx {
    type Store = PostgresStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_http", test).await?;
        let pool = schema.pool(20).await;
        let store = PostgresStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key text NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, schema })
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.schema.drop().await;
    }
}

impl HttpFixture for PgFx {
    async fn read_through(&self, tx: &mut RequestTxOf<Self>) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&mut **tx)
            .await?)
    }

    async fn enqueue(
        &self,
        tx: &mut RequestTxOf<Self>,
        messages: &[Outgoing],
    ) -> Result<(), Enqueue> {
        StoreOutbox(&self.store).enqueue(tx, messages).await
    }

    async fn outbox(&self) -> Vec<OutboxRow> {
        lease_all(&self.store).await
    }

    async fn count_records(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_requests")
            .fetch_one(self.store.pool())
            .await
            .expect("count records")
    }

    async fn down_store(&self) -> PostgresStore {
        // Port 1 on loopback: nothing listens, the connection is refused.
        let pool = PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy("postgres://postgres@127.0.0.1:1/test")
            .expect("lazy pool");
        PostgresStore::from_pool(pool)
    }
}

// ----------------------------------------------------------------------------------------- MySQL

/// MySQL / MariaDB: a database of its own (`IDEM_TEST_MYSQL_URL`).
#[derive(Debug)]
pub struct MySqlFx {
    store: MySqlStore,
    database: MySqlDatabase,
}

impl RequestFixture for MySqlFx {
    type Store = MySqlStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let database = MySqlDatabase::create("idem_http", test).await?;
        let pool = database.pool(20).await;
        let store = MySqlStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (k VARCHAR(255) NOT NULL) ENGINE = InnoDB")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, database })
    }

    fn store(&self) -> MySqlStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (k) VALUES (?)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE k = ?")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.database.drop().await;
    }
}

impl HttpFixture for MySqlFx {
    async fn read_through(&self, tx: &mut RequestTxOf<Self>) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&mut **tx)
            .await?)
    }

    async fn enqueue(
        &self,
        tx: &mut RequestTxOf<Self>,
        messages: &[Outgoing],
    ) -> Result<(), Enqueue> {
        StoreOutbox(&self.store).enqueue(tx, messages).await
    }

    async fn outbox(&self) -> Vec<OutboxRow> {
        lease_all(&self.store).await
    }

    async fn count_records(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_requests")
            .fetch_one(self.store.pool())
            .await
            .expect("count records")
    }

    async fn down_store(&self) -> MySqlStore {
        let pool = MySqlPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy("mysql://root@127.0.0.1:1/test")
            .expect("lazy pool");
        MySqlStore::from_pool(pool)
    }
}

// ----------------------------------------------------------------------------------------- Redis

/// Redis: a key prefix of its own (`IDEM_TEST_REDIS_URL`); no transaction shared with the
/// effects, which are counters written directly.
pub struct RedisFx {
    store: RedisRequestStore,
    conn: ConnectionManager,
    prefix: String,
}

impl std::fmt::Debug for RedisFx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisFx")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisFx {
    fn effect_key(&self, key: &str) -> String {
        format!("{}:effects:{key}", self.prefix)
    }

    async fn scan(&self, pattern: &str) -> Vec<String> {
        let mut conn = self.conn.clone();
        let mut cursor = 0u64;
        let mut all = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            all.extend(keys);
            if next == 0 {
                return all;
            }
            cursor = next;
        }
    }
}

impl RequestFixture for RedisFx {
    type Store = RedisRequestStore;
    const SHARED_TRANSACTION: bool = false;

    async fn setup(test: &str) -> Option<Self> {
        let url = service_url(services::REDIS, test)?;
        let prefix = unique_name("idem_http", test);
        let store = RedisRequestStore::builder(&url)
            .key_prefix(&prefix)
            .connect()
            .await
            .expect("store connects to redis");
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let conn = ConnectionManager::new(client)
            .await
            .expect("connect to redis");
        Some(Self {
            store,
            conn,
            prefix,
        })
    }

    fn store(&self) -> RedisRequestStore {
        self.store.clone()
    }

    /// No transaction to write through: the effect is an `INCR`, done at once.
    async fn record_effect(&self, _tx: &mut RedisTx, key: &str) -> Result<(), BoxError> {
        let _: i64 = redis::cmd("INCR")
            .arg(self.effect_key(key))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        let n: Option<i64> = redis::cmd("GET")
            .arg(self.effect_key(key))
            .query_async(&mut self.conn.clone())
            .await
            .expect("GET effect counter");
        n.unwrap_or(0)
    }

    async fn teardown(self) {
        let keys = self.scan(&format!("{}:*", self.prefix)).await;
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut self.conn.clone())
                .await;
        }
    }
}

impl HttpFixture for RedisFx {
    async fn read_through(&self, _tx: &mut RedisTx) -> Result<i64, BoxError> {
        Ok(0)
    }

    /// `RedisRequestStore` implements no `OutboxStore`: refused (see [`StoreOutbox`]).
    async fn enqueue(&self, tx: &mut RedisTx, messages: &[Outgoing]) -> Result<(), Enqueue> {
        StoreOutbox(&self.store).enqueue(tx, messages).await
    }

    async fn outbox(&self) -> Vec<OutboxRow> {
        Vec::new()
    }

    async fn count_records(&self) -> i64 {
        self.scan(&format!("{}:{{*}}:rec", self.prefix)).await.len() as i64
    }

    /// A real outage: a Redis server of our own, connected to, then killed.
    async fn down_store(&self) -> RedisRequestStore {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (the Redis tests need it on PATH)");
        let url = format!("redis://127.0.0.1:{port}");
        let mut store = None;
        for _ in 0..100 {
            if let Ok(s) = RedisRequestStore::builder(&url)
                .key_prefix(&self.prefix)
                .connection_timeout(Duration::from_millis(500))
                .response_timeout(Duration::from_secs(1))
                .connection_retries(1)
                .connect()
                .await
            {
                store = Some(s);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let store = store.expect("our redis-server came up");
        child.kill().expect("kill our redis-server");
        child.wait().expect("reap our redis-server");
        store
    }
}
