//! Connections a store keeps for its transactions, without sqlx's pool pings (any engine).
//!
//! sqlx's pool sends a ping when a connection is acquired (`test_before_acquire`) and another,
//! unconditionally, when it is returned: two of the six round trips a one-message PostgreSQL
//! transaction costs (`BENCHMARKS.md`, P1). A consumer's workers run transaction after transaction, so
//! here a finished transaction's connection goes straight back on a stack and the next `begin`
//! takes it as it is. A connection that failed is never put back: its transaction was ended
//! by closing it (the server rolls back), and the next `begin` opens a new one; a stale idle
//! connection (the server restarted meanwhile) is found by its `BEGIN` failing and replaced
//! at once by a fresh one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::engine::Engine;
use crate::tx::begin_on;

type Options<E> = <<E as sqlx::Database>::Connection as Connection>::Options;

/// At most `max` connections, opened on demand, kept between transactions.
pub(crate) struct HeldConnections<E: Engine> {
    options: Options<E>,
    idle: Mutex<Vec<E::Connection>>,
    permits: Arc<Semaphore>,
    /// How long a `begin` waits for a free connection or for a new one to open.
    wait: Duration,
}

impl<E: Engine> std::fmt::Debug for HeldConnections<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldConnections")
            .field("free", &self.permits.available_permits())
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

/// One connection on loan to a transaction; goes back to the stack when dropped, unless it
/// was spoiled.
pub(crate) struct Held<E: Engine> {
    conn: Option<E::Connection>,
    home: Arc<HeldConnections<E>>,
    spoiled: bool,
    _permit: OwnedSemaphorePermit,
}

impl<E: Engine> HeldConnections<E> {
    pub(crate) fn new(options: Options<E>, max: u32, wait: Duration) -> Arc<Self> {
        Arc::new(Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max.max(1) as usize)),
            wait,
        })
    }

    /// A connection with the engine's `BEGIN` run on it (see `tx.rs` for how).
    pub(crate) async fn begin(self: &Arc<Self>) -> Result<Held<E>, sqlx::Error> {
        let permit = tokio::time::timeout(self.wait, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut held = Held {
            conn: idle,
            home: self.clone(),
            spoiled: true, // until BEGIN succeeded
            _permit: permit,
        };
        if let Some(conn) = held.conn.as_mut() {
            if begin_on::<E>(conn, true).await.is_ok() {
                held.spoiled = false;
                return Ok(held);
            }
            // Went stale while idle: replace it now rather than fail this transaction.
            held.conn = None;
        }
        let mut conn = tokio::time::timeout(self.wait, E::Connection::connect_with(&self.options))
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        begin_on::<E>(&mut conn, true).await?;
        held.conn = Some(conn);
        held.spoiled = false;
        Ok(held)
    }
}

impl<E: Engine> Held<E> {
    /// Its transaction ended in a way that leaves the connection in doubt: close it.
    pub(crate) fn spoil(&mut self) {
        self.spoiled = true;
    }

    pub(crate) fn conn(&self) -> &E::Connection {
        self.conn
            .as_ref()
            .expect("a held connection is present until dropped")
    }

    pub(crate) fn conn_mut(&mut self) -> &mut E::Connection {
        self.conn
            .as_mut()
            .expect("a held connection is present until dropped")
    }
}

impl<E: Engine> Drop for Held<E> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take()
            && !self.spoiled
        {
            self.home
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(conn);
        }
        // A spoiled connection is dropped here, which closes its socket: the server rolls an
        // open transaction back.
    }
}
