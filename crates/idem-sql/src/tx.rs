//! The transaction handlers receive, on every engine.
//!
//! One type for the three engines: a connection (from the pool, or one the store holds, see
//! [`SqlStore::hold_connections`](crate::SqlStore::hold_connections)) on which the engine's
//! `BEGIN` ran.
//!
//! # sqlx counts the transaction
//!
//! sqlx keeps a transaction depth per connection, and a `begin()` on a connection at depth 0
//! sends `BEGIN` where at depth 1 or more it sends a `SAVEPOINT`. So idem begins and ends its
//! transactions through sqlx's transaction manager (`<E as sqlx::Database>::TransactionManager`),
//! never as raw SQL alone: a handler that calls `(&mut **tx).begin()` — the usual `Acquire`
//! helper pattern — gets a savepoint, as inside a `sqlx::Transaction`, and the helper's
//! `commit()` releases it. (A raw `BEGIN` left the depth at 0: the helper's `BEGIN` then
//! committed the claim on MySQL, its `commit()` committed it on PostgreSQL, and everything
//! after ran in autocommit.)
//!
//! `BEGIN` (SQLite's `BEGIN IMMEDIATE`; for an idempotent request's execution the engine's
//! `REQUEST_BEGIN`, SQLite's `BEGIN DEFERRED`) goes through the manager's `begin` at depth 0,
//! which takes a custom statement there. SQLite and MySQL commit and roll back through the manager.
//! PostgreSQL commits with its [checked commit](crate::engine::Engine::CHECKED_COMMIT),
//! `SELECT 1; COMMIT`, one simple query that fails with 25P02 in a transaction a swallowed
//! error aborted, where the manager's bare `COMMIT` would roll back and report success. Raw
//! SQL leaves sqlx's depth at 1, and the only ways to bring it to 0 without a round trip are
//! the manager's `start_rollback`, which queues a `ROLLBACK` for the connection's next
//! message. How the depth is brought back depends on where the connection goes:
//!
//! - **to sqlx's pool** (which the application shares: its own `pool.begin()` must find depth
//!   0): `SELECT 1; COMMIT; BEGIN`, then `start_rollback`. The queued `ROLLBACK` ends the
//!   empty transaction and travels with the pool's return ping — no round trip of its own,
//!   and no "no transaction in progress" warning, since one is open. The connection is never
//!   idle inside it: the ping is sent as it is returned.
//! - **to the store's held connections**, which nothing but idem's transactions ever use:
//!   `SELECT 1; COMMIT` and the depth stays at 1 — a held PostgreSQL connection rests at
//!   depth 1, outside any transaction on the server, and its next `BEGIN` is sent raw. The
//!   pooled form would leave it *idle in transaction* between transactions: a connection
//!   pinned by a pgbouncer in transaction mode, killed by `idle_in_transaction_session_timeout`
//!   and reported by every monitoring query.
//!
//! Either way a transaction costs the round trips it did before: `BEGIN`, the statements, one
//! for the commit.
//!
//! It has no lifetime parameter: with one, a future that runs a handler is rejected by
//! `tokio::spawn` with "implementation of `AsyncFnOnce` is not general enough" (the compiler
//! erases that lifetime when it checks `Send`, and cannot prove the handler works for every
//! lifetime).

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use sqlx::TransactionManager;
use sqlx::pool::PoolConnection;

use crate::engine::Engine;
use crate::held::{Held, HeldConnections, PoolStrikes};

/// An open transaction on the business database, holding the claim until commit.
///
/// Handlers run their queries on `&mut **tx` (the connection), exactly as with a
/// `sqlx::Transaction`; to a helper taking `&mut SqliteConnection` (or `PgConnection`,
/// `MySqlConnection`) pass `tx` itself and let deref coercion do the rest.
///
/// Nesting works as in a `sqlx::Transaction`: `(&mut **tx).begin()` (or `Acquire::begin` on
/// `&mut **tx`) opens a **savepoint**, whose `commit()` releases it and whose `rollback()` —
/// or drop — undoes only what ran since; nothing is committed before this transaction's own
/// commit, and a handler error still rolls everything back, claim included. A nested
/// transaction must end before the handler returns: one left open (leaked) fails the commit.
pub struct Tx<E: Engine> {
    conn: Conn<E>,
    open: bool,
    /// What idem's own writes in this transaction (the claim, the commit) said about the
    /// server, for [`crate::SqlStore::read_only_limit`].
    writes: Writes,
}

/// [`Tx`] on SQLite.
#[cfg(feature = "sqlite")]
pub type SqliteTx = Tx<sqlx::Sqlite>;
/// [`Tx`] on PostgreSQL.
#[cfg(feature = "postgres")]
pub type PostgresTx = Tx<sqlx::Postgres>;
/// [`Tx`] on MySQL / MariaDB.
#[cfg(feature = "mysql")]
pub type MySqlTx = Tx<sqlx::MySql>;

/// Where the transaction's connection comes from.
enum Conn<E: Engine> {
    /// sqlx's pool: a ping when acquired and another when returned; the store's read-only
    /// count, if this transaction is the store's (not maintenance).
    Pooled(PoolConnection<E>, Option<Arc<PoolStrikes>>),
    /// The store's own held connections: no pings.
    Held(Held<E>),
}

/// A connection on loan for statements outside any transaction (an idempotent request's
/// record read), from the held connections (no pings) or the pool. The transaction that takes
/// the record then begins on the same connection ([`Tx::begin_lent`]): one acquire — on the
/// pool, one pair of pings — for the read and the transaction, not two.
pub(crate) struct Lent<E: Engine>(Conn<E>);

impl<E: Engine> Lent<E> {
    pub(crate) fn pooled(conn: PoolConnection<E>, strikes: Arc<PoolStrikes>) -> Self {
        Self(Conn::Pooled(conn, Some(strikes)))
    }

    /// A held connection its first statement already succeeded on ([`Held::ready`]).
    pub(crate) fn held(held: Held<E>) -> Self {
        Self(Conn::Held(held))
    }
}

impl<E: Engine> Deref for Lent<E> {
    type Target = E::Connection;

    fn deref(&self) -> &E::Connection {
        match &self.0 {
            Conn::Pooled(c, _) => c,
            Conn::Held(h) => h.conn(),
        }
    }
}

impl<E: Engine> DerefMut for Lent<E> {
    fn deref_mut(&mut self) -> &mut E::Connection {
        match &mut self.0 {
            Conn::Pooled(c, _) => c,
            Conn::Held(h) => h.conn_mut(),
        }
    }
}

/// What a transaction's writes said about the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writes {
    /// No write of idem's ran, or it failed for another reason.
    Unknown,
    /// A write succeeded: the server takes writes on this connection.
    Taken,
    /// A write was refused as read-only.
    ReadOnly,
}

impl<E: Engine> Tx<E> {
    /// A transaction on sqlx's pool, without a `BEGIN` timeout or read-only count (schema
    /// maintenance).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) async fn begin(pool: &sqlx::Pool<E>) -> Result<Self, sqlx::Error> {
        Self::begin_pooled(pool, E::BEGIN, None, None).await
    }

    /// A transaction on sqlx's pool, begun with `begin` (the engine's `BEGIN` or
    /// `REQUEST_BEGIN`).
    pub(crate) async fn begin_pooled(
        pool: &sqlx::Pool<E>,
        begin: &'static str,
        timeout: Option<Duration>,
        strikes: Option<Arc<PoolStrikes>>,
    ) -> Result<Self, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        if let Err(e) = bounded(timeout, "BEGIN", begin_on::<E>(&mut conn, false, begin)).await {
            // The connection's state is unknown; do not hand it back to the pool.
            conn.close_on_drop();
            return Err(e);
        }
        Ok(Self {
            conn: Conn::Pooled(conn, strikes),
            open: true,
            writes: Writes::Unknown,
        })
    }

    /// A transaction begun with `begin` on the connection a statement outside any
    /// transaction was just run on ([`Lent`]). On an error the connection is closed.
    pub(crate) async fn begin_lent(
        lent: Lent<E>,
        begin: &'static str,
        timeout: Option<Duration>,
    ) -> Result<Self, sqlx::Error> {
        let mut conn = lent.0;
        let held = matches!(conn, Conn::Held(_));
        let on: &mut E::Connection = match &mut conn {
            Conn::Pooled(c, _) => c,
            Conn::Held(h) => h.conn_mut(),
        };
        if let Err(e) = bounded(timeout, "BEGIN", begin_on::<E>(on, held, begin)).await {
            match &mut conn {
                Conn::Pooled(c, _) => c.close_on_drop(),
                Conn::Held(h) => h.spoil(),
            }
            return Err(e);
        }
        Ok(Self {
            conn,
            open: true,
            writes: Writes::Unknown,
        })
    }

    pub(crate) async fn begin_held(
        held: &Arc<HeldConnections<E>>,
        begin: &'static str,
    ) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: Conn::Held(held.begin(begin).await?),
            open: true,
            writes: Writes::Unknown,
        })
    }

    fn held(&self) -> bool {
        matches!(self.conn, Conn::Held(_))
    }

    /// Commits. On PostgreSQL, fails with SQLSTATE 25P02 if a statement of this transaction
    /// failed (nothing committed). Fails, committing nothing, while a nested transaction the
    /// handler began is still open.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        let held = self.held();
        let conn: &mut E::Connection = &mut self;
        let depth = E::TransactionManager::get_transaction_depth(conn);
        if depth != 1 {
            // Left open, the connection is closed on drop: the server rolls back.
            return Err(sqlx::Error::InvalidArgument(format!(
                "nothing was committed: {} nested transaction(s) the handler began are still \
                 open (leaked?); a nested transaction must commit or roll back before the \
                 handler returns",
                depth.saturating_sub(1)
            )));
        }
        let done = match E::CHECKED_COMMIT {
            None => E::TransactionManager::commit(conn).await,
            // A held connection rests at depth 1 (see the module docs).
            Some(c) if held => E::execute_simple(conn, c.alone).await.map(drop),
            Some(c) => E::execute_simple(conn, c.then_begin).await.map(|_| {
                // Depth 0 for the pool; the ROLLBACK of the empty transaction rides with the
                // pool's return ping.
                E::TransactionManager::start_rollback(conn);
            }),
        };
        self.saw_sqlx(&done);
        done?;
        self.open = false;
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        let held = self.held();
        let conn: &mut E::Connection = &mut self;
        if E::TransactionManager::get_transaction_depth(conn) != 1 {
            // A nested transaction was leaked: sqlx would only roll back to its savepoint.
            // Left open, the connection is closed on drop, which rolls everything back.
            return Ok(());
        }
        match E::CHECKED_COMMIT {
            Some(_) if held => E::execute_simple(conn, "ROLLBACK").await.map(drop)?,
            _ => E::TransactionManager::rollback(conn).await?,
        }
        self.open = false;
        Ok(())
    }

    /// Rolls this transaction back and begins another with `begin` on the same connection,
    /// for a transaction known to hold no write of the handler's (SQLite's deferred request
    /// transaction that never took the write lock: see `sqlite.rs`). On an error the
    /// connection is left outside any transaction and is closed when this is dropped.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) async fn begin_again(&mut self, begin: &'static str) -> Result<(), sqlx::Error> {
        let held = self.held();
        let conn: &mut E::Connection = self;
        if E::TransactionManager::get_transaction_depth(conn) != 1 {
            return Err(sqlx::Error::InvalidArgument(
                "a transaction with a nested transaction still open cannot begin again".into(),
            ));
        }
        E::TransactionManager::rollback(conn).await?;
        begin_on::<E>(conn, held, begin).await
    }

    /// Notes what one of idem's writes in this transaction said about the server.
    pub(crate) fn saw<T>(&mut self, result: &Result<T, idem_core::Error>) {
        match result {
            Ok(_) => self.writes = Writes::Taken,
            Err(e) if read_only_error::<E>(e) => self.writes = Writes::ReadOnly,
            Err(_) => {}
        }
    }

    fn saw_sqlx<T>(&mut self, result: &Result<T, sqlx::Error>) {
        match result {
            Ok(_) => self.writes = Writes::Taken,
            Err(sqlx::Error::Database(db)) if E::read_only(db.as_ref()) => {
                self.writes = Writes::ReadOnly;
            }
            Err(_) => {}
        }
    }
}

/// Whether `error` (or an error it wraps) is the database refusing a write as read-only.
fn read_only_error<E: Engine>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return E::read_only(db.as_ref());
        }
        cause = e.source();
    }
    false
}

/// Begins idem's transaction on `conn` with `begin` (the engine's `BEGIN` or `REQUEST_BEGIN`),
/// through sqlx's transaction manager so that sqlx counts it (see the module docs). A held
/// connection on an engine with a checked commit rests at depth 1, outside any transaction on
/// the server; its `BEGIN` is then sent raw.
pub(crate) async fn begin_on<E: Engine>(
    conn: &mut E::Connection,
    held: bool,
    begin: &'static str,
) -> Result<(), sqlx::Error> {
    let rests_at = usize::from(held && E::CHECKED_COMMIT.is_some());
    match E::TransactionManager::get_transaction_depth(conn) {
        0 => E::TransactionManager::begin(conn, Some(Cow::Borrowed(begin))).await,
        1 if rests_at == 1 => E::execute_simple(conn, begin).await.map(drop),
        depth => Err(sqlx::Error::InvalidArgument(format!(
            "a connection at transaction depth {depth} cannot begin idem's transaction"
        ))),
    }
}

/// `begin` within `limit`: past it, an I/O timeout (unavailable), and the future — with its
/// half-sent `BEGIN` — is dropped; the caller drops the connection.
pub(crate) async fn bounded<T>(
    limit: Option<Duration>,
    what: &str,
    first: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    let Some(limit) = limit else {
        return first.await;
    };
    match tokio::time::timeout(limit, first).await {
        Ok(result) => result,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "no answer to {what} within {limit:?}; the connection was closed (a peer that \
                 vanished, or a network path that stopped forwarding)"
            ),
        ))),
    }
}

impl<E: Engine> Drop for Tx<E> {
    fn drop(&mut self) {
        // Dropped while open (a cancelled future, a failed commit): closing the connection is
        // the one way to end the transaction without an await; the server (or SQLite, as the
        // connection closes) rolls it back. A connection refused as read-only too often is
        // closed as well: a new one may reach the new primary.
        match &mut self.conn {
            Conn::Pooled(c, strikes) => {
                let retire = strikes.as_ref().is_some_and(|s| s.settle(self.writes));
                if self.open || retire {
                    c.close_on_drop();
                }
            }
            Conn::Held(h) => {
                h.settle(self.writes);
                if self.open {
                    h.spoil();
                }
            }
        }
    }
}

impl<E: Engine> Deref for Tx<E> {
    type Target = E::Connection;

    fn deref(&self) -> &E::Connection {
        match &self.conn {
            Conn::Pooled(c, _) => c,
            Conn::Held(h) => h.conn(),
        }
    }
}

impl<E: Engine> DerefMut for Tx<E> {
    fn deref_mut(&mut self) -> &mut E::Connection {
        match &mut self.conn {
            Conn::Pooled(c, _) => c,
            Conn::Held(h) => h.conn_mut(),
        }
    }
}

impl<E: Engine> fmt::Debug for Tx<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("engine", &<E as sqlx::Database>::NAME)
            .field("open", &self.open)
            .field("held", &self.held())
            .finish()
    }
}
