//! Idempotent-request records ([`RequestStore`](idem_core::store::RequestStore),
//! [`ReapRequests`](idem_core::store::ReapRequests)) on every engine: the decision a lookup
//! leads to, and the one implementation over every engine's statements.
//!
//! One row per (scope, key): the fingerprint, a state (in progress / completed), the fencing
//! token, the lease and the expiry in microseconds since the Unix epoch on the store's clock,
//! and the stored result. `begin_request` never waits for an executor: it reads the row with a
//! plain `SELECT` (an MVCC read on PostgreSQL and InnoDB, a WAL read on SQLite — none of them
//! waits for the row lock or write lock a running operation's transaction holds), decides, and
//! only then writes with a statement guarded by what it read (the fence, the state, the lease),
//! so a concurrent change makes the write affect no row and the lookup starts over.
//!
//! The operation's transaction begins with the engine's `REQUEST_BEGIN` (SQLite: deferred, so
//! the database's one write lock is taken by the handler's first write, not for the whole
//! request), and the completion runs in it through the engine's `complete_request`. On SQLite a
//! take-over and a lease renewal never wait for the write lock (see `sqlite.rs`).
//!
//! Fences: a new record's fence is the store's clock in microseconds when it was looked up
//! absent, and every takeover adds one. A record released (deleted) and taken again therefore
//! gets a fence no holder of its earlier life had — a stale executor's completion or release
//! never matches it — while a takeover (at least a lapsed lease later) stays below the clock.

use std::time::Duration;

use idem_core::TransactionalStore;
pub use idem_core::request_record::MAX_REQUEST_KEY_LEN;
use idem_core::request_record::{
    MAX_ATTEMPTS, Next, bound_fence, decide, held_uncommitted, lease_lost, next_fence, recovery_of,
    span, stored_fence,
};
pub(crate) use idem_core::request_record::{RecordRow, RecoveryRow};
use idem_core::store::{ReapRequests, RecoveryStore, RequestStore};
use idem_core::{
    Begin, BeginIn, Error, ErrorKind, Fence, Fingerprint, Recovery, RequestKey, Resume, Stuck,
};

use crate::engine::{Engine, Param};
use crate::errors::store_error;
use crate::store::SqlStore;
use crate::tx::Tx;

/// Whether a driver error is the unique violation of a lost insert race (MySQL has no
/// `ON CONFLICT DO NOTHING` that reports it through rows affected).
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

impl<E: Engine> RequestStore for SqlStore<E> {
    fn max_key_len(&self) -> usize {
        MAX_REQUEST_KEY_LEN
    }

    /// With the engine's `REQUEST_BEGIN`: on SQLite deferred, so that the write lock is
    /// taken by the handler's first write (see `sqlite.rs`).
    async fn begin_execution(&self) -> Result<Tx<E>, Error> {
        self.begin_with(E::REQUEST_BEGIN).await
    }

    async fn begin_request(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Begin, Error> {
        take(self, key, fingerprint, lease, ttl, None)
            .await
            .map(|(begin, _)| begin)
    }

    /// On PostgreSQL and MariaDB ([`Engine::ONE_TRANSACTION`]); SQLite answers
    /// [`BeginIn::Unsupported`]: its take would hold the database's one write lock for the
    /// whole operation.
    async fn begin_request_in(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<BeginIn<Tx<E>>, Error> {
        if !E::ONE_TRANSACTION {
            return Ok(BeginIn::Unsupported);
        }
        take_in(self, key, fingerprint, lease, ttl).await
    }

    async fn complete_in(
        &self,
        tx: &mut Tx<E>,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let (statement, doing) = (&self.rsql.complete, "completing an idempotent request");
        end_in::<E>(tx, statement, doing, key, fence, result, ttl).await
    }

    /// Deletes a record without a recovery point; ends the lease of one with a point.
    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let err = |e| store_error::<E>("releasing an idempotent request", e);
        let params = [
            Param::Bytes(&key.scope.as_bytes()[..]),
            Param::Bytes(key.key.as_str().as_bytes()),
            Param::Int(bound_fence(fence)),
        ];
        if E::execute_pool(&self.pool, &self.rsql.release, &params)
            .await
            .map_err(err)?
            == 1
        {
            return Ok(());
        }
        let params = Clocked::<E>::now().params(params);
        E::execute_pool(&self.pool, &self.rsql.end_lease, &params)
            .await
            .map(drop)
            .map_err(err)
    }

    async fn extend_lease(
        &self,
        key: &RequestKey,
        fence: Fence,
        lease: Duration,
    ) -> Result<bool, Error> {
        let params = Clocked::<E>::now().params([
            Param::Int(span(lease)),
            Param::Bytes(&key.scope.as_bytes()[..]),
            Param::Bytes(key.key.as_str().as_bytes()),
            Param::Int(bound_fence(fence)),
        ]);
        let renewed = E::execute_unless_locked(&self.pool, &self.rsql.extend, &params)
            .await
            .map_err(|e| store_error::<E>("extending a request's lease", e))?;
        match renewed {
            Some(rows) => Ok(rows == 1),
            // Perhaps this execution's own transaction holds it: while any does, no one can
            // take the record over either (a take-over does not wait for the lock).
            None => Err(Error::new(
                ErrorKind::Transient,
                "the lease was not renewed now: a transaction (perhaps this execution's own) \
                 holds the database's write lock",
            )),
        }
    }
}

/// The lookup and take of [`RequestStore::begin_request`] and, with a first recovery point
/// (`first`: point, state), of [`RecoveryStore::begin_phases`]: a record inserted or reset is
/// born at that point by the statement that takes it. With the record taken comes where it
/// stands: known without a read when inserted or reset; read after a takeover (with the new
/// fence, which no earlier holder's write can match any more) only when `first` is given.
async fn take<E: Engine>(
    store: &SqlStore<E>,
    key: &RequestKey,
    fingerprint: &Fingerprint,
    lease: Duration,
    ttl: Duration,
    first: Option<(&str, &[u8])>,
) -> Result<(Begin, Option<Recovery>), Error> {
    let err = |e| store_error::<E>("beginning an idempotent request", e);
    let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
    let fp = &fingerprint.as_bytes()[..];
    let (lease, ttl) = (Param::Int(span(lease)), Param::Int(span(ttl)));
    let (scope, id, fp) = (Param::Bytes(scope), Param::Bytes(id), Param::Bytes(fp));
    let born = Recovery {
        attempts: 1,
        resume: first.map(|(point, state)| Resume {
            point: point.to_owned(),
            state: state.to_vec(),
        }),
    };
    let mut last = None;
    for _ in 0..MAX_ATTEMPTS {
        let now = Clocked::<E>::now();
        // The connection goes back at once: this mode's take commits on its own.
        let (row, _) = store
            .read_record(&store.rsql.read, &now.params([fp, scope, id]))
            .await
            .map_err(err)?;
        let next = decide(row, fingerprint)?;
        let this = next.taking();
        if this.is_some() && this == last {
            return Ok((held_uncommitted(), None));
        }
        match next {
            Next::Answer(answer) => return Ok((answer, None)),
            Next::Insert { fence } => {
                let params = match first {
                    None => now.params([scope, id, fp, Param::Int(fence), lease, ttl]),
                    Some((point, state)) => now.params([
                        scope,
                        id,
                        fp,
                        Param::Int(fence),
                        lease,
                        ttl,
                        Param::Text(point),
                        Param::Bytes(state),
                    ]),
                };
                let statement = match first {
                    None => &store.rsql.insert,
                    Some(_) => &store.rsql.insert_at,
                };
                let inserted = match execute_take(store, statement, &params).await {
                    Ok(rows) => rows == 1,
                    Err(e) if is_unique_violation(&e) => false,
                    Err(e) if lock_not_granted::<E>(&e) => return Ok((held_uncommitted(), None)),
                    Err(e) => return Err(err(e)),
                };
                if inserted {
                    let fence = stored_fence(fence)?;
                    let taken = Begin::Acquired {
                        fence,
                        takeover: false,
                    };
                    return Ok((taken, Some(born)));
                }
            }
            Next::Reset { fence, takeover } => {
                let (statement, params) = match first {
                    None => (
                        &store.rsql.reset,
                        now.params([fp, lease, ttl, scope, id, Param::Int(fence)]),
                    ),
                    Some((point, state)) => (
                        &store.rsql.reset_at,
                        now.params([
                            fp,
                            lease,
                            ttl,
                            Param::Text(point),
                            Param::Bytes(state),
                            scope,
                            id,
                            Param::Int(fence),
                        ]),
                    ),
                };
                let reset = match execute_take(store, statement, &params).await {
                    Ok(rows) => rows,
                    Err(e) if lock_not_granted::<E>(&e) => return Ok((held_uncommitted(), None)),
                    Err(e) => return Err(err(e)),
                };
                if reset == 1 {
                    let fence = next_fence(fence)?;
                    return Ok((Begin::Acquired { fence, takeover }, Some(born)));
                }
            }
            Next::TakeOver { fence } => {
                let params = now.params([lease, scope, id, Param::Int(fence)]);
                let sql = &store.rsql.take_over;
                let taken = match E::execute_unless_locked(&store.pool, sql, &params).await {
                    // MySQL 8: see `execute_take` (SQLite's own path never fails to parse).
                    Err(sqlx::Error::Database(db)) if E::plain_take(db.as_ref(), sql).is_some() => {
                        execute_take(store, sql, &params).await.map(Some)
                    }
                    taken => taken,
                };
                let taken = match taken {
                    Ok(rows) => rows,
                    Err(e) if lock_not_granted::<E>(&e) => return Ok((held_uncommitted(), None)),
                    Err(e) => return Err(err(e)),
                };
                match taken {
                    Some(1) => {
                        let fence = next_fence(fence)?;
                        let taken = Begin::Acquired {
                            fence,
                            takeover: true,
                        };
                        // Rare (a crash, a lapsed lease): the point is read after the take,
                        // under the new fence, so no earlier holder's late write can change it.
                        let recovery = match first {
                            Some(_) => Some(store.recovery(key, fence).await?),
                            None => None,
                        };
                        return Ok((taken, recovery));
                    }
                    Some(_) => {}
                    // The lease ran out, but its executor may still be writing: report it
                    // in progress rather than wait for it.
                    None => {
                        let busy = Begin::InProgress {
                            retry_after: idem_core::retry_after(Duration::ZERO),
                        };
                        return Ok((busy, None));
                    }
                }
            }
        }
        last = this;
    }
    Err(kept_changing())
}

/// The error of a lookup that lost every race it ran.
fn kept_changing() -> Error {
    Error::new(
        ErrorKind::Transient,
        "the request record kept changing under concurrent lookups; retry",
    )
}

/// Runs a take statement of the leased mode on the pool. A server that cannot parse the
/// engine's no-wait form (MySQL 8: no `SET STATEMENT`; MariaDB has it) runs the plain
/// statement instead: it has no one-transaction mode ([`take_in`] answers unsupported), so no
/// record is ever held uncommitted for the plain statement to wait for.
async fn execute_take<E: Engine>(
    store: &SqlStore<E>,
    statement: &str,
    params: &[Param<'_>],
) -> Result<u64, sqlx::Error> {
    match E::execute_pool(&store.pool, statement, params).await {
        Err(sqlx::Error::Database(db)) if E::plain_take(db.as_ref(), statement).is_some() => {
            let plain = E::plain_take(db.as_ref(), statement).unwrap_or(statement);
            E::execute_pool(&store.pool, plain, params).await
        }
        done => done,
    }
}

/// Whether `e` says a take statement met a record held by another transaction and did not
/// wait for it.
fn lock_not_granted<E: Engine>(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if E::lock_not_granted(db.as_ref()))
}

/// [`RequestStore::begin_request_in`]: the lookup of [`take`], each take run in a new
/// transaction of the operation's and kept there. The read runs first, outside any
/// transaction, so a replay, a mismatch or a live lease is answered without one; only a take
/// begins one, on the connection the read ran on (a held one when the store holds
/// connections: a replay is then one round trip, and a first execution pays no pool pings). Every take statement is guarded by what the read found and never waits for a record
/// held uncommitted (see [`Engine::ONE_TRANSACTION`]): affecting no row, it is rolled back
/// and the record read again.
async fn take_in<E: Engine>(
    store: &SqlStore<E>,
    key: &RequestKey,
    fingerprint: &Fingerprint,
    lease: Duration,
    ttl: Duration,
) -> Result<BeginIn<Tx<E>>, Error> {
    let err = |e| store_error::<E>("beginning an idempotent request in its transaction", e);
    let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
    let fp = &fingerprint.as_bytes()[..];
    let (lease, ttl) = (Param::Int(span(lease)), Param::Int(span(ttl)));
    let (scope, id, fp) = (Param::Bytes(scope), Param::Bytes(id), Param::Bytes(fp));
    let mut last = None;
    for _ in 0..MAX_ATTEMPTS {
        let now = Clocked::<E>::now();
        let (row, conn) = store
            .read_record(&store.rsql.read, &now.params([fp, scope, id]))
            .await
            .map_err(err)?;
        let next = decide(row, fingerprint)?;
        let this = next.taking();
        if this.is_some() && this == last {
            return Ok(BeginIn::Answer(held_uncommitted()));
        }
        let (statement, params, fence, takeover) = match next {
            Next::Answer(answer) => return Ok(BeginIn::Answer(answer)),
            Next::Insert { fence } => (
                &store.rsql.insert,
                now.params([scope, id, fp, Param::Int(fence), lease, ttl]),
                stored_fence(fence)?,
                false,
            ),
            Next::Reset { fence, takeover } => (
                &store.rsql.reset,
                now.params([fp, lease, ttl, scope, id, Param::Int(fence)]),
                next_fence(fence)?,
                takeover,
            ),
            Next::TakeOver { fence } => (
                &store.rsql.take_over,
                now.params([lease, scope, id, Param::Int(fence)]),
                next_fence(fence)?,
                true,
            ),
        };
        // On the connection the record was read on: one acquire for both.
        let mut tx = store.begin_execution_on(conn).await?;
        match E::execute(&mut tx, statement, &params).await {
            Ok(1) => {
                return Ok(BeginIn::Acquired {
                    fence,
                    takeover,
                    tx,
                });
            }
            Ok(_) => {}
            Err(e) if is_unique_violation(&e) => {}
            Err(e) => {
                let _ = store.rollback(tx).await;
                if lock_not_granted::<E>(&e) {
                    return Ok(BeginIn::Answer(held_uncommitted()));
                }
                if matches!(&e, sqlx::Error::Database(db) if E::plain_take(db.as_ref(), statement).is_some())
                {
                    // A server without the no-wait form (MySQL 8): the leased mode.
                    return Ok(BeginIn::Unsupported);
                }
                return Err(err(e));
            }
        }
        // Lost a race: the record changed since the read, or is held uncommitted.
        let _ = store.rollback(tx).await;
        last = this;
    }
    Err(kept_changing())
}

/// Ends a held record with its result (completed or abandoned: the two statements take the same
/// parameters), in the handler's transaction; a record the fence no longer holds is `LeaseLost`.
async fn end_in<E: Engine>(
    tx: &mut Tx<E>,
    statement: &str,
    doing: &'static str,
    key: &RequestKey,
    fence: Fence,
    result: &[u8],
    ttl: Duration,
) -> Result<(), Error> {
    let [scope, id, fence_bound] = held(key, fence);
    let params = Clocked::<E>::now().params([
        Param::Bytes(result),
        Param::Int(span(ttl)),
        scope,
        id,
        fence_bound,
    ]);
    let updated = E::complete_request(tx, statement, &params)
        .await
        .map_err(|e| store_error::<E>(doing, e))?;
    if updated == 1 {
        Ok(())
    } else {
        Err(lease_lost(fence))
    }
}

/// scope, key, fence.
fn held<'a>(key: &'a RequestKey, fence: Fence) -> [Param<'a>; 3] {
    [
        Param::Bytes(&key.scope.as_bytes()[..]),
        Param::Bytes(key.key.as_str().as_bytes()),
        Param::Int(bound_fence(fence)),
    ]
}

impl<E: Engine> RecoveryStore for SqlStore<E> {
    async fn begin_phases(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        point: &str,
        state: &[u8],
    ) -> Result<(Begin, Option<Recovery>), Error> {
        take(self, key, fingerprint, lease, ttl, Some((point, state))).await
    }

    async fn recovery(&self, key: &RequestKey, fence: Fence) -> Result<Recovery, Error> {
        let err = |e| store_error::<E>("reading a request's recovery point", e);
        let mut conn = self.pool.acquire().await.map_err(err)?;
        let rows = E::fetch_recovery(&mut conn, &self.rsql.recovery, &held(key, fence))
            .await
            .map_err(err)?;
        match rows.into_iter().next() {
            Some(row) => Ok(recovery_of(row)?.2),
            None => Err(lease_lost(fence)),
        }
    }

    async fn advance_in(
        &self,
        tx: &mut Tx<E>,
        key: &RequestKey,
        fence: Fence,
        point: &str,
        state: &[u8],
    ) -> Result<(), Error> {
        let [scope, id, fence_bound] = held(key, fence);
        let params = [
            Param::Text(point),
            Param::Bytes(state),
            scope,
            id,
            fence_bound,
        ];
        // In the phase's transaction, which on SQLite may not hold the write lock yet: the
        // completion's path takes it.
        let updated = E::complete_request(tx, &self.rsql.advance, &params)
            .await
            .map_err(|e| store_error::<E>("advancing a request's recovery point", e))?;
        if updated == 1 {
            Ok(())
        } else {
            Err(lease_lost(fence))
        }
    }

    async fn abandon_in(
        &self,
        tx: &mut Tx<E>,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let (statement, doing) = (&self.rsql.abandon, "abandoning an idempotent request");
        end_in::<E>(tx, statement, doing, key, fence, result, ttl).await
    }

    async fn take_stuck(&self, limit: u32, lease: Duration) -> Result<Vec<Stuck>, Error> {
        let err = |e| store_error::<E>("taking stuck requests over", e);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut tx = self.begin_relay().await?;
        let clock = Clocked::<E>::now();
        let rows = E::fetch_recovery(
            &mut tx,
            &self.rsql.stuck,
            &clock.params([Param::Int(i64::from(limit))]),
        )
        .await
        .map_err(err)?;
        let mut taken = Vec::with_capacity(rows.len());
        for row in rows {
            let (key, fence, mut recovery) = recovery_of(row)?;
            let [scope, id, fence_bound] = held(&key, fence);
            let params = clock.params([Param::Int(span(lease)), scope, id, fence_bound]);
            // The row is locked by this transaction (or, on SQLite, the whole database is):
            // the guard holds, and the take-over touches one row.
            if E::execute(&mut tx, &self.rsql.take_over, &params)
                .await
                .map_err(err)?
                == 1
            {
                recovery.attempts = recovery.attempts.saturating_add(1);
                taken.push(Stuck {
                    fence: next_fence(bound_fence(fence))?,
                    key,
                    recovery,
                });
            }
        }
        tx.commit()
            .await
            .map_err(crate::errors::commit_error::<E>)?;
        Ok(taken)
    }
}

impl<E: Engine> ReapRequests for SqlStore<E> {
    async fn reap_batch(&self, limit: u32) -> Result<u64, Error> {
        let params = Clocked::<E>::now().params([Param::Int(i64::from(limit))]);
        E::execute_pool(&self.pool, &self.rsql.reap, &params)
            .await
            .map_err(|e| store_error::<E>("reaping expired requests", e))
    }
}

/// The clock a request statement reads: on a server, its own (the statements say `now()`);
/// on an embedded engine, this host's, bound as the last parameter.
struct Clocked<E> {
    now: Option<i64>,
    engine: std::marker::PhantomData<E>,
}

impl<E: Engine> Clocked<E> {
    fn now() -> Self {
        Self {
            now: E::stamp(idem_core::Stamp::StoreClock),
            engine: std::marker::PhantomData,
        }
    }

    /// `params`, then `now` where the engine binds it.
    fn params<'a, const N: usize>(&self, params: [Param<'a>; N]) -> Vec<Param<'a>> {
        let mut all = Vec::with_capacity(N + 1);
        all.extend(params);
        all.extend(self.now.map(Param::Int));
        all
    }
}
