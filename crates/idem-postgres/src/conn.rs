//! Where the store's connections come from, and their prepared statements.
//!
//! Two sources: a deadpool-postgres pool (its `prepare_cached` keeps each connection's
//! statements), or plain `tokio_postgres::Client`s handed to the store, which keeps them on a
//! stack with a statement cache per client. Either way a connection is lent out as a
//! [`Lease`] for one transaction or one statement, and prepared statements are keyed by their
//! text on the connection they were prepared on.
//!
//! A lease whose transaction may still be open when it is given back is never reused as it
//! is (see [`Lease::abandon`]): a pooled connection is taken out of the pool and closed (the
//! server rolls back), a plain client — which the store cannot reopen — gets a `ROLLBACK`
//! before its next use.
//!
//! A pooled connection is not kept for ever either ([`Limits`]): deadpool has no lifetime or
//! idle timeout of its own, so before each lease the store retires the pool's idle
//! connections past either; a `BEGIN` that does not answer in time closes its connection (a
//! plain client too: it is dropped for good); and once transactions are refused as read-only
//! several times in a row, each pooled connection refused so is closed instead of returned,
//! so that the next one — after a failover behind a DNS name — reaches the new primary.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, Statement};

use crate::errors::{SYSTEM, store_error};
use idem_dialect::postgres as sql;

/// How long a lease waits for a plain client to come free.
pub(crate) const CLIENT_WAIT: Duration = Duration::from_secs(30);

/// When the store gives a connection up (see `PgStore::max_lifetime` and the options after
/// it).
#[derive(Debug)]
pub(crate) struct Limits {
    /// A pooled connection older than this is closed instead of used.
    pub(crate) max_lifetime: Option<Duration>,
    /// A pooled connection not handed out for this long is closed instead of used.
    pub(crate) idle_timeout: Option<Duration>,
    /// A `BEGIN` that has not answered by then fails as unavailable, and its connection is
    /// closed.
    pub(crate) begin_timeout: Option<Duration>,
    /// After this many transactions in a row refused as read-only, each pooled connection
    /// refused so is closed; 0: never.
    pub(crate) read_only_limit: u32,
    /// Transactions refused as read-only in a row (the store's: the pool does not tell its
    /// connections apart).
    strikes: AtomicU32,
}

/// What a transaction's writes said about the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writes {
    /// No write of idem's ran, or it failed for another reason.
    Unknown,
    /// A write succeeded: the server takes writes on this connection.
    Taken,
    /// A write was refused as read-only (SQLSTATE 25006).
    ReadOnly,
}

impl Limits {
    /// sqlx's pool defaults (deadpool has none): 30 minutes, 10 minutes; a `BEGIN` waits as
    /// long as a lease may (`wait`); two read-only answers in a row.
    pub(crate) fn new(wait: Duration) -> Self {
        Self {
            max_lifetime: Some(Duration::from_secs(30 * 60)),
            idle_timeout: Some(Duration::from_secs(10 * 60)),
            begin_timeout: Some(wait),
            read_only_limit: 2,
            strikes: AtomicU32::new(0),
        }
    }

    /// The same limits, with a fresh count (for the store's builder methods).
    pub(crate) fn with(&self, change: impl FnOnce(&mut Self)) -> Self {
        let mut limits = Self {
            strikes: AtomicU32::new(0),
            ..*self
        };
        change(&mut limits);
        limits
    }

    /// Counts what a transaction's writes said; whether its connection must be closed.
    pub(crate) fn settle(&self, writes: Writes) -> bool {
        match writes {
            Writes::Unknown => false,
            Writes::Taken => {
                self.strikes.store(0, Ordering::Relaxed);
                false
            }
            Writes::ReadOnly => {
                let strikes = self
                    .strikes
                    .fetch_add(1, Ordering::Relaxed)
                    .saturating_add(1);
                self.read_only_limit > 0 && strikes >= self.read_only_limit
            }
        }
    }

    /// Closes the pool's idle connections past their lifetime or idle timeout. deadpool
    /// counts idleness from when a connection was last handed out (its `last_used`), which
    /// for a consumer's short transactions is when it was last given back, give or take one.
    #[cfg(feature = "deadpool")]
    fn retire_worn(&self, pool: &deadpool_postgres::Pool) {
        if self.max_lifetime.is_none() && self.idle_timeout.is_none() {
            return;
        }
        // Dropping the retired clients ends their connections (the server sees a Terminate).
        drop(pool.retain(|_, metrics| {
            !(self.max_lifetime.is_some_and(|l| metrics.age() >= l)
                || self.idle_timeout.is_some_and(|t| metrics.last_used() >= t))
        }));
    }
}

/// The store's connections.
#[derive(Clone)]
pub(crate) enum Source {
    /// A deadpool-postgres pool.
    #[cfg(feature = "deadpool")]
    Pool(deadpool_postgres::Pool),
    /// Plain clients the store was given.
    Clients(Arc<Clients>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => f.debug_tuple("Pool").field(&pool.status()).finish(),
            Source::Clients(clients) => f.debug_tuple("Clients").field(clients).finish(),
        }
    }
}

impl Source {
    /// A connection, outside any transaction; on a pool, first retires the idle connections
    /// past `limits`.
    pub(crate) async fn get(&self, limits: &Limits) -> Result<Lease, Error> {
        match self {
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => {
                limits.retire_worn(pool);
                pool.get()
                    .await
                    .map(Lease::Pooled)
                    .map_err(|e| crate::errors::pool_error("getting a connection", e))
            }
            Source::Clients(clients) => clients.get().await.map(Lease::Plain),
        }
    }
}

/// One connection, lent to one transaction or statement.
pub(crate) enum Lease {
    /// From the pool: goes back to it when dropped.
    #[cfg(feature = "deadpool")]
    Pooled(deadpool_postgres::Object),
    /// One of the store's plain clients: goes back on its stack when dropped.
    Plain(Plain),
}

impl Lease {
    /// The client.
    pub(crate) fn client(&self) -> &Client {
        match self {
            #[cfg(feature = "deadpool")]
            Lease::Pooled(object) => object,
            Lease::Plain(plain) => &plain.conn().client,
        }
    }

    /// `sql` prepared on this connection: a round trip the first time, none after.
    pub(crate) async fn prepare(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        match self {
            #[cfg(feature = "deadpool")]
            Lease::Pooled(object) => object.prepare_cached(sql).await,
            Lease::Plain(plain) => plain.conn().prepare(sql).await,
        }
    }

    /// Whether the store can replace this connection (a pooled one) rather than only lose it.
    pub(crate) fn replaceable(&self) -> bool {
        match self {
            #[cfg(feature = "deadpool")]
            Lease::Pooled(_) => true,
            Lease::Plain(_) => false,
        }
    }

    /// Closes the connection for good: it hung, or talks to a server it should not. A pooled
    /// one is taken out of the pool (which opens another when needed); a plain client is
    /// dropped and the store works on with the others.
    pub(crate) fn discard(self) {
        match self {
            #[cfg(feature = "deadpool")]
            Lease::Pooled(object) => drop(deadpool_postgres::Object::take(object)),
            Lease::Plain(mut plain) => {
                if let (Some(conn), Some(permit)) = (plain.conn.take(), plain.permit.take()) {
                    drop(conn);
                    plain.home.lose(permit);
                }
            }
        }
    }

    /// Gives the connection up while a transaction on it may still be open (dropped
    /// mid-transaction, a failed `COMMIT`, a failed `BEGIN`): it must never serve another
    /// transaction as it is, or that one's statements would join this one.
    pub(crate) fn abandon(self) {
        match self {
            // Out of the pool and closed: the server rolls back, the pool opens a new one.
            #[cfg(feature = "deadpool")]
            Lease::Pooled(object) => drop(deadpool_postgres::Object::take(object)),
            // The store cannot reopen a client it was given: roll back before the next use.
            Lease::Plain(mut plain) => {
                if let Some(conn) = plain.conn.as_mut() {
                    conn.needs_rollback = true;
                }
            }
        }
    }
}

/// Plain clients the store was given, each with its own statement cache, lent out one at a
/// time. A client found closed is dropped for good (the store has no configuration to reopen
/// it with), and the set shrinks.
pub(crate) struct Clients {
    idle: Mutex<Vec<Conn>>,
    /// One permit per live client, idle or lent.
    permits: Arc<Semaphore>,
    alive: AtomicUsize,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients")
            .field("alive", &self.alive.load(Ordering::Relaxed))
            .field("free", &self.permits.available_permits())
            .finish()
    }
}

/// A plain client and the statements prepared on it.
pub(crate) struct Conn {
    client: Client,
    statements: Mutex<HashMap<Box<str>, Statement>>,
    /// A transaction may still be open on it: `ROLLBACK` before it is used again.
    needs_rollback: bool,
}

impl Conn {
    async fn prepare(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.cache().get(sql) {
            return Ok(s.clone());
        }
        let statement = self.client.prepare(sql).await?;
        self.cache().insert(sql.into(), statement.clone());
        Ok(statement)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Statement>> {
        self.statements.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Clients {
    pub(crate) fn new(clients: impl IntoIterator<Item = Client>) -> Arc<Self> {
        let idle: Vec<Conn> = clients
            .into_iter()
            .map(|client| Conn {
                client,
                statements: Mutex::default(),
                needs_rollback: false,
            })
            .collect();
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(idle.len())),
            alive: AtomicUsize::new(idle.len()),
            idle: Mutex::new(idle),
        })
    }

    /// A free, live client outside any transaction; waits up to [`CLIENT_WAIT`] for one.
    async fn get(self: &Arc<Self>) -> Result<Plain, Error> {
        loop {
            if self.alive.load(Ordering::Acquire) == 0 {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{SYSTEM}: getting a connection: every client the store was given has \
                         closed"
                    ),
                ));
            }
            let permit = tokio::time::timeout(CLIENT_WAIT, self.permits.clone().acquire_owned())
                .await
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Unavailable,
                        format!(
                            "{SYSTEM}: getting a connection: no client came free within {}s",
                            CLIENT_WAIT.as_secs()
                        ),
                    )
                })?
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Unavailable,
                        format!("{SYSTEM}: getting a connection: the store's clients are closed"),
                    )
                })?;
            let conn = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            // Every lent client holds a permit, so a free permit means an idle client.
            let Some(mut conn) = conn else {
                return Err(Error::new(
                    ErrorKind::Store,
                    format!("{SYSTEM}: getting a connection: a free permit but no idle client"),
                ));
            };
            if conn.needs_rollback && !conn.client.is_closed() {
                match conn.client.batch_execute(sql::ROLLBACK).await {
                    Ok(()) => conn.needs_rollback = false,
                    Err(_) => {
                        // Not worth keeping: a connection that cannot roll back is broken.
                        drop(conn);
                        self.lose(permit);
                        continue;
                    }
                }
            }
            if conn.client.is_closed() {
                drop(conn);
                self.lose(permit);
                continue;
            }
            return Ok(Plain {
                conn: Some(conn),
                home: self.clone(),
                permit: Some(permit),
            });
        }
    }

    /// One client is gone for good: its permit with it.
    fn lose(&self, permit: OwnedSemaphorePermit) {
        permit.forget();
        self.alive.fetch_sub(1, Ordering::AcqRel);
    }

    /// Puts a client back on the stack, unless it closed.
    fn put_back(&self, conn: Conn, permit: OwnedSemaphorePermit) {
        if conn.client.is_closed() {
            drop(conn);
            self.lose(permit);
            return;
        }
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn);
        drop(permit);
    }
}

/// A plain client on loan; goes back on the stack when dropped.
pub(crate) struct Plain {
    conn: Option<Conn>,
    home: Arc<Clients>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Plain {
    fn conn(&self) -> &Conn {
        self.conn
            .as_ref()
            .expect("a lent client is present until it is dropped")
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        if let (Some(conn), Some(permit)) = (self.conn.take(), self.permit.take()) {
            self.home.put_back(conn, permit);
        }
    }
}

/// Turns a failed `BEGIN` into the store's error.
pub(crate) fn begin_error(e: tokio_postgres::Error) -> Error {
    store_error(sql::BEGIN, e)
}
