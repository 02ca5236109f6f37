//! The transaction handlers receive: a connection on which `BEGIN` ran.
//!
//! It has no lifetime parameter (unlike `tokio_postgres::Transaction<'a>`): with one, a future
//! that runs a handler is rejected by `tokio::spawn` with "implementation of `AsyncFnOnce` is
//! not general enough" (the compiler erases that lifetime when it checks `Send`, and cannot
//! prove the handler works for every lifetime). So it owns its connection instead of borrowing
//! a client, and derefs to the `tokio_postgres::Client` handlers run their statements on.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Statement};

use crate::conn::{Lease, Limits, Writes};
use idem_dialect::postgres as sql;

/// Fails the transaction, with the server's own error, when a savepoint of it was dropped
/// without release or rollback ([`PgTx::commit`]).
const ABANDONED_SAVEPOINT: &str = "DO $$ BEGIN RAISE EXCEPTION 'idem: a savepoint \
     of this transaction was dropped without release() or rollback(), so nothing was \
     committed'; END $$";

/// An open transaction on the business database, holding the claim until commit.
///
/// Handlers run tokio-postgres statements on it directly — `tx.execute(..)`, `tx.query(..)`,
/// `tx.batch_execute(..)` — through its [`Deref`] to [`Client`]; to a helper taking
/// `&Client` or `&impl GenericClient` pass `&**tx`. [`prepare_cached`](Self::prepare_cached)
/// prepares a statement once per connection, so a handler's own statements cost one round
/// trip each, as the claim does.
///
/// # Nesting
///
/// tokio-postgres nests with `Client::transaction(&mut self)` / `Transaction::transaction`,
/// which need `&mut Client`; a `PgTx` derefs to `&Client` only, so that pattern cannot be
/// written against it (it does not compile), and nothing a handler can call on it commits
/// the claim early — short of sending `COMMIT` or `BEGIN` itself as raw SQL, which it must
/// not. A nested unit of work is a savepoint: [`savepoint`](Self::savepoint) opens one, whose
/// [`release`](PgSavepoint::release) commits nothing before this transaction does and whose
/// [`rollback`](PgSavepoint::rollback) undoes only what ran since. A savepoint dropped
/// without either (its future cancelled, an early `?` whose error the handler then
/// swallowed) cannot be rolled back without an `await`, so this transaction's commit then
/// fails and nothing is committed.
///
/// Dropped while open (a cancelled future, a failed commit), its connection is never reused
/// inside the transaction: a pooled connection is closed (the server rolls back), a plain
/// client rolls back before its next use.
pub struct PgTx {
    lease: Option<Lease>,
    open: bool,
    /// The store's connection limits (read-only count).
    limits: Arc<Limits>,
    /// What idem's own writes (the claim, the commit) said about the server.
    writes: Writes,
    /// Savepoints open now (names are numbered by depth).
    savepoints: u32,
    /// A savepoint was dropped without release or rollback: the commit must fail.
    abandoned: bool,
    /// Close the connection instead of giving it back (a `BEGIN` that hung).
    discard: bool,
}

impl PgTx {
    /// A transaction on `lease`, whose `BEGIN` has been sent: until it has succeeded, the
    /// transaction counts as open, so a failure abandons the connection.
    pub(crate) fn begun(lease: Lease, limits: Arc<Limits>) -> Self {
        Self {
            lease: Some(lease),
            open: true,
            limits,
            writes: Writes::Unknown,
            savepoints: 0,
            abandoned: false,
            discard: false,
        }
    }

    /// Its connection is closed when it is dropped (a `BEGIN` that did not answer).
    pub(crate) fn discard(&mut self) {
        self.discard = true;
    }

    /// Notes what one of idem's writes in this transaction said about the server.
    pub(crate) fn saw<T>(&mut self, result: &Result<T, tokio_postgres::Error>) {
        match result {
            Ok(_) => self.writes = Writes::Taken,
            Err(e) if e.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION) => {
                self.writes = Writes::ReadOnly;
            }
            Err(_) => {}
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
    /// have rolled back and reported success; fails too, committing nothing, if a
    /// [savepoint](Self::savepoint) was dropped without release or rollback.
    pub async fn commit(mut self) -> Result<(), tokio_postgres::Error> {
        if self.abandoned || self.savepoints > 0 {
            // The server's own error, so that callers see one error type: the transaction
            // aborts, and dropping it (open) rolls everything back.
            self.batch_execute(ABANDONED_SAVEPOINT).await?;
        }
        let committed = self.batch_execute(sql::COMMIT).await;
        self.saw(&committed);
        committed?;
        self.open = false;
        Ok(())
    }

    /// Opens a savepoint: a nested unit of work inside this transaction (see [Nesting]).
    /// Run its statements on the savepoint (it derefs to this transaction, and so to the
    /// `Client`), then [`release`](PgSavepoint::release) or
    /// [`rollback`](PgSavepoint::rollback) it; savepoints nest.
    ///
    /// [Nesting]: Self#nesting
    pub async fn savepoint(&mut self) -> Result<PgSavepoint<'_>, tokio_postgres::Error> {
        let name = format!("idem_savepoint_{}", self.savepoints + 1);
        self.batch_execute(&format!("SAVEPOINT {name}")).await?;
        self.savepoints += 1;
        Ok(PgSavepoint {
            tx: self,
            name,
            open: true,
        })
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
        let Some(lease) = self.lease.take() else {
            return;
        };
        // Refused as read-only too often: a new connection may reach the new primary (a
        // plain client cannot be reopened, so it is kept).
        let retire = self.limits.settle(self.writes) && lease.replaceable();
        if self.discard || retire {
            lease.discard();
        } else if self.open {
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
        f.debug_struct("PgTx")
            .field("open", &self.open)
            .field("savepoints", &self.savepoints)
            .finish()
    }
}

/// A savepoint inside a [`PgTx`] (see [`PgTx::savepoint`]): statements run on it (it derefs
/// to the transaction) belong to it until it is released or rolled back.
pub struct PgSavepoint<'a> {
    tx: &'a mut PgTx,
    name: String,
    open: bool,
}

impl PgSavepoint<'_> {
    /// Keeps what ran since the savepoint, as part of the transaction: nothing is committed
    /// before the transaction's own commit.
    pub async fn release(mut self) -> Result<(), tokio_postgres::Error> {
        let sql = format!("RELEASE SAVEPOINT {}", self.name);
        self.tx.batch_execute(&sql).await?;
        self.close();
        Ok(())
    }

    /// Undoes what ran since the savepoint; the transaction goes on (even after a failed
    /// statement inside the savepoint).
    pub async fn rollback(mut self) -> Result<(), tokio_postgres::Error> {
        let sql = format!(
            "ROLLBACK TO SAVEPOINT {0}; RELEASE SAVEPOINT {0}",
            self.name
        );
        self.tx.batch_execute(&sql).await?;
        self.close();
        Ok(())
    }

    fn close(&mut self) {
        self.open = false;
        self.tx.savepoints -= 1;
    }
}

impl Drop for PgSavepoint<'_> {
    fn drop(&mut self) {
        if self.open {
            // Rolling back needs an await; failing the commit does not.
            self.tx.abandoned = true;
            self.close();
        }
    }
}

impl Deref for PgSavepoint<'_> {
    type Target = PgTx;

    fn deref(&self) -> &PgTx {
        self.tx
    }
}

impl DerefMut for PgSavepoint<'_> {
    fn deref_mut(&mut self) -> &mut PgTx {
        self.tx
    }
}

impl fmt::Debug for PgSavepoint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSavepoint")
            .field("name", &self.name)
            .field("open", &self.open)
            .finish()
    }
}
