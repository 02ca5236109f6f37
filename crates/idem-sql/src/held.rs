//! Connections a store keeps for its transactions, without sqlx's pool pings (any engine), and
//! the bounds that make the store give up a connection: its age, its idle time, a `BEGIN`
//! that does not answer, repeated read-only answers.
//!
//! sqlx's pool sends a ping when a connection is acquired (`test_before_acquire`) and another,
//! unconditionally, when it is returned: two of the six round trips a one-message PostgreSQL
//! transaction costs (`BENCHMARKS.md`, P1). A consumer's workers run transaction after transaction, so
//! here a finished transaction's connection goes straight back on a stack and the next `begin`
//! takes it as it is. A connection that failed is never put back: its transaction was ended
//! by closing it (the server rolls back), and the next `begin` opens a new one; a stale idle
//! connection (the server restarted meanwhile) is found by its `BEGIN` failing and replaced
//! at once by a fresh one.
//!
//! A healthy connection is not kept for ever either. After a failover behind a DNS name, a
//! connection opened before it still talks to the old primary — now a replica answering every
//! write with "read-only", or a host that vanished, where a `BEGIN` waits until TCP gives up.
//! So a connection past its lifetime or idle for too long is closed when the next transaction
//! begins, a `BEGIN` has a timeout (the connection is dropped and a fresh one tried), and a
//! connection whose transactions were refused as read-only [`Recycling::read_only_limit`]
//! times in a row is closed: a new connection resolves the name again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::engine::Engine;
use crate::tx::{Writes, begin_on, bounded};

type Options<E> = <<E as sqlx::Database>::Connection as Connection>::Options;

/// When the store gives a connection up (see `SqlStore::hold_connections` and the options
/// after it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Recycling {
    /// A held connection older than this is closed instead of used (default: the pool's
    /// `max_lifetime`).
    pub(crate) max_lifetime: Option<Duration>,
    /// A held connection idle longer than this is closed instead of used (default: the pool's
    /// `idle_timeout`).
    pub(crate) idle_timeout: Option<Duration>,
    /// A `BEGIN` that has not answered by then fails as unavailable, and its connection is
    /// closed.
    pub(crate) begin_timeout: Option<Duration>,
    /// After this many transactions in a row refused as read-only, the connection is closed;
    /// 0: never.
    pub(crate) read_only_limit: u32,
}

impl Recycling {
    /// Consecutive read-only refusals after which a connection is replaced, by default: one
    /// refusal may be a blip, two say the connection talks to a replica.
    pub(crate) const READ_ONLY_LIMIT: u32 = 2;

    /// The defaults for a store on `pool`: its lifetime and idle timeout; on a server, its
    /// acquire timeout for a `BEGIN`.
    pub(crate) fn of_pool<E: Engine>(pool: &sqlx::Pool<E>) -> Self {
        let options = pool.options();
        Self {
            max_lifetime: options.get_max_lifetime(),
            idle_timeout: options.get_idle_timeout(),
            begin_timeout: E::SERVER.then(|| options.get_acquire_timeout()),
            read_only_limit: Self::READ_ONLY_LIMIT,
        }
    }

    /// Whether `strikes` read-only refusals in a row retire a connection.
    pub(crate) fn retires(&self, strikes: u32) -> bool {
        self.read_only_limit > 0 && strikes >= self.read_only_limit
    }
}

/// Read-only refusals in a row of the transactions on sqlx's pool: the pool does not tell its
/// connections apart, so the count is the store's; once it reaches the limit, each connection
/// refused as read-only is closed instead of returned, until a write succeeds.
#[derive(Debug)]
pub(crate) struct PoolStrikes {
    count: std::sync::atomic::AtomicU32,
    limits: Recycling,
}

impl PoolStrikes {
    pub(crate) fn new(limits: Recycling) -> Arc<Self> {
        Arc::new(Self {
            count: std::sync::atomic::AtomicU32::new(0),
            limits,
        })
    }

    /// Counts what a transaction's writes said; whether its connection must be closed.
    pub(crate) fn settle(&self, writes: Writes) -> bool {
        use std::sync::atomic::Ordering;
        match writes {
            Writes::Unknown => false,
            Writes::Taken => {
                self.count.store(0, Ordering::Relaxed);
                false
            }
            Writes::ReadOnly => {
                let strikes = self.count.fetch_add(1, Ordering::Relaxed).saturating_add(1);
                self.limits.retires(strikes)
            }
        }
    }
}

/// At most `max` connections, opened on demand, kept between transactions.
pub(crate) struct HeldConnections<E: Engine> {
    options: Options<E>,
    /// Free connections and since when each was free; the last one is used first.
    idle: Mutex<Vec<(Kept<E>, Instant)>>,
    permits: Arc<Semaphore>,
    max: u32,
    /// How long a `begin` waits for a free connection or for a new one to open.
    wait: Duration,
    limits: Recycling,
}

impl<E: Engine> std::fmt::Debug for HeldConnections<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldConnections")
            .field("max", &self.max)
            .field("free", &self.permits.available_permits())
            .field("wait", &self.wait)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// A connection and what decides whether it is used again.
struct Kept<E: Engine> {
    conn: E::Connection,
    opened: Instant,
    /// Its transactions refused as read-only since a write last succeeded on it.
    read_only: u32,
}

/// One connection on loan to a transaction; goes back to the stack when dropped, unless it
/// was spoiled or must be retired.
pub(crate) struct Held<E: Engine> {
    kept: Option<Kept<E>>,
    home: Arc<HeldConnections<E>>,
    spoiled: bool,
    _permit: OwnedSemaphorePermit,
}

impl<E: Engine> HeldConnections<E> {
    pub(crate) fn new(
        options: Options<E>,
        max: u32,
        wait: Duration,
        limits: Recycling,
    ) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max as usize)),
            max,
            wait,
            limits,
        })
    }

    /// The same connections' settings with other limits (for the store's builder methods,
    /// before any connection is open).
    pub(crate) fn with_limits(&self, limits: Recycling) -> Arc<Self> {
        Self::new(self.options.clone(), self.max, self.wait, limits)
    }

    /// A connection with `begin` (the engine's `BEGIN` or `REQUEST_BEGIN`) run on it.
    pub(crate) async fn begin(
        self: &Arc<Self>,
        begin: &'static str,
    ) -> Result<Held<E>, sqlx::Error> {
        let mut held = self.lend().await?;
        if let Some(conn) = held.idle_conn() {
            let begun = bounded(
                self.limits.begin_timeout,
                "BEGIN",
                begin_on::<E>(conn, true, begin),
            );
            if begun.await.is_ok() {
                held.ready();
                return Ok(held);
            }
            // Went stale while idle, or its peer no longer answers: replace it now rather
            // than fail this transaction (dropping it closes the socket).
        }
        let conn = held.open().await?;
        bounded(
            self.limits.begin_timeout,
            "BEGIN",
            begin_on::<E>(conn, true, begin),
        )
        .await?;
        held.ready();
        Ok(held)
    }

    /// A permit for one connection and the most recently freed one, if any (see
    /// [`Held::idle_conn`] and [`Held::open`]). Not ready until [`Held::ready`]: dropped before,
    /// its connection is closed.
    pub(crate) async fn lend(self: &Arc<Self>) -> Result<Held<E>, sqlx::Error> {
        let permit = tokio::time::timeout(self.wait, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        Ok(Held {
            kept: self.take_idle(),
            home: self.clone(),
            spoiled: true,
            _permit: permit,
        })
    }

    /// The most recently freed connection within its lifetime and idle timeout; every free
    /// connection past either is closed on the way (the ones under the top of the stack too,
    /// which a busy consumer might otherwise never reach).
    fn take_idle(&self) -> Option<Kept<E>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let worn = |kept: &Kept<E>, since: Instant| {
            self.limits
                .max_lifetime
                .is_some_and(|l| now.duration_since(kept.opened) >= l)
                || self
                    .limits
                    .idle_timeout
                    .is_some_and(|t| now.duration_since(since) >= t)
        };
        if idle.iter().any(|(kept, since)| worn(kept, *since)) {
            let (keep, retire): (Vec<_>, Vec<_>) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|(kept, since)| !worn(kept, *since));
            *idle = keep;
            for (kept, _) in retire {
                close::<E>(kept.conn);
            }
        }
        idle.pop().map(|(kept, _)| kept)
    }
}

/// Closes a healthy connection politely (the server sees a goodbye, not a dropped socket), in
/// the background.
fn close<E: Engine>(conn: E::Connection) {
    const GOODBYE: Duration = Duration::from_secs(5);
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(GOODBYE, conn.close()).await;
            });
        }
        Err(_) => drop(conn),
    }
}

impl<E: Engine> Held<E> {
    /// The idle connection it was lent with, if there was one: it may have gone stale while
    /// idle (the server restarted, the peer vanished), so its first statement failing is
    /// a reason to [`open`](Self::open) a fresh one, not to fail.
    pub(crate) fn idle_conn(&mut self) -> Option<&mut E::Connection> {
        self.kept.as_mut().map(|k| &mut k.conn)
    }

    /// Replaces its connection (if any) with a newly opened one.
    pub(crate) async fn open(&mut self) -> Result<&mut E::Connection, sqlx::Error> {
        self.kept = None;
        let home = &self.home;
        let conn = tokio::time::timeout(home.wait, E::Connection::connect_with(&home.options))
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        let kept = self.kept.insert(Kept {
            conn,
            opened: Instant::now(),
            read_only: 0,
        });
        Ok(&mut kept.conn)
    }

    /// Its first statement succeeded: the connection goes back to the stack when dropped.
    pub(crate) fn ready(&mut self) {
        self.spoiled = false;
    }

    /// Its transaction ended in a way that leaves the connection in doubt: close it.
    pub(crate) fn spoil(&mut self) {
        self.spoiled = true;
    }

    /// Counts what its transaction's writes said about the server.
    pub(crate) fn settle(&mut self, writes: Writes) {
        if let Some(kept) = self.kept.as_mut() {
            match writes {
                Writes::Unknown => {}
                Writes::Taken => kept.read_only = 0,
                Writes::ReadOnly => kept.read_only = kept.read_only.saturating_add(1),
            }
        }
    }

    pub(crate) fn conn(&self) -> &E::Connection {
        &self
            .kept
            .as_ref()
            .expect("a held connection is present until dropped")
            .conn
    }

    pub(crate) fn conn_mut(&mut self) -> &mut E::Connection {
        &mut self
            .kept
            .as_mut()
            .expect("a held connection is present until dropped")
            .conn
    }
}

impl<E: Engine> Drop for Held<E> {
    fn drop(&mut self) {
        let Some(kept) = self.kept.take() else {
            return;
        };
        if self.spoiled {
            // Dropped here, which closes its socket: the server rolls an open transaction
            // back.
            drop(kept);
        } else if self.home.limits.retires(kept.read_only) {
            // Talking to a replica: a new connection may reach the primary.
            close::<E>(kept.conn);
        } else {
            self.home
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((kept, Instant::now()));
        }
    }
}
