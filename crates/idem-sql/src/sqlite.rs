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

use idem_core::{ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Stamp};
use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{QueryBuilder, Sqlite};

use crate::common::{host_stamp, stored_fingerprint};
use crate::engine::{Driver, Engine, Param};
use crate::errors::{commit_error, store_error};
use crate::requests::RequestStatements;
use crate::store::{ClaimStatements, SqlStore};
use crate::tx::Tx;
use idem_core::TableName;

/// SQLite has no practical limit; this bound keeps rows and the index reasonable.
pub const MAX_MESSAGE_ID_LEN: usize = 4096;

/// Rows per multi-row INSERT, under SQLite's bound-parameter limit (4 per row).
const CHUNK: usize = 500;

/// Claims stored in an SQLite database file.
pub type SqliteStore = SqlStore<Sqlite>;

impl crate::engine::sealed::Sealed for Sqlite {}

impl Engine for Sqlite {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const REQUEST_BEGIN: &'static str = "BEGIN DEFERRED";
    const SERVER: bool = false;

    fn claim_statements(t: &TableName, _partitioned: bool) -> ClaimStatements {
        ClaimStatements {
            claim_many: format!(
                "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) "
            ),
            read_fingerprints: String::new(),
            claim: format!(
                "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) \
                 VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, message_id) DO NOTHING"
            ),
            read_fingerprint: format!(
                "SELECT fingerprint FROM {t} WHERE consumer = ?1 AND message_id = ?2"
            ),
            prune_all: format!(
                "DELETE FROM {t} WHERE rowid IN \
                 (SELECT rowid FROM {t} WHERE processed_at < ?1 - ?2 LIMIT ?3)"
            ),
            prune_consumer: format!(
                "DELETE FROM {t} WHERE rowid IN \
                 (SELECT rowid FROM {t} WHERE processed_at < ?1 - ?2 AND consumer = ?3 LIMIT ?4)"
            ),
            stats: format!(
                "SELECT consumer, count(*), min(processed_at), max(processed_at) \
                 FROM {t} GROUP BY consumer ORDER BY consumer"
            ),
        }
    }

    /// `now` (host microseconds) is the last parameter.
    fn request_statements(t: &TableName) -> RequestStatements {
        RequestStatements {
            read: format!(
                "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = ?1 AND r.state = 1 THEN r.result END \
             FROM (SELECT ?4 AS now) n LEFT JOIN {t} r ON r.scope = ?2 AND r.idem_key = ?3"
            ),
            insert: format!(
                "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at) \
             VALUES (?1, ?2, ?3, 0, ?4, ?7 + ?5, ?7 + ?6) ON CONFLICT (scope, idem_key) DO NOTHING"
            ),
            reset: format!(
                "UPDATE {t} SET fingerprint = ?1, state = 0, fence = fence + 1, lease_until = ?7 + ?2, \
             expires_at = ?7 + ?3, result = NULL \
             WHERE scope = ?4 AND idem_key = ?5 AND fence = ?6 \
             AND expires_at <= ?7 AND (state = 1 OR lease_until <= ?7)"
            ),
            take_over: format!(
                "UPDATE {t} SET fence = fence + 1, lease_until = ?5 + ?1 \
             WHERE scope = ?2 AND idem_key = ?3 AND fence = ?4 AND state = 0 AND lease_until <= ?5"
            ),
            complete: format!(
                "UPDATE {t} SET state = 1, result = ?1, expires_at = ?6 + ?2 \
             WHERE scope = ?3 AND idem_key = ?4 AND fence = ?5 AND state = 0"
            ),
            release: format!(
                "DELETE FROM {t} WHERE scope = ?1 AND idem_key = ?2 AND fence = ?3 AND state = 0"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until = ?5 + ?1 \
             WHERE scope = ?2 AND idem_key = ?3 AND fence = ?4 AND state = 0"
            ),
            reap: format!(
                "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} \
             WHERE expires_at < ?2 AND (state = 1 OR lease_until < ?2) LIMIT ?1)"
            ),
        }
    }

    fn check_table(table: &TableName) -> Result<(), Error> {
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
        crate::errors::sqlite_kind(code, db.message())
    }

    async fn claim_many(
        store: &SqlStore<Self>,
        tx: &mut Tx<Self>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        claim_many(store, tx, consumer, items, at).await
    }

    async fn migrate(store: &SqlStore<Self>) -> Result<(), Error> {
        migrate(store).await
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
        q.push(" ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id");
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

/// Both tables in one `BEGIN IMMEDIATE` transaction: concurrent starts take turns.
async fn migrate(store: &SqliteStore) -> Result<(), Error> {
    let t = store.table();
    let name = t.table();
    let (r, rname) = (store.requests_table(), store.requests_table().table());
    let mut tx = store.begin_tx().await?;
    for sql in [
        // processed_at: microseconds since the Unix epoch.
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     TEXT    NOT NULL,
                message_id   BLOB    NOT NULL,
                fingerprint  BLOB    NOT NULL,
                processed_at INTEGER NOT NULL,
                PRIMARY KEY (consumer, message_id)
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {name}_processed_at ON {t} (processed_at)"),
        // Idempotent-request records: state 0 in progress, 1 completed; lease_until and
        // expires_at in microseconds since the Unix epoch; result NULL while in progress.
        format!(
            "CREATE TABLE IF NOT EXISTS {r} (
                scope       BLOB    NOT NULL,
                idem_key    BLOB    NOT NULL,
                fingerprint BLOB    NOT NULL,
                state       INTEGER NOT NULL,
                fence       INTEGER NOT NULL,
                lease_until INTEGER NOT NULL,
                expires_at  INTEGER NOT NULL,
                result      BLOB,
                PRIMARY KEY (scope, idem_key)
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {rname}_expires_at ON {r} (expires_at)"),
    ] {
        Sqlite::execute(&mut tx, &sql, &[])
            .await
            .map_err(|e| store_error::<Sqlite>("migrate", e))?;
    }
    tx.commit().await.map_err(commit_error::<Sqlite>)
}
