//! The transaction handlers receive, on every engine.
//!
//! One type for the three engines: a connection (from the pool, or one the store holds, see
//! [`SqlStore::hold_connections`](crate::SqlStore::hold_connections)) on which the engine's
//! `BEGIN` ran. Committing sends the engine's [`COMMIT`](crate::engine::Engine::COMMIT) as
//! one simple query; on PostgreSQL that is `SELECT 1; COMMIT`, so a transaction a swallowed
//! error aborted fails with 25P02 instead of rolling back while reporting success.
//!
//! It has no lifetime parameter: with one, a future that runs a handler is rejected by
//! `tokio::spawn` with "implementation of `AsyncFnOnce` is not general enough" (the compiler
//! erases that lifetime when it checks `Send`, and cannot prove the handler works for every
//! lifetime).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::pool::PoolConnection;

use crate::engine::Engine;
use crate::held::{Held, HeldConnections};

/// An open transaction on the business database, holding the claim until commit.
///
/// Handlers run their queries on `&mut **tx` (the connection), exactly as with a
/// `sqlx::Transaction`; to a helper taking `&mut SqliteConnection` (or `PgConnection`,
/// `MySqlConnection`) pass `tx` itself and let deref coercion do the rest.
pub struct Tx<E: Engine> {
    conn: Conn<E>,
    open: bool,
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
    /// sqlx's pool: a ping when acquired and another when returned.
    Pooled(PoolConnection<E>),
    /// The store's own held connections: no pings.
    Held(Held<E>),
}

impl<E: Engine> Tx<E> {
    pub(crate) async fn begin(pool: &sqlx::Pool<E>) -> Result<Self, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        if let Err(e) = E::execute_simple(&mut conn, E::BEGIN).await {
            // The connection's state is unknown; do not hand it back to the pool.
            conn.close_on_drop();
            return Err(e);
        }
        Ok(Self {
            conn: Conn::Pooled(conn),
            open: true,
        })
    }

    pub(crate) async fn begin_held(held: &Arc<HeldConnections<E>>) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: Conn::Held(held.begin().await?),
            open: true,
        })
    }

    /// Commits. On PostgreSQL, fails with SQLSTATE 25P02 if a statement of this transaction
    /// failed (nothing committed).
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        E::execute_simple(&mut self, E::COMMIT).await?;
        self.open = false;
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        E::execute_simple(&mut self, "ROLLBACK").await?;
        self.open = false;
        Ok(())
    }
}

impl<E: Engine> Drop for Tx<E> {
    fn drop(&mut self) {
        // Dropped while open (a cancelled future, a failed commit): closing the connection is
        // the one way to end the transaction without an await; the server (or SQLite, as the
        // connection closes) rolls it back.
        if self.open {
            match &mut self.conn {
                Conn::Pooled(c) => c.close_on_drop(),
                Conn::Held(h) => h.spoil(),
            }
        }
    }
}

impl<E: Engine> Deref for Tx<E> {
    type Target = E::Connection;

    fn deref(&self) -> &E::Connection {
        match &self.conn {
            Conn::Pooled(c) => c,
            Conn::Held(h) => h.conn(),
        }
    }
}

impl<E: Engine> DerefMut for Tx<E> {
    fn deref_mut(&mut self) -> &mut E::Connection {
        match &mut self.conn {
            Conn::Pooled(c) => c,
            Conn::Held(h) => h.conn_mut(),
        }
    }
}

impl<E: Engine> fmt::Debug for Tx<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("engine", &<E as sqlx::Database>::NAME)
            .field("open", &self.open)
            .finish()
    }
}
