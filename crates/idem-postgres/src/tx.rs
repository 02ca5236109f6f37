//! The transaction handlers receive: a connection on which `BEGIN` ran.
//!
//! It has no lifetime parameter (unlike `tokio_postgres::Transaction<'a>`): with one, a future
//! that runs a handler is rejected by `tokio::spawn` with "implementation of `AsyncFnOnce` is
//! not general enough" (the compiler erases that lifetime when it checks `Send`, and cannot
//! prove the handler works for every lifetime). So it owns its connection instead of borrowing
//! a client, and derefs to the `tokio_postgres::Client` handlers run their statements on.

use std::fmt;
use std::ops::Deref;

use tokio_postgres::{Client, Statement};

use crate::conn::Lease;
use crate::sql;

/// An open transaction on the business database, holding the claim until commit.
///
/// Handlers run tokio-postgres statements on it directly — `tx.execute(..)`, `tx.query(..)`,
/// `tx.batch_execute(..)` — through its [`Deref`] to [`Client`]; to a helper taking
/// `&Client` or `&impl GenericClient` pass `&**tx`. [`prepare_cached`](Self::prepare_cached)
/// prepares a statement once per connection, so a handler's own statements cost one round
/// trip each, as the claim does. Nested transactions are savepoints
/// (`tx.batch_execute("SAVEPOINT s")`); `Client::transaction` needs `&mut Client`, which a
/// transaction does not hand out.
///
/// Dropped while open (a cancelled future, a failed commit), its connection is never reused
/// inside the transaction: a pooled connection is closed (the server rolls back), a plain
/// client rolls back before its next use.
pub struct PgTx {
    lease: Option<Lease>,
    open: bool,
}

impl PgTx {
    /// A transaction on `lease`, whose `BEGIN` has been sent: until it has succeeded, the
    /// transaction counts as open, so a failure abandons the connection.
    pub(crate) fn begun(lease: Lease) -> Self {
        Self {
            lease: Some(lease),
            open: true,
        }
    }

    fn lease(&self) -> &Lease {
        self.lease
            .as_ref()
            .expect("a transaction holds its connection until it is dropped")
    }

    /// `sql` prepared on this transaction's connection: a round trip the first time on each
    /// connection, none after (deadpool's statement cache on a pool, the store's own on plain
    /// clients).
    pub async fn prepare_cached(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        self.lease().prepare(sql).await
    }

    /// Commits with `SELECT 1; COMMIT`, one simple query. Fails with SQLSTATE 25P02 if a
    /// statement of this transaction failed (nothing committed), where a bare `COMMIT` would
    /// have rolled back and reported success.
    pub async fn commit(mut self) -> Result<(), tokio_postgres::Error> {
        self.batch_execute(sql::COMMIT).await?;
        self.open = false;
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(mut self) -> Result<(), tokio_postgres::Error> {
        self.batch_execute(sql::ROLLBACK).await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take()
            && self.open
        {
            lease.abandon();
        }
    }
}

impl Deref for PgTx {
    type Target = Client;

    fn deref(&self) -> &Client {
        self.lease().client()
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx").field("open", &self.open).finish()
    }
}
