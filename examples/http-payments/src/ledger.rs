//! The `charges` table on each SQL engine: its schema, the insert a charge is (through the
//! idempotency layer's transaction, or the ledger's own), and the lookup `GET /charges/{id}` is.

use std::future::Future;
use std::time::Duration;

use anyhow::{Context, Result};
use idem_sql::{PostgresTx, Tx};
use serde::Serialize;
use sqlx::{MySql, MySqlConnection, PgConnection, Sqlite, SqliteConnection};

/// One executed charge, as stored and as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) struct Charge {
    pub(crate) id: String,
    pub(crate) account: String,
    pub(crate) amount_cents: i64,
    /// RFC 3339, UTC, microseconds.
    pub(crate) created_at: String,
    /// The card processor's ID of the charge, with `--card-processor` (else absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) processor_charge_id: Option<String>,
}

/// `principal` is who asked (a digest of the bearer token, never the token): `GET /charges/{id}`
/// answers only its owner.
const SQLITE_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS charges (
        id TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents INTEGER NOT NULL,
        created_at TEXT NOT NULL)"];

const POSTGRES_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS charges (
        id TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents BIGINT NOT NULL,
        created_at TEXT NOT NULL)"];

/// The compared columns are `VARBINARY`, compared byte for byte as SQLite's and PostgreSQL's
/// `TEXT` are: under the server's default collation `"TOK"` would find `"tok"`'s charges.
/// They are never read back (the lookups know them), so no one decodes binary as text.
const MYSQL_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS charges (
        id VARBINARY(64) PRIMARY KEY,
        principal VARBINARY(255) NOT NULL,
        account VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
        amount_cents BIGINT NOT NULL,
        created_at VARCHAR(40) CHARACTER SET ascii NOT NULL)"];

/// The column `--card-processor` fills, added in place to a `charges` table made before it.
const SQLITE_PROCESSOR_COLUMN: &str = "ALTER TABLE charges ADD COLUMN processor_charge_id TEXT";
const POSTGRES_PROCESSOR_COLUMN: &str =
    "ALTER TABLE charges ADD COLUMN IF NOT EXISTS processor_charge_id TEXT";
const MYSQL_PROCESSOR_COLUMN: &str =
    "ALTER TABLE charges ADD COLUMN processor_charge_id VARCHAR(255) CHARACTER SET utf8mb4 NULL";

/// Adds `processor_charge_id` to `charges` with `alter` unless a probe finds it (so a start
/// takes no `ALTER TABLE` lock when the column is there). Another replica adding it at the
/// same moment makes `alter` fail: the column is then found by the second probe.
async fn add_processor_column<DB>(pool: &sqlx::Pool<DB>, alter: &str) -> Result<()>
where
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    const PROBE: &str = "SELECT processor_charge_id FROM charges WHERE 1 = 0";
    if sqlx::query(PROBE).fetch_optional(pool).await.is_ok() {
        return Ok(());
    }
    if let Err(e) = sqlx::query(alter).execute(pool).await
        && sqlx::query(PROBE).fetch_optional(pool).await.is_err()
    {
        return Err(anyhow::Error::from(e).context("adding charges.processor_charge_id"));
    }
    Ok(())
}

/// The SQL database holding the charges, for the paths that do not write through the
/// idempotency layer's transaction: reads, the Redis store (no shared transaction) and the
/// benchmark's baseline without the layer.
#[derive(Debug, Clone)]
pub(crate) enum Ledger {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

impl Ledger {
    /// Wraps a store's pool and creates the table if missing.
    pub(crate) async fn sqlite(pool: sqlx::SqlitePool) -> Result<Self> {
        for ddl in SQLITE_SCHEMA {
            sqlx::query(ddl).execute(&pool).await?;
        }
        add_processor_column(&pool, SQLITE_PROCESSOR_COLUMN).await?;
        Ok(Self::Sqlite(pool))
    }

    /// Wraps a store's pool and creates the table if missing.
    pub(crate) async fn postgres(pool: sqlx::PgPool) -> Result<Self> {
        for ddl in POSTGRES_SCHEMA {
            sqlx::query(ddl).execute(&pool).await?;
        }
        add_processor_column(&pool, POSTGRES_PROCESSOR_COLUMN).await?;
        Ok(Self::Postgres(pool))
    }

    /// Wraps a store's pool and creates the table if missing.
    pub(crate) async fn mysql(pool: sqlx::MySqlPool) -> Result<Self> {
        for ddl in MYSQL_SCHEMA {
            sqlx::query(ddl).execute(&pool).await?;
        }
        add_processor_column(&pool, MYSQL_PROCESSOR_COLUMN).await?;
        Ok(Self::MySql(pool))
    }

    /// Opens the ledger at `url` on its own pool (through idem-sql, which sets SQLite up with
    /// WAL, `--busy-timeout` and `--max-connections`).
    pub(crate) async fn open(url: &str, args: &crate::ServeArgs) -> Result<Self> {
        let shown = idem_redact::redact_url(url);
        let context = || format!("opening the ledger {shown}");
        let store = crate::stores::open_sql(url, args)
            .await
            .with_context(context)?;
        store.visit(OnPool).await
    }

    /// Inserts `charge` in a transaction of its own, calling `inside` before the commit.
    pub(crate) async fn insert<F>(
        &self,
        principal: &str,
        charge: &Charge,
        inside: F,
    ) -> Result<(), sqlx::Error>
    where
        F: Future<Output = ()> + Send,
    {
        match self {
            Ledger::Sqlite(pool) => {
                // BEGIN IMMEDIATE: take the write lock up front instead of upgrading a read
                // lock, which SQLite refuses (SQLITE_BUSY) under concurrent writers.
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                insert_sqlite(&mut tx, principal, charge).await?;
                inside.await;
                tx.commit().await
            }
            Ledger::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                insert_postgres(&mut tx, principal, charge).await?;
                inside.await;
                tx.commit().await
            }
            Ledger::MySql(pool) => {
                let mut tx = pool.begin().await?;
                insert_mysql(&mut tx, principal, charge).await?;
                inside.await;
                tx.commit().await
            }
        }
    }

    /// Inserts `charge` under the first ID of `id(0)`, `id(1)`, … that is free or holds a
    /// charge younger than `ttl`, in a transaction of its own, calling `inside` before the
    /// commit; returns the charge as stored (the existing one when there was one).
    ///
    /// For stores without a shared transaction, whose charge IDs are derived from the
    /// request's record: a re-execution of the record (after a crash, or a late one after a
    /// takeover) finds the first charge instead of making a second. A charge older than the
    /// records live (`ttl`) cannot belong to the record being executed — it belonged to an
    /// earlier use of the key that expired — so the key's new use takes the next ID and makes
    /// a new charge, as on the SQL stores. (A record kept in progress longer than `ttl` by its
    /// heartbeat would be taken for a new use: not a case for a payments API.)
    pub(crate) async fn insert_once<F, I>(
        &self,
        principal: &str,
        charge: &Charge,
        id: I,
        ttl: Duration,
        inside: F,
    ) -> Result<Charge, sqlx::Error>
    where
        F: Future<Output = ()> + Send,
        I: Fn(u32) -> String,
    {
        const SELECT: &str = "SELECT account, amount_cents, created_at FROM charges WHERE id = ";
        type Row = (String, i64, String);
        let young = |row: &Row| !older_than(&row.2, ttl);
        let mut generation = 0u32;
        let (id, row) = match self {
            Ledger::Sqlite(pool) => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let found = loop {
                    let id = id(generation);
                    sqlx::query(
                        "INSERT INTO charges (id, principal, account, amount_cents, created_at) VALUES (?, ?, ?, ?, ?)
                         ON CONFLICT (id) DO NOTHING",
                    )
                    .bind(&id)
                    .bind(principal)
                    .bind(&charge.account)
                    .bind(charge.amount_cents)
                    .bind(&charge.created_at)
                    .execute(&mut *tx)
                    .await?;
                    let row: Row = sqlx::query_as(&format!("{SELECT}?"))
                        .bind(&id)
                        .fetch_one(&mut *tx)
                        .await?;
                    if young(&row) {
                        break (id, row);
                    }
                    generation += 1;
                };
                inside.await;
                tx.commit().await?;
                found
            }
            Ledger::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let found = loop {
                    let id = id(generation);
                    sqlx::query(
                        "INSERT INTO charges (id, principal, account, amount_cents, created_at) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT (id) DO NOTHING",
                    )
                    .bind(&id)
                    .bind(principal)
                    .bind(&charge.account)
                    .bind(charge.amount_cents)
                    .bind(&charge.created_at)
                    .execute(&mut *tx)
                    .await?;
                    let row: Row = sqlx::query_as(&format!("{SELECT}$1"))
                        .bind(&id)
                        .fetch_one(&mut *tx)
                        .await?;
                    if young(&row) {
                        break (id, row);
                    }
                    generation += 1;
                };
                inside.await;
                tx.commit().await?;
                found
            }
            Ledger::MySql(pool) => {
                let mut tx = pool.begin().await?;
                let found = loop {
                    let id = id(generation);
                    // A no-op update, not INSERT IGNORE (which would also hide truncation).
                    sqlx::query(
                        "INSERT INTO charges (id, principal, account, amount_cents, created_at) VALUES (?, ?, ?, ?, ?)
                         ON DUPLICATE KEY UPDATE id = id",
                    )
                    .bind(&id)
                    .bind(principal)
                    .bind(&charge.account)
                    .bind(charge.amount_cents)
                    .bind(&charge.created_at)
                    .execute(&mut *tx)
                    .await?;
                    let row: Row = sqlx::query_as(&format!("{SELECT}?"))
                        .bind(&id)
                        .fetch_one(&mut *tx)
                        .await?;
                    if young(&row) {
                        break (id, row);
                    }
                    generation += 1;
                };
                inside.await;
                tx.commit().await?;
                found
            }
        };
        let (account, amount_cents, created_at) = row;
        Ok(Charge {
            id,
            account,
            amount_cents,
            created_at,
            processor_charge_id: None,
        })
    }

    /// Whether `e` is worth retrying soon — SQLite's write lock not free within the busy
    /// timeout, a deadlock, a serialization failure — as idem-sql classifies it (by the
    /// driver's code).
    pub(crate) fn transient(&self, e: &sqlx::Error) -> bool {
        use idem_core::TransactionalStore;
        // A store over the same pool, only to ask it; this is the error path.
        let kind = match self {
            Ledger::Sqlite(pool) => idem_sql::SqliteStore::from_pool(pool.clone()).classify(e),
            Ledger::Postgres(pool) => idem_sql::PostgresStore::from_pool(pool.clone()).classify(e),
            Ledger::MySql(pool) => idem_sql::MySqlStore::from_pool(pool.clone()).classify(e),
        };
        kind == Some(idem_core::ErrorKind::Transient)
    }

    /// The charge `id` if `principal` made it.
    pub(crate) async fn get(
        &self,
        principal: &str,
        id: &str,
    ) -> Result<Option<Charge>, sqlx::Error> {
        type Row = (String, i64, String, Option<String>);
        let row: Option<Row> = match self {
            Ledger::Sqlite(pool) => {
                sqlx::query_as(
                    "SELECT account, amount_cents, created_at, processor_charge_id FROM charges WHERE id = ? AND principal = ?",
                )
                .bind(id)
                .bind(principal)
                .fetch_optional(pool)
                .await?
            }
            Ledger::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT account, amount_cents, created_at, processor_charge_id FROM charges WHERE id = $1 AND principal = $2",
                )
                .bind(id)
                .bind(principal)
                .fetch_optional(pool)
                .await?
            }
            Ledger::MySql(pool) => {
                sqlx::query_as(
                    "SELECT account, amount_cents, created_at, processor_charge_id FROM charges WHERE id = ? AND principal = ?",
                )
                .bind(id)
                .bind(principal)
                .fetch_optional(pool)
                .await?
            }
        };
        Ok(row.map(
            |(account, amount_cents, created_at, processor_charge_id)| Charge {
                id: id.to_owned(),
                account,
                amount_cents,
                created_at,
                processor_charge_id,
            },
        ))
    }
}

/// Whether an RFC 3339 `created_at` is more than `ttl` ago. One that does not parse counts as
/// young: finding a charge again is safe, making a second one is not.
fn older_than(created_at: &str, ttl: Duration) -> bool {
    let format = time::format_description::well_known::Rfc3339;
    match time::OffsetDateTime::parse(created_at, &format) {
        Ok(at) => time::OffsetDateTime::now_utc() - at > ttl,
        Err(_) => false,
    }
}

async fn insert_sqlite(
    conn: &mut SqliteConnection,
    principal: &str,
    c: &Charge,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO charges (id, principal, account, amount_cents, created_at, processor_charge_id) VALUES (?, ?, ?, ?, ?, ?)",
    )
    .bind(&c.id)
    .bind(principal)
    .bind(&c.account)
    .bind(c.amount_cents)
    .bind(&c.created_at)
    .bind(&c.processor_charge_id)
    .execute(conn)
    .await
    .map(drop)
}

async fn insert_postgres(
    conn: &mut PgConnection,
    principal: &str,
    c: &Charge,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO charges (id, principal, account, amount_cents, created_at, processor_charge_id) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&c.id)
    .bind(principal)
    .bind(&c.account)
    .bind(c.amount_cents)
    .bind(&c.created_at)
    .bind(&c.processor_charge_id)
    .execute(conn)
    .await
    .map(drop)
}

async fn insert_mysql(
    conn: &mut MySqlConnection,
    principal: &str,
    c: &Charge,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO charges (id, principal, account, amount_cents, created_at, processor_charge_id) VALUES (?, ?, ?, ?, ?, ?)",
    )
    .bind(&c.id)
    .bind(principal)
    .bind(&c.account)
    .bind(c.amount_cents)
    .bind(&c.created_at)
    .bind(&c.processor_charge_id)
    .execute(conn)
    .await
    .map(drop)
}

/// A transaction a charge can be written through: the idempotency layer's, on a SQL store.
pub(crate) trait WriteCharge: Send {
    /// Inserts the charge row.
    fn insert_charge<'a>(
        &'a mut self,
        principal: &'a str,
        charge: &'a Charge,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

impl WriteCharge for Tx<Sqlite> {
    fn insert_charge<'a>(
        &'a mut self,
        principal: &'a str,
        charge: &'a Charge,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        insert_sqlite(self, principal, charge)
    }
}

impl WriteCharge for PostgresTx {
    fn insert_charge<'a>(
        &'a mut self,
        principal: &'a str,
        charge: &'a Charge,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        insert_postgres(self, principal, charge)
    }
}

impl WriteCharge for Tx<MySql> {
    fn insert_charge<'a>(
        &'a mut self,
        principal: &'a str,
        charge: &'a Charge,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        insert_mysql(self, principal, charge)
    }
}

/// The ledger on the pool of whichever engine the URL chose.
struct OnPool;

impl idem_sql::StoreVisitor for OnPool {
    type Output = Result<Ledger>;

    async fn sqlite(self, store: idem_sql::SqliteStore) -> Result<Ledger> {
        Ledger::sqlite(store.pool().clone()).await
    }

    async fn postgres(self, store: idem_sql::PostgresStore) -> Result<Ledger> {
        Ledger::postgres(store.pool().clone()).await
    }

    async fn mysql(self, store: idem_sql::MySqlStore) -> Result<Ledger> {
        Ledger::mysql(store.pool().clone()).await
    }
}
