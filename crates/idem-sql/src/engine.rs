//! What differs between SQL engines, as one sealed trait of data: [`Engine`]. Everything
//! else — the store, its transactions, every capability of `idem_core::store` — is written
//! once, in [`SqlStore`](crate::SqlStore), [`Tx`] and the request-record code, generic over the
//! engine, and executes what the engine answers.
//!
//! An engine is a sqlx database type (`sqlx::Sqlite`, `sqlx::Postgres`, `sqlx::MySql`; its
//! `sqlx::Database::NAME` starts every error message it causes) with: its SQL (the claim,
//! prune, stats and request statements and the migration, all from `idem_dialect`, the text
//! `idem-postgres` runs too), how it lays out a claims table beyond its name
//! ([`Engine::Layout`]: PostgreSQL's may be partitioned by the ID's time), whose clock stamps
//! claims (the server's, or this host's for an embedded file), how a transaction begins and
//! commits, and how the driver's error codes map onto [`ErrorKind`]s. It never sees the store.
//! Where engines differ in what a store *does* rather than in what it sends — the batch
//! claim's binding (`unnest` arrays or multi-row `VALUES`), a partitioned table's maintenance
//! — the capability is implemented on the concrete store type, in the engine's module.
//! `CONTRIBUTING.md` walks through adding one.
//!
//! The driver glue ([`Driver`]) is implemented once for every sqlx database, so generic code
//! can run a statement with idem's few parameter types without restating sqlx's trait bounds
//! at every use (Rust does not carry a trait's `where` clauses to its users; a supertrait with a
//! blanket impl does).

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use idem_core::{ConsumerStats, Error, ErrorKind, MessageId, Stamp, TableName};
use sqlx::error::DatabaseError;

use crate::requests::{RecordRow, RecoveryRow};
use crate::tx::Tx;
use idem_dialect::outbox::Candidate;
pub use idem_dialect::{ClaimStatements, OutboxStatements, RequestStatements};

/// An SQL engine idem stores claims on: implemented for `sqlx::Sqlite`, `sqlx::Postgres` and
/// `sqlx::MySql` (each behind the cargo feature of the same name). Sealed: a new engine is
/// added inside this crate (see `CONTRIBUTING.md`), where the conformance suites prove it.
pub trait Engine: Driver + sealed::Sealed {
    /// Longest message ID the schema holds.
    const MAX_MESSAGE_ID_LEN: usize;

    /// Begins a transaction: `BEGIN`, or SQLite's `BEGIN IMMEDIATE`, which takes the write lock
    /// up front so a concurrent duplicate waits for the first claim instead of failing. It is
    /// sent through sqlx's transaction manager, so that sqlx counts the transaction and a
    /// handler's nested `begin()` is a savepoint (see [`Tx`]).
    const BEGIN: &'static str;

    /// Begins the transaction of an idempotent request's execution
    /// ([`RequestStore::begin_execution`](idem_core::store::RequestStore::begin_execution)):
    /// [`BEGIN`](Self::BEGIN), unless that takes a lock every writer waits for. SQLite's is
    /// `BEGIN DEFERRED`: the write lock is taken by the handler's first write (or, for a
    /// handler that wrote nothing, by the completion), never held while the handler does
    /// anything else; the record's own statements run outside it.
    const REQUEST_BEGIN: &'static str = Self::BEGIN;

    /// Whether a request record can be taken inside the operation's transaction
    /// ([`RequestStore::begin_request_in`](idem_core::store::RequestStore::begin_request_in),
    /// the one-transaction mode): the engine's take statements must then never wait for a
    /// record another transaction holds uncommitted (PostgreSQL's advisory lock taken without
    /// waiting, MariaDB's zero lock-wait timeout; see `idem_dialect`). Not SQLite: the take
    /// would hold its one write lock for the whole operation (see `sqlite.rs`).
    const ONE_TRANSACTION: bool = false;

    /// Whether a database error says a take statement met a record another transaction holds
    /// and did not wait for it (MariaDB's 1205 under its zero lock-wait timeout): the record is
    /// in progress.
    fn lock_not_granted(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// The plain form of take statement `sql` when `error` says the server cannot parse its
    /// no-wait form (MySQL 8 has no MariaDB `SET STATEMENT`); `None` otherwise.
    fn plain_take<'s>(_error: &dyn DatabaseError, _sql: &'s str) -> Option<&'s str> {
        None
    }

    /// How a transaction commits where sqlx's own `COMMIT` would not do; `None`: through
    /// sqlx's transaction manager. PostgreSQL's is `SELECT 1; COMMIT`: after any failed
    /// statement it aborts the transaction and a bare `COMMIT` would roll back *and report
    /// success*; the `SELECT` fails first instead (see [`Engine::aborted`]).
    const CHECKED_COMMIT: Option<CheckedCommit> = None;

    /// Whether the database is a server at the other end of a socket (not an embedded file):
    /// a `BEGIN` may then hang on a peer that vanished, so it gets a timeout by default (see
    /// `SqlStore::begin_timeout`). SQLite's `BEGIN IMMEDIATE` waits for the write lock, which
    /// its busy timeout bounds already.
    const SERVER: bool;

    /// Whether the migration runs in one transaction (begun with [`BEGIN`](Self::BEGIN)):
    /// not on MySQL, whose DDL commits implicitly.
    const TRANSACTIONAL_DDL: bool;

    /// What a store knows about its claims table's layout beyond its name: nothing (`()`)
    /// but on PostgreSQL, where it is the table's partitioning by the ID's time, if any
    /// (`PostgresStore::partitioned`).
    type Layout: Clone + Debug + Default + Send + Sync + 'static;

    /// The claim statements for `table` laid out as `layout` says, parameters bound in the
    /// order [`ClaimStatements`] documents, then the [`partition_key`](Self::partition_key)
    /// where there is one.
    fn claim_statements(table: &TableName, layout: &Self::Layout) -> ClaimStatements;

    /// The request-record statements for `table` (see [`RequestStatements`]).
    fn request_statements(table: &TableName) -> RequestStatements;

    /// The statements that create the claims table (laid out as `layout` says) and the
    /// requests table, their indexes and comments, each idempotent, in order; run in one
    /// transaction where [`TRANSACTIONAL_DDL`](Self::TRANSACTIONAL_DDL).
    fn migration(claims: &TableName, requests: &TableName, layout: &Self::Layout) -> Vec<String>;

    /// What gives a requests table made before recovery points their columns: run by the
    /// generic `migrate` after [`migration`](Self::migration), in the same way. `None` on
    /// PostgreSQL, whose store migrates in its own way (under an advisory lock) and runs
    /// `idem_dialect::postgres::recovery_migration` itself.
    fn recovery_migration(_requests: &TableName) -> Option<idem_dialect::RecoveryMigration> {
        None
    }

    /// The outbox statements for `table` (see [`OutboxStatements`]).
    fn outbox_statements(table: &TableName) -> OutboxStatements;

    /// The statements that create the outbox table `table` and its dead-letter table, each
    /// idempotent; `migrate` runs them after [`migration`](Self::migration)'s, the same way.
    fn outbox_migration(table: &TableName) -> Vec<String>;

    /// Refuses a table name this engine cannot use (SQLite: a schema-qualified one; a
    /// partitioned PostgreSQL table: one too long for its partitions' names).
    fn check_table(_table: &TableName, _layout: &Self::Layout) -> Result<(), Error> {
        Ok(())
    }

    /// The spelling of `table` the engine resolves it to, used for every statement and catalog
    /// lookup: unchanged by default; PostgreSQL folds it to lower case (see
    /// [`TableName::folded`]).
    fn resolved_table(table: TableName) -> TableName {
        table
    }

    /// The partition key a claim on `id` carries, bound after the claim statements' listed
    /// parameters: `None` on a table that is not partitioned.
    fn partition_key(_layout: &Self::Layout, _id: &MessageId) -> Result<Option<i64>, Error> {
        Ok(None)
    }

    /// How long a table laid out as `layout` keeps every claim by itself (a partitioned
    /// table's retention: its days are dropped past it); `None`: until pruned.
    fn kept_for(_layout: &Self::Layout) -> Option<Duration> {
        None
    }

    /// The `processed_at` / `now` bound for `stamp`: `None` makes a statement read the
    /// server's clock (`COALESCE(?, <server now>)`), so every host stamps and prunes on one
    /// clock; an embedded engine stamps with this host's clock, the only one writing the file.
    fn stamp(stamp: Stamp) -> Option<i64>;

    /// What a database error means for a consumer, by the driver's code — never its message
    /// text, except where the engine has no code for it (SQLite's `no such table`).
    fn database_kind(error: &dyn DatabaseError) -> ErrorKind;

    /// Whether an error says the database takes no writes on this connection (PostgreSQL's
    /// 25006 on a standby or a read-only session, MySQL's `--read-only`): after a failover
    /// behind a stale DNS name a connection can stay on the old primary, now a replica, while
    /// a new one would reach the new primary (see `SqlStore::read_only_limit`).
    fn read_only(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// Whether a database error says the server ended the session under a running statement
    /// (PostgreSQL's 57P01 / 57P02 and class 08, MySQL's 2013 or a killed connection): an
    /// outage under idem's own statements ([`database_kind`](Engine::database_kind) says
    /// so), [`ErrorKind::ConnectionLost`] under a handler's, which a consumer probes to tell
    /// an outage from a message that ends its own session. An embedded engine has no session
    /// to lose.
    fn connection_lost(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// Whether a failed commit says the transaction had already aborted (PostgreSQL's 25P02):
    /// nothing committed because the handler swallowed a failed statement.
    fn aborted(_error: &dyn DatabaseError) -> bool {
        false
    }

    /// Runs a request statement (a take-over, a lease renewal) without waiting for a lock
    /// another transaction holds: its rows affected, or `None` when it could not run without
    /// waiting. SQLite's write lock may be held by the very executor the statement is about
    /// (still writing, or renewing its own lease while its transaction writes), so waiting
    /// could last as long as that transaction does. On a server a row lock it meets is a
    /// completion about to commit, so waiting is short and this just runs it.
    fn execute_unless_locked<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send + 'e {
        async move { Self::execute_pool(pool, sql, params).await.map(Some) }
    }

    /// Runs a request record's completion statement in the operation's transaction `tx`; rows
    /// affected. SQLite's request transaction may not hold the write lock yet (a handler that
    /// wrote nothing), or hold a read snapshot that can no longer become a write: there it is
    /// begun again with the lock, which is safe because it holds no write.
    fn complete_request<'e>(
        tx: &'e mut Tx<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'e {
        async move { Self::execute(tx, sql, params).await }
    }
}

/// A commit as one simple query, in the two forms a [`Tx`] sends (see `tx.rs`).
#[derive(Debug, Clone, Copy)]
pub struct CheckedCommit {
    /// The commit alone (`SELECT 1; COMMIT`).
    pub(crate) alone: &'static str,
    /// The commit followed by `BEGIN`, leaving an empty transaction that sqlx's queued
    /// `ROLLBACK` ends (`SELECT 1; COMMIT; BEGIN`).
    pub(crate) then_begin: &'static str,
}

pub(crate) mod sealed {
    /// Only this crate's engines implement [`Engine`](super::Engine).
    #[allow(unreachable_pub)] // nameable by no one outside: the sealed-trait pattern
    pub trait Sealed {}
}

/// A bound parameter of one of idem's statements: idem binds nothing else.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    /// A consumer name.
    Text(&'a str),
    /// A message ID, fingerprint, scope, key or stored result.
    Bytes(&'a [u8]),
    /// Microseconds, a fence, a limit.
    Int(i64),
    /// A stamp: `None` reads the server's clock.
    OptInt(Option<i64>),
    /// An outgoing message's ordering key, or NULL.
    OptText(Option<&'a str>),
}

impl<'a> From<idem_dialect::outbox::Value<'a>> for Param<'a> {
    fn from(v: idem_dialect::outbox::Value<'a>) -> Self {
        use idem_dialect::outbox::Value;
        match v {
            Value::Bytes(b) => Param::Bytes(b),
            Value::Text(t) => Param::Text(t),
            Value::OptText(t) => Param::OptText(t),
            Value::Int(i) => Param::Int(i),
            Value::OptInt(i) => Param::OptInt(i),
        }
    }
}

/// An outbox backlog as its statement reads it: unsent rows, the oldest unsent `created_at`,
/// sent rows, dead letters, the clock.
pub(crate) type BacklogRow = (i64, Option<i64>, i64, i64, i64);

/// Rows affected, which sqlx reports through each driver's own result type.
#[allow(unreachable_pub)] // sealed: named only through Driver's bounds
pub trait RowsAffected {
    /// Rows the statement inserted, updated or deleted.
    fn rows(&self) -> u64;
}

#[cfg(feature = "sqlite")]
impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "postgres")]
impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// Runs idem's statements on a sqlx database: implemented once, for every database whose
/// driver takes idem's parameter and column types.
#[allow(unreachable_pub)] // sealed: a supertrait of Engine, not exported
pub trait Driver: sqlx::Database {
    /// Runs `sql` on a connection; rows affected.
    fn execute<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'e;

    /// Runs `sql` on a pooled connection; rows affected.
    fn execute_pool<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'e;

    /// Runs parameterless `sql` as one simple query (it may hold several statements); rows
    /// affected, summed over its statements.
    fn execute_simple<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'e;

    /// The one `bytea`/`BLOB` column of the row `sql` returns, if it returns one.
    fn fetch_bytes<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<Option<Vec<u8>>, sqlx::Error>> + Send + 'e;

    /// The request record `sql` reads (always one row).
    fn fetch_record<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<RecordRow, sqlx::Error>> + Send + 'e;

    /// The integer in the first column of the one row `sql` returns.
    fn fetch_int<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'e;

    /// The recovery rows `sql` returns.
    fn fetch_recovery<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<Vec<RecoveryRow>, sqlx::Error>> + Send + 'e;

    /// The outbox rows a lease statement selects.
    fn fetch_candidates<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<Vec<Candidate>, sqlx::Error>> + Send + 'e;

    /// The one row of an outbox backlog statement.
    fn fetch_backlog<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> impl Future<Output = Result<BacklogRow, sqlx::Error>> + Send + 'e;

    /// `(consumer, count, oldest, newest)` rows.
    fn fetch_stats<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
    ) -> impl Future<Output = Result<Vec<ConsumerStats>, sqlx::Error>> + Send + 'e;
}

type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>;

impl<DB> Driver for DB
where
    DB: sqlx::Database,
    DB::QueryResult: RowsAffected,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    Option<i64>: for<'q> sqlx::Encode<'q, DB>,
    for<'q> Option<&'q str>: sqlx::Encode<'q, DB>,
    i16: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    Vec<u8>: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    String: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn fetch_int<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<i64, sqlx::Error> {
        let r = bind(sqlx::query::<DB>(sql), params).fetch_one(conn).await?;
        sqlx::Row::try_get(&r, 0)
    }

    async fn fetch_recovery<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<Vec<RecoveryRow>, sqlx::Error> {
        use sqlx::Row;
        let rows = bind(sqlx::query::<DB>(sql), params).fetch_all(conn).await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get(0)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                    r.try_get(3)?,
                    r.try_get(4)?,
                    r.try_get(5)?,
                ))
            })
            .collect()
    }

    async fn execute<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<u64, sqlx::Error> {
        let r = bind(sqlx::query::<DB>(sql), params).execute(conn).await?;
        Ok(r.rows())
    }

    async fn execute_pool<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<u64, sqlx::Error> {
        let r = bind(sqlx::query::<DB>(sql), params).execute(pool).await?;
        Ok(r.rows())
    }

    async fn execute_simple<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
    ) -> Result<u64, sqlx::Error> {
        // A bare &str carries no arguments, so sqlx sends it unprepared (PostgreSQL's simple
        // query protocol, MySQL's COM_QUERY): several statements travel in one round trip.
        let r = sqlx::Executor::execute(conn, sql).await?;
        Ok(r.rows())
    }

    async fn fetch_bytes<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<Option<Vec<u8>>, sqlx::Error> {
        let row = bind(sqlx::query::<DB>(sql), params)
            .fetch_optional(conn)
            .await?;
        row.map(|r| sqlx::Row::try_get(&r, 0)).transpose()
    }

    async fn fetch_record<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<RecordRow, sqlx::Error> {
        let r = bind(sqlx::query::<DB>(sql), params).fetch_one(conn).await?;
        use sqlx::Row;
        Ok((
            r.try_get(0)?,
            r.try_get(1)?,
            r.try_get(2)?,
            r.try_get(3)?,
            r.try_get(4)?,
            r.try_get(5)?,
            r.try_get(6)?,
            r.try_get(7)?,
        ))
    }

    async fn fetch_candidates<'e>(
        conn: &'e mut Self::Connection,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<Vec<Candidate>, sqlx::Error> {
        use sqlx::Row;
        let rows = bind(sqlx::query::<DB>(sql), params).fetch_all(conn).await?;
        rows.iter()
            .map(|r| {
                Ok(Candidate {
                    seq: r.try_get(0)?,
                    message_id: r.try_get(1)?,
                    destination: r.try_get(2)?,
                    ordering_key: r.try_get(3)?,
                    payload: r.try_get(4)?,
                    headers: r.try_get(5)?,
                    attempts: r.try_get(6)?,
                    created_at: r.try_get(7)?,
                    earlier: r.try_get(8)?,
                })
            })
            .collect()
    }

    async fn fetch_backlog<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
        params: &'e [Param<'e>],
    ) -> Result<BacklogRow, sqlx::Error> {
        use sqlx::Row;
        let r = bind(sqlx::query::<DB>(sql), params).fetch_one(pool).await?;
        Ok((
            r.try_get(0)?,
            r.try_get(1)?,
            r.try_get(2)?,
            r.try_get(3)?,
            r.try_get(4)?,
        ))
    }

    async fn fetch_stats<'e>(
        pool: &'e sqlx::Pool<Self>,
        sql: &'e str,
    ) -> Result<Vec<ConsumerStats>, sqlx::Error> {
        let rows = sqlx::query::<DB>(sql).fetch_all(pool).await?;
        rows.iter().map(crate::common::stats_row).collect()
    }
}

fn bind<'q, DB>(mut q: Query<'q, DB>, params: &'q [Param<'q>]) -> Query<'q, DB>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB>,
    Option<&'q str>: sqlx::Encode<'q, DB>,
{
    for p in params {
        q = match *p {
            Param::Text(s) => q.bind(s),
            Param::Bytes(b) => q.bind(b),
            Param::Int(i) => q.bind(i),
            Param::OptInt(i) => q.bind(i),
            Param::OptText(t) => q.bind(t),
        };
    }
    q
}
