//! Idempotent-request records ([`RequestStore`], [`ReapRequests`]) in the requests table
//! `idem-sql` uses, with its statements and its decision rules, so either store can serve a
//! record the other began.
//!
//! One row per (scope, key): the fingerprint, a state (in progress / completed), the fencing
//! token, the lease and the expiry in microseconds since the Unix epoch on the server's clock,
//! and the stored result. `begin_request` never waits for an executor: it reads the row with a
//! plain `SELECT` (an MVCC read, which never waits for the row lock a running operation's
//! transaction holds), decides, and only then writes with a statement guarded by what it read
//! (the fence, the state, the lease), so a concurrent change makes the write affect no row and
//! the lookup starts over. Lookups run on a connection of their own, outside the operation's
//! transaction, so a concurrent retry sees a taken record at once.
//!
//! Fences: a new record's fence is the server's clock in microseconds when it was looked up
//! absent, and every takeover adds one. A record released (deleted) and taken again therefore
//! gets a fence no holder of its earlier life had, while a takeover stays below the clock.

use std::time::Duration;

use idem_core::request_record::{
    MAX_ATTEMPTS, Next, RecordRow, RecoveryRow, bound_fence, decide, held_uncommitted, lease_lost,
    next_fence, recovery_of, span, stored_fence,
};
use idem_core::store::{ReapRequests, RecoveryStore, RequestStore};
use idem_core::{Begin, Error, ErrorKind, Fence, Fingerprint, Recovery, RequestKey, Resume, Stuck};
use tokio_postgres::types::ToSql;

use crate::errors::store_error;
use crate::store::PgStore;
use crate::tx::PgTx;

pub use idem_core::request_record::MAX_REQUEST_KEY_LEN;

/// The record the `read` statement returns (all `None` but `now` when absent), in the shape
/// the shared rules decide on.
fn record(r: &tokio_postgres::Row) -> Result<RecordRow, tokio_postgres::Error> {
    Ok((
        r.try_get(0)?,
        r.try_get(1)?,
        r.try_get(2)?,
        r.try_get(3)?,
        r.try_get(4)?,
        r.try_get(5)?,
        r.try_get(6)?,
        r.try_get(7)?,
    ))
}

/// Ends a held record with its result (completed or abandoned: the two statements take the same
/// parameters), in the handler's transaction; a record the fence no longer holds is `LeaseLost`.
async fn end_in(
    tx: &mut PgTx,
    statement: &str,
    doing: &'static str,
    key: &RequestKey,
    fence: Fence,
    result: &[u8],
    ttl: Duration,
) -> Result<(), Error> {
    let err = |e| store_error(doing, e);
    let end = tx.prepare_cached(statement).await.map_err(err)?;
    let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
    let (ttl, fence_bound) = (span(ttl), bound_fence(fence));
    let params: [&(dyn ToSql + Sync); 5] = [&result, &ttl, &scope, &id, &fence_bound];
    if tx.execute(&end, &params).await.map_err(err)? == 1 {
        Ok(())
    } else {
        Err(lease_lost(fence))
    }
}

/// A row of the `recovery` or `stuck` statement.
fn recovery_row(r: &tokio_postgres::Row) -> Result<RecoveryRow, tokio_postgres::Error> {
    Ok((
        r.try_get(0)?,
        r.try_get(1)?,
        r.try_get(2)?,
        r.try_get(3)?,
        r.try_get(4)?,
        r.try_get(5)?,
    ))
}

/// The lookup and take of [`RequestStore::begin_request`] and, with a first recovery point
/// (`first`: point, state), of [`RecoveryStore::begin_phases`]: a record inserted or reset is
/// born at that point by the statement that takes it. With the record taken comes where it
/// stands: known without a read when inserted or reset; read after a takeover (with the new
/// fence, which no earlier holder's write can match any more) only when `first` is given.
async fn take(
    store: &PgStore,
    key: &RequestKey,
    fingerprint: &Fingerprint,
    lease: Duration,
    ttl: Duration,
    first: Option<(&str, &[u8])>,
) -> Result<(Begin, Option<Recovery>), Error> {
    let what = "beginning an idempotent request";
    let err = |e| store_error(what, e);
    let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
    let fp = &fingerprint.as_bytes()[..];
    let (lease, ttl) = (span(lease), span(ttl));
    let born = Recovery {
        attempts: 1,
        resume: first.map(|(point, state)| Resume {
            point: point.to_owned(),
            state: state.to_vec(),
        }),
    };
    // One connection for the whole lookup; each statement commits on its own.
    let conn = store.lease().await?;
    let client = conn.client();
    let read = conn.prepare(&store.rsql.read).await.map_err(err)?;
    let mut last = None;
    for _ in 0..MAX_ATTEMPTS {
        let row = client
            .query_one(&read, &[&fp, &scope, &id])
            .await
            .map_err(err)?;
        let record = record(&row).map_err(err)?;
        let next = decide(record, fingerprint)?;
        // The take statements do not wait for a record held uncommitted (see idem-dialect):
        // one that affected no row, then the same decision again, met such a record.
        let this = next.taking();
        if this.is_some() && this == last {
            return Ok((held_uncommitted(), None));
        }
        last = this;
        match next {
            Next::Answer(answer) => return Ok((answer, None)),
            Next::Insert { fence } => {
                let inserted = match first {
                    None => {
                        let insert = conn.prepare(&store.rsql.insert).await.map_err(err)?;
                        let params: [&(dyn ToSql + Sync); 6] =
                            [&scope, &id, &fp, &fence, &lease, &ttl];
                        client.execute(&insert, &params).await.map_err(err)?
                    }
                    Some((point, state)) => {
                        let insert = conn.prepare(&store.rsql.insert_at).await.map_err(err)?;
                        let params: [&(dyn ToSql + Sync); 8] =
                            [&scope, &id, &fp, &fence, &lease, &ttl, &point, &state];
                        client.execute(&insert, &params).await.map_err(err)?
                    }
                };
                if inserted == 1 {
                    let fence = stored_fence(fence)?;
                    let taken = Begin::Acquired {
                        fence,
                        takeover: false,
                    };
                    return Ok((taken, Some(born)));
                }
            }
            Next::Reset { fence, takeover } => {
                let reset = match first {
                    None => {
                        let reset = conn.prepare(&store.rsql.reset).await.map_err(err)?;
                        let params: [&(dyn ToSql + Sync); 6] =
                            [&fp, &lease, &ttl, &scope, &id, &fence];
                        client.execute(&reset, &params).await.map_err(err)?
                    }
                    Some((point, state)) => {
                        let reset = conn.prepare(&store.rsql.reset_at).await.map_err(err)?;
                        let params: [&(dyn ToSql + Sync); 8] =
                            [&fp, &lease, &ttl, &point, &state, &scope, &id, &fence];
                        client.execute(&reset, &params).await.map_err(err)?
                    }
                };
                if reset == 1 {
                    let fence = next_fence(fence)?;
                    return Ok((Begin::Acquired { fence, takeover }, Some(born)));
                }
            }
            Next::TakeOver { fence } => {
                // A row lock it meets is the old executor's completion about to commit,
                // so waiting is short.
                let take_over = conn.prepare(&store.rsql.take_over).await.map_err(err)?;
                let params: [&(dyn ToSql + Sync); 4] = [&lease, &scope, &id, &fence];
                if client.execute(&take_over, &params).await.map_err(err)? == 1 {
                    let fence = next_fence(fence)?;
                    let taken = Begin::Acquired {
                        fence,
                        takeover: true,
                    };
                    if first.is_none() {
                        return Ok((taken, None));
                    }
                    // Rare (a crash, a lapsed lease): the point is read after the take, under
                    // the new fence, so no earlier holder's late write can change it.
                    let recovery = conn.prepare(&store.rsql.recovery).await.map_err(err)?;
                    let fence_bound = bound_fence(fence);
                    let row = client
                        .query_opt(&recovery, &[&scope, &id, &fence_bound])
                        .await
                        .map_err(err)?;
                    return match row {
                        Some(row) => {
                            let (_, _, recovery) = recovery_of(recovery_row(&row).map_err(err)?)?;
                            Ok((taken, Some(recovery)))
                        }
                        None => Err(lease_lost(fence)),
                    };
                }
            }
        }
    }
    Err(Error::new(
        ErrorKind::Transient,
        "the request record kept changing under concurrent lookups; retry",
    ))
}

impl RequestStore for PgStore {
    fn max_key_len(&self) -> usize {
        MAX_REQUEST_KEY_LEN
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

    async fn complete_in(
        &self,
        tx: &mut PgTx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let (statement, doing) = (&self.rsql.complete, "completing an idempotent request");
        end_in(tx, statement, doing, key, fence, result, ttl).await
    }

    /// Deletes a record without a recovery point; ends the lease of one with a point.
    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fence = bound_fence(fence);
        let what = "releasing an idempotent request";
        let params: [&(dyn ToSql + Sync); 3] = [&scope, &id, &fence];
        if self
            .execute_alone(what, &self.rsql.release, &params)
            .await?
            == 1
        {
            return Ok(());
        }
        self.execute_alone(what, &self.rsql.end_lease, &params)
            .await
            .map(drop)
    }

    async fn extend_lease(
        &self,
        key: &RequestKey,
        fence: Fence,
        lease: Duration,
    ) -> Result<bool, Error> {
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let (lease, fence) = (span(lease), bound_fence(fence));
        self.execute_alone(
            "extending a request's lease",
            &self.rsql.extend,
            &[&lease, &scope, &id, &fence],
        )
        .await
        .map(|rows| rows == 1)
    }
}

impl RecoveryStore for PgStore {
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
        let err = |e| store_error("reading a request's recovery point", e);
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fence_bound = bound_fence(fence);
        let conn = self.lease().await?;
        let statement = conn.prepare(&self.rsql.recovery).await.map_err(err)?;
        let row = conn
            .client()
            .query_opt(&statement, &[&scope, &id, &fence_bound])
            .await
            .map_err(err)?;
        match row {
            Some(row) => Ok(recovery_of(recovery_row(&row).map_err(err)?)?.2),
            None => Err(lease_lost(fence)),
        }
    }

    async fn advance_in(
        &self,
        tx: &mut PgTx,
        key: &RequestKey,
        fence: Fence,
        point: &str,
        state: &[u8],
    ) -> Result<(), Error> {
        let err = |e| store_error("advancing a request's recovery point", e);
        let advance = tx.prepare_cached(&self.rsql.advance).await.map_err(err)?;
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fence_bound = bound_fence(fence);
        let params: [&(dyn ToSql + Sync); 5] = [&point, &state, &scope, &id, &fence_bound];
        if tx.execute(&advance, &params).await.map_err(err)? == 1 {
            Ok(())
        } else {
            Err(lease_lost(fence))
        }
    }

    async fn abandon_in(
        &self,
        tx: &mut PgTx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let (statement, doing) = (&self.rsql.abandon, "abandoning an idempotent request");
        end_in(tx, statement, doing, key, fence, result, ttl).await
    }

    async fn take_stuck(&self, limit: u32, lease: Duration) -> Result<Vec<Stuck>, Error> {
        let err = |e| store_error("taking stuck requests over", e);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let tx = self.begin_tx().await?;
        let stuck = tx.prepare_cached(&self.rsql.stuck).await.map_err(err)?;
        let take_over = tx.prepare_cached(&self.rsql.take_over).await.map_err(err)?;
        let rows = tx.query(&stuck, &[&i64::from(limit)]).await.map_err(err)?;
        let lease = span(lease);
        let mut taken = Vec::with_capacity(rows.len());
        for row in &rows {
            let (key, fence, mut recovery) = recovery_of(recovery_row(row).map_err(err)?)?;
            let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
            let fence_bound = bound_fence(fence);
            let params: [&(dyn ToSql + Sync); 4] = [&lease, &scope, &id, &fence_bound];
            // The row is locked by this transaction: the guard holds.
            if tx.execute(&take_over, &params).await.map_err(err)? == 1 {
                recovery.attempts = recovery.attempts.saturating_add(1);
                taken.push(Stuck {
                    fence: next_fence(fence_bound)?,
                    key,
                    recovery,
                });
            }
        }
        tx.commit().await.map_err(crate::errors::commit_error)?;
        Ok(taken)
    }
}

impl ReapRequests for PgStore {
    async fn reap_batch(&self, limit: u32) -> Result<u64, Error> {
        let limit = i64::from(limit);
        self.execute_alone("reaping expired requests", &self.rsql.reap, &[&limit])
            .await
    }
}
