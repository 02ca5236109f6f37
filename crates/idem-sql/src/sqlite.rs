//! The SQLite engine: the embedded default.
//!
//! SQLite allows one writer at a time. A consumer's transaction starts with `BEGIN IMMEDIATE`,
//! which takes the write lock up front, so a concurrent duplicate waits (up to the busy timeout)
//! for the first transaction to finish and then finds its committed claim — the same guarantee
//! the row lock gives on PostgreSQL. A deferred `BEGIN` would instead fail with SQLITE_BUSY when
//! it tries to upgrade a read lock. The journal is WAL, so readers never block the writer.
//!
//! # Idempotent requests and the write lock
//!
//! Request records (see [`crate::requests`]) are taken, renewed and released by statements of
//! their own that commit at once, and a retry is answered from a WAL read alone. The
//! transaction the handler writes through — which the record's completion commits with — begins
//! **deferred** (`BEGIN DEFERRED`, [`Engine::REQUEST_BEGIN`]): it takes the write lock at the
//! handler's first write, so a handler that only reads, or calls another service, or sleeps,
//! never keeps another key's request from taking its record or writing. How each step meets the
//! lock, and the busy timeout ([`SqliteOptions::busy_timeout`]) that bounds every wait for it:
//!
//! - **taking a record**: a short write of its own, waiting up to the busy timeout; past it the
//!   lookup fails as transient (`idem-http` answers `503` with `Retry-After`) and nothing is
//!   recorded;
//! - **the handler's first write** waits up to the busy timeout too (its error is SQLite's
//!   `SQLITE_BUSY`, classified transient). A write *after a read* in the same transaction does
//!   not wait: SQLite refuses at once to turn a read into a write while another transaction
//!   holds the lock, or once another committed since the read (`SQLITE_BUSY_SNAPSHOT`). A
//!   handler that reads before it writes and must not fail under concurrent writers writes
//!   first, or takes the lock first with a write that changes nothing;
//! - **the completion** runs in the handler's transaction. When the handler wrote, the
//!   transaction holds the lock already. When it did not, the completion takes it; if SQLite
//!   refuses the transaction's read snapshot, the transaction — which holds no write — is
//!   begun again with `BEGIN IMMEDIATE` and the completion commits there (see
//!   `complete_request`);
//! - **a lease renewal** never waits for the lock: while any transaction holds it — often the
//!   renewing execution's own — it is refused at once and tried again shortly (waiting would
//!   keep a pooled connection for as long as that transaction runs). No one can take the
//!   record over meanwhile either: a **take-over** of a lapsed lease also runs only if the lock
//!   is free at once, and otherwise reports the record in progress, since its holder may still
//!   be writing;
//! - **releasing a record** waits up to the busy timeout; `idem-request` retries a release
//!   the store refused in the background and before the next lookup of the key, so a key
//!   whose request failed for want of the lock is not left "in progress".
//!
//! Times are this host's clock, the only host writing the file.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use idem_core::{
    BatchClaimStore, ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Migrate, Prune, Stamp,
};
use idem_dialect::sqlite as dialect;
use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{QueryBuilder, Sqlite};

use crate::common::{host_stamp, stored_fingerprint};
use crate::engine::{ClaimStatements, Driver, Engine, OutboxStatements, Param, RequestStatements};
use crate::errors::store_error;
use crate::store::SqlStore;
use crate::tx::Tx;
use idem_core::TableName;

/// SQLite has no practical limit; this bound keeps rows and the index reasonable.
pub const MAX_MESSAGE_ID_LEN: usize = dialect::MAX_MESSAGE_ID_LEN;

/// Rows per multi-row INSERT, under SQLite's bound-parameter limit (4 per row).
const CHUNK: usize = 500;

/// Claims stored in an SQLite database file.
pub type SqliteStore = SqlStore<Sqlite>;

impl crate::engine::sealed::Sealed for Sqlite {}

impl Engine for Sqlite {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = dialect::BEGIN;
    const REQUEST_BEGIN: &'static str = dialect::REQUEST_BEGIN;
    const SERVER: bool = false;
    const TRANSACTIONAL_DDL: bool = true;
    type Layout = ();

    fn claim_statements(t: &TableName, _: &()) -> ClaimStatements {
        dialect::claim_statements(t)
    }

    /// `now` (host microseconds) is the last parameter.
    fn request_statements(t: &TableName) -> RequestStatements {
        dialect::request_statements(t)
    }

    fn migration(claims: &TableName, requests: &TableName, _: &()) -> Vec<String> {
        dialect::migration(claims, requests)
    }

    fn recovery_migration(requests: &TableName) -> Option<idem_dialect::RecoveryMigration> {
        Some(dialect::recovery_migration(requests))
    }

    fn outbox_statements(t: &TableName) -> OutboxStatements {
        dialect::outbox_statements(t)
    }

    fn outbox_migration(t: &TableName) -> Vec<String> {
        dialect::outbox_migration(t)
    }

    fn check_table(table: &TableName, _: &()) -> Result<(), Error> {
        if table.schema().is_some() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "SQLite tables cannot be schema-qualified here; use a plain table name",
            ));
        }
        Ok(())
    }

    fn stamp(stamp: Stamp) -> Option<i64> {
        host_stamp(stamp)
    }

    fn database_kind(db: &dyn DatabaseError) -> ErrorKind {
        let code = db.code().and_then(|c| c.parse::<u32>().ok()).unwrap_or(1);
        dialect::kind(code, db.message())
    }

    async fn execute_unless_locked<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<Option<u64>, sqlx::Error> {
        unless_locked(pool, sql, params).await
    }

    async fn complete_request<'e>(
        tx: &'e mut Tx<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<u64, sqlx::Error> {
        complete_request(tx, sql, params).await
    }
}

/// How an SQLite database is opened.
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    busy_timeout: Duration,
    synchronous: SqliteSynchronous,
    max_connections: u32,
    create: bool,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(10),
            synchronous: SqliteSynchronous::Full,
            max_connections: 8,
            create: true,
        }
    }
}

impl SqliteOptions {
    /// How long a statement waits for the write lock before failing with a transient error
    /// (default 10 s): a consumer's `BEGIN IMMEDIATE`, and for idempotent requests the take of
    /// a record, the handler's first write and the completion — past it `idem-http` answers
    /// `503` with `Retry-After`. Give an HTTP API's store a bound its clients can wait for (a
    /// second or two); it may share the database file with a consumer's store opened with
    /// another.
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    /// `synchronous = NORMAL` instead of `FULL`: faster commits, but a power loss may undo the
    /// last commits *after* the broker was acked — those messages' effects are then lost.
    /// Only for data you can rebuild.
    pub fn relaxed_durability(mut self) -> Self {
        self.synchronous = SqliteSynchronous::Normal;
        self
    }

    /// Pool size (default 8). Writers still take turns; more connections help readers. Every
    /// idempotent request in flight holds one for its transaction, from its record's take to
    /// its completion, whether or not it writes: size the pool of an HTTP API's store for the
    /// keyed requests it serves at once.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Fail instead of creating a missing database file.
    pub fn must_exist(mut self) -> Self {
        self.create = false;
        self
    }
}

impl SqlStore<Sqlite> {
    /// Opens (creating if needed) the database file at `path` with WAL, a busy timeout and
    /// full durability.
    pub async fn open(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, Error> {
        let connect = SqliteConnectOptions::new().filename(path.as_ref());
        Self::open_with(connect, options, &path.as_ref().display().to_string()).await
    }

    /// Opens a `sqlite:` URL (`sqlite:idem.db`, `sqlite:///var/lib/app/idem.db`,
    /// `sqlite::memory:` is refused: each pooled connection would see its own database).
    pub async fn connect(url: &str, options: SqliteOptions) -> Result<Self, Error> {
        if url.contains(":memory:") || url.contains("mode=memory") {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "in-memory SQLite is not supported: claims would vanish with the connection",
            ));
        }
        let connect = SqliteConnectOptions::from_str(url).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid SQLite URL {:?}: {e}", idem_redact::redact_url(url)),
            )
            .with_source(e)
        })?;
        Self::open_with(connect, options, &idem_redact::redact_url(url)).await
    }

    async fn open_with(
        connect: SqliteConnectOptions,
        o: SqliteOptions,
        what: &str,
    ) -> Result<Self, Error> {
        let connect = connect
            .create_if_missing(o.create)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(o.synchronous)
            .busy_timeout(o.busy_timeout)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(o.max_connections)
            .connect_with(connect)
            .await
            .map_err(|e| store_error::<Sqlite>(&format!("opening {what}"), e))?;
        Ok(Self::from_pool(pool))
    }
}

/// A pooled connection whose busy timeout was changed: closed instead of returned to the pool
/// when dropped before it was restored.
struct ClosedUnlessRestored {
    conn: sqlx::pool::PoolConnection<Sqlite>,
    restored: bool,
}

impl Drop for ClosedUnlessRestored {
    fn drop(&mut self) {
        if !self.restored {
            self.conn.close_on_drop();
        }
    }
}

/// Runs `sql` without waiting for the write lock (`busy_timeout` 0 for this one statement):
/// `None` when a transaction holds it. A take-over then reports the record in progress (the
/// holder may be its old executor, still running) instead of blocking; a lease renewal tries
/// again shortly (the holder may be its own execution's transaction, which would otherwise
/// keep a pooled connection waiting for as long as it runs).
async fn unless_locked(
    pool: &sqlx::Pool<Sqlite>,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Option<u64>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let waits: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await?;
    // Never hand a connection that gives up at once back to the pool: until its busy
    // timeout is restored, dropping it (an error, a cancelled lookup) closes it.
    let mut nowait = ClosedUnlessRestored {
        conn,
        restored: false,
    };
    sqlx::query("PRAGMA busy_timeout = 0")
        .execute(&mut *nowait.conn)
        .await?;
    let outcome = Sqlite::execute(&mut nowait.conn, sql, params).await;
    let restore = format!("PRAGMA busy_timeout = {waits}");
    nowait.restored = sqlx::query(&restore)
        .execute(&mut *nowait.conn)
        .await
        .is_ok();
    match outcome {
        Ok(rows) => Ok(Some(rows)),
        Err(e) if busy_code(&e).is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The extended result code of an `SQLITE_BUSY` error (primary code 5: plain, after a wait or
/// a refused upgrade; 517 `SQLITE_BUSY_SNAPSHOT`; 261 `SQLITE_BUSY_RECOVERY`; …).
fn busy_code(e: &sqlx::Error) -> Option<u32> {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<u32>().ok())
            .filter(|c| c & 0xff == 5),
        _ => None,
    }
}

/// `SQLITE_BUSY_SNAPSHOT`: a read transaction's snapshot is older than the last commit, so it
/// can never become a write transaction.
const BUSY_SNAPSHOT: u32 = 517;

/// The completion in a request's deferred transaction. When the handler wrote through it,
/// the transaction holds the write lock and the statement just runs. When it did not, the
/// statement must take the lock now, and `SQLITE_BUSY` can come three ways: at once, from a
/// transaction holding a read snapshot while another holds the lock (SQLite refuses to wait
/// there, which could deadlock); at once with `SQLITE_BUSY_SNAPSHOT`, from a snapshot older
/// than the last commit; or after waiting out the busy timeout. Either of the first two is
/// answered by beginning the transaction again with `BEGIN IMMEDIATE` — which waits for the
/// lock, up to the busy timeout — and completing in it: nothing is lost, since a transaction
/// that could not write holds no write of the handler's. (An attached database the handler may
/// have written to without the main database's lock would be lost, so with one attached the
/// error is returned instead.) After a full wait the error is returned as it is: waiting
/// again would double the bound.
async fn complete_request(
    tx: &mut Tx<Sqlite>,
    sql: &str,
    params: &[Param<'_>],
) -> Result<u64, sqlx::Error> {
    let started = std::time::Instant::now();
    let first = Sqlite::execute(tx, sql, params).await;
    let Err(e) = first else {
        return first;
    };
    let Some(code) = busy_code(&e) else {
        return Err(e);
    };
    let waited = started.elapsed();
    let timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut **tx)
        .await?;
    let timeout = Duration::from_millis(u64::try_from(timeout).unwrap_or(0));
    // SQLite's busy handler gives up at the timeout itself; a refused upgrade is immediate.
    if code != BUSY_SNAPSHOT && waited + Duration::from_millis(20) >= timeout {
        return Err(e);
    }
    let attached: Vec<(i64, String, String)> = sqlx::query_as("PRAGMA database_list")
        .fetch_all(&mut **tx)
        .await?;
    if attached
        .iter()
        .any(|(_, name, _)| name != "main" && name != "temp")
    {
        return Err(e);
    }
    tx.begin_again(Sqlite::BEGIN).await?;
    Sqlite::execute(tx, sql, params).await
}

impl BatchClaimStore for SqliteStore {
    async fn claim_many(
        &self,
        tx: &mut Tx<Sqlite>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let claimed = claim_many(self, tx, consumer, items, at).await;
        tx.saw(&claimed);
        claimed
    }
}

impl Prune for SqliteStore {
    async fn prune_batch(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        self.prune_rows(consumer, now, older_than, limit).await
    }
}

impl Migrate for SqliteStore {
    /// Both tables in one `BEGIN IMMEDIATE` transaction: concurrent starts take turns.
    async fn migrate(&self) -> Result<(), Error> {
        self.migrate_tables().await
    }
}

/// The batch claim: multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING`, in chunks under
/// SQLite's parameter limit; the fingerprints of the rest are read one by one (no round trip
/// on an embedded database).
async fn claim_many(
    store: &SqliteStore,
    tx: &mut Tx<Sqlite>,
    consumer: &ConsumerName,
    items: &[(&MessageId, Fingerprint)],
    at: Stamp,
) -> Result<Vec<Option<Fingerprint>>, Error> {
    let at = host_stamp(at);
    let mut inserted = std::collections::HashSet::new();
    for chunk in items.chunks(CHUNK) {
        let mut q = QueryBuilder::<Sqlite>::new(&store.sql.claim_many);
        q.push_values(chunk, |mut row, (id, fp)| {
            row.push_bind(consumer.as_str())
                .push_bind(id.as_bytes())
                .push_bind(&fp.as_bytes()[..])
                .push_bind(at);
        });
        q.push(&store.sql.claim_many_tail);
        let rows: Vec<Vec<u8>> = q
            .build_query_scalar()
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| store_error::<Sqlite>("batch claim", e))?;
        inserted.extend(rows);
    }
    let mut out = Vec::with_capacity(items.len());
    for (id, _) in items {
        if inserted.contains(id.as_bytes()) {
            out.push(None);
        } else {
            let params = [Param::Text(consumer.as_str()), Param::Bytes(id.as_bytes())];
            let row = Sqlite::fetch_bytes(tx, &store.sql.read_fingerprint, &params)
                .await
                .map_err(|e| store_error::<Sqlite>("reading the stored fingerprint", e))?;
            out.push(stored_fingerprint(row)?);
        }
    }
    Ok(out)
}
