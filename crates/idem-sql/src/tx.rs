//! The transaction handlers receive.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// An open transaction on the business database, holding the claim until commit.
///
/// Handlers run their queries on `&mut **tx` (the connection), exactly as with a
/// `sqlx::Transaction`; to a helper taking `&mut SqliteConnection` (or `PgConnection`,
/// `MySqlConnection`) pass `tx` itself and let deref coercion do the rest. It wraps `sqlx::Transaction<'static, DB>` in a type without a lifetime
/// parameter: with one, a future that runs a handler is rejected by `tokio::spawn` with
/// "implementation of `AsyncFnOnce` is not general enough" (the compiler erases that lifetime
/// when it checks `Send`, and cannot prove the handler works for every lifetime).
pub struct Tx<DB: sqlx::Database>(sqlx::Transaction<'static, DB>);

impl<DB: sqlx::Database> Tx<DB> {
    pub(crate) fn new(tx: sqlx::Transaction<'static, DB>) -> Self {
        Self(tx)
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.0.commit().await
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.0.rollback().await
    }

    /// The underlying sqlx transaction.
    pub fn as_sqlx(&mut self) -> &mut sqlx::Transaction<'static, DB> {
        &mut self.0
    }

    /// Unwraps the sqlx transaction.
    pub fn into_sqlx(self) -> sqlx::Transaction<'static, DB> {
        self.0
    }
}

impl<DB: sqlx::Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.0
    }
}

impl<DB: sqlx::Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.0
    }
}

impl<DB: sqlx::Database> fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}
