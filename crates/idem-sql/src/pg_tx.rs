//! The PostgreSQL transaction handlers receive.
//!
//! PostgreSQL turns a transaction in which any statement failed into an aborted one, and a
//! later `COMMIT` then rolls back *and reports success*. A handler that swallows a database
//! error (say, it catches a unique violation itself) would make `process` report `Processed`
//! while neither the effect nor the claim committed — and the caller would ack a lost message.
//! So the commit here is `SELECT 1; COMMIT` in one simple-query round trip: in an aborted
//! transaction the `SELECT` fails with 25P02 and the `COMMIT` never runs.

use std::fmt;
use std::ops::{Deref, DerefMut};

use std::sync::Arc;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Executor, Postgres};

use crate::held::{Held, HeldConnections};

/// An open PostgreSQL transaction holding the claim until commit. Handlers run their queries
/// on `&mut **tx` (the connection).
pub struct PgTx {
    conn: Conn,
    open: bool,
}

/// Where the transaction's connection comes from.
enum Conn {
    /// sqlx's pool: a ping when acquired and another when returned.
    Pooled(PoolConnection<Postgres>),
    /// The store's own held connections (`PostgresStore::hold_connections`): no pings.
    Held(Held),
}

impl PgTx {
    pub(crate) async fn begin(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        conn.execute("BEGIN").await?;
        Ok(Self {
            conn: Conn::Pooled(conn),
            open: true,
        })
    }

    pub(crate) async fn begin_held(held: &Arc<HeldConnections>) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: Conn::Held(held.begin().await?),
            open: true,
        })
    }

    /// Commits; fails with SQLSTATE 25P02 if a statement of this transaction failed.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        // No bind arguments: sqlx sends this as one simple query, both statements in one flight.
        (*self).execute("SELECT 1; COMMIT").await?;
        self.open = false;
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        (*self).execute("ROLLBACK").await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        // Dropped while open (a cancelled future, a failed commit): closing the connection is
        // the one way to end the transaction without an await; the server rolls it back.
        if self.open {
            match &mut self.conn {
                Conn::Pooled(c) => c.close_on_drop(),
                Conn::Held(h) => h.spoil(),
            }
        }
    }
}

impl Deref for PgTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Conn::Pooled(c) => c,
            Conn::Held(h) => h.conn(),
        }
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            Conn::Pooled(c) => c,
            Conn::Held(h) => h.conn_mut(),
        }
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx").field("open", &self.open).finish()
    }
}
