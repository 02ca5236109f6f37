//! Idempotent-request records ([`RequestStore`](idem_core::store::RequestStore),
//! [`ReapRequests`](idem_core::store::ReapRequests)) on every engine: the decision a lookup
//! leads to, and one impl generated per store from its engine-specific statements.
//!
//! One row per (scope, key): the fingerprint, a state (in progress / completed), the fencing
//! token, the lease and the expiry in microseconds since the Unix epoch on the store's clock,
//! and the stored result. `begin_request` never waits for an executor: it reads the row with a
//! plain `SELECT` (an MVCC read on PostgreSQL and InnoDB, a WAL read on SQLite — none of them
//! waits for the row lock or write lock a running operation's transaction holds), decides, and
//! only then writes with a statement guarded by what it read (the fence, the state, the lease),
//! so a concurrent change makes the write affect no row and the lookup starts over.
//!
//! Fences: a new record's fence is the store's clock in microseconds when it was looked up
//! absent, and every takeover adds one. A record released (deleted) and taken again therefore
//! gets a fence no holder of its earlier life had — a stale executor's completion or release
//! never matches it — while a takeover (at least a lapsed lease later) stays below the clock.

use std::time::Duration;

use idem_core::{Begin, Error, ErrorKind, Fence, Fingerprint};

/// Longest idempotency key the requests tables hold (the HTTP layer's default is 255).
pub const MAX_REQUEST_KEY_LEN: usize = 1024;

/// `state` of a record an executor holds under its lease.
pub(crate) const IN_PROGRESS: i16 = 0;
/// `state` of a record with a stored result.
pub(crate) const COMPLETED: i16 = 1;

/// The longest lease or TTL a statement adds to the clock (100 years), so that `now + ttl`
/// cannot overflow a BIGINT whatever duration a caller configures.
const MAX_SPAN_MICROS: i64 = 100 * 365 * 86_400 * 1_000_000;

/// A lease or TTL in microseconds, as the statements bind it.
pub(crate) fn span(d: Duration) -> i64 {
    crate::common::micros(d).min(MAX_SPAN_MICROS)
}

/// How often a lookup starts over after losing a race before it reports a transient error.
/// Each retry follows a write by someone else, so a handful is plenty.
pub(crate) const MAX_ATTEMPTS: usize = 8;

/// The request statements of one store, for its requests table. Parameters are bound in the
/// order listed, then — on a store that stamps on the host (SQLite) — `now` last, which the
/// statement may use several times; on the servers the statements read the server's clock.
#[derive(Debug, Clone)]
pub(crate) struct RequestStatements {
    /// fingerprint, scope, key → always one row: fingerprint, state, fence, lease_until,
    /// expires_at (all NULL when there is no record), now, result (only for a completed record
    /// with this fingerprint).
    pub(crate) read: String,
    /// scope, key, fingerprint, fence, lease, ttl: a new record in progress; no row on a
    /// conflict (or a unique violation, which counts the same).
    pub(crate) insert: String,
    /// fingerprint, lease, ttl, scope, key, fence: an expired record started afresh.
    pub(crate) reset: String,
    /// lease, scope, key, fence: a lapsed lease taken over.
    pub(crate) take_over: String,
    /// result, ttl, scope, key, fence.
    pub(crate) complete: String,
    /// scope, key, fence (no `now`).
    pub(crate) release: String,
    /// lease, scope, key, fence.
    pub(crate) extend: String,
    /// limit.
    pub(crate) reap: String,
}

/// One record as `read` returns it.
pub(crate) type RecordRow = (
    Option<Vec<u8>>,
    Option<i16>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    i64,
    Option<Vec<u8>>,
);

/// What a lookup does next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Answer with this.
    Answer(Begin),
    /// No record: insert one with this fence (the clock when it was found absent).
    Insert { fence: i64 },
    /// An expired record with this fence: start it afresh (`takeover` if it was in progress).
    Reset { fence: i64, takeover: bool },
    /// A lapsed lease under this fence: take it over.
    TakeOver { fence: i64 },
}

/// Decides from what `read` found.
pub(crate) fn decide(row: RecordRow, fingerprint: &Fingerprint) -> Result<Next, Error> {
    let (stored_fp, state, fence, lease_until, expires_at, now, result) = row;
    let (Some(stored_fp), Some(state), Some(fence), Some(lease_until), Some(expires_at)) =
        (stored_fp, state, fence, lease_until, expires_at)
    else {
        return Ok(Next::Insert { fence: now.max(1) });
    };
    if state != IN_PROGRESS && state != COMPLETED {
        return Err(Error::new(
            ErrorKind::Store,
            format!("request record has unknown state {state}"),
        ));
    }
    let lapsed = lease_until <= now;
    // Past its TTL the record counts as absent — unless an executor still holds a live lease
    // on it (a long operation kept alive by its heartbeat), whose completion must not be
    // refused for outliving the TTL.
    if expires_at <= now && (state == COMPLETED || lapsed) {
        return Ok(Next::Reset {
            fence,
            takeover: state == IN_PROGRESS,
        });
    }
    if stored_fp.as_slice() != fingerprint.as_bytes().as_slice() {
        return Ok(Next::Answer(Begin::Mismatch));
    }
    if state == COMPLETED {
        let result = result.ok_or_else(|| {
            Error::new(ErrorKind::Store, "completed request record has no result")
        })?;
        return Ok(Next::Answer(Begin::Completed { result }));
    }
    if lapsed {
        return Ok(Next::TakeOver { fence });
    }
    let remaining = Duration::from_micros(u64::try_from(lease_until - now).unwrap_or(0));
    Ok(Next::Answer(Begin::InProgress {
        retry_after: idem_core::retry_after(remaining),
    }))
}

/// The fence after `fence`, as handed to the caller.
pub(crate) fn next_fence(fence: i64) -> Result<Fence, Error> {
    stored_fence(fence.saturating_add(1))
}

/// A stored fence as a [`Fence`].
pub(crate) fn stored_fence(fence: i64) -> Result<Fence, Error> {
    u64::try_from(fence).map(Fence).map_err(|_| {
        Error::new(
            ErrorKind::Store,
            format!("stored fence {fence} is negative"),
        )
    })
}

/// A [`Fence`] as bound; a fence no store handed out matches no row.
pub(crate) fn bound_fence(fence: Fence) -> i64 {
    i64::try_from(fence.0).unwrap_or(-1)
}

/// Whether a driver error is the unique violation of a lost insert race (MySQL has no
/// `ON CONFLICT DO NOTHING` that reports it through rows affected).
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// The error of a completion whose fence lost the record.
pub(crate) fn lease_lost(fence: Fence) -> Error {
    Error::new(
        ErrorKind::LeaseLost,
        format!(
            "the request record is no longer held by fence {} (its lease ran out and another \
             executor took it over, or it was released): completion refused; roll the \
             transaction back",
            fence.0
        ),
    )
}

/// Refuses a requests table that is the claims table.
pub(crate) fn check_distinct(
    claims: &crate::TableName,
    requests: &crate::TableName,
) -> Result<(), Error> {
    if claims == requests {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("the requests table and the claims table are both {claims}; name them apart"),
        ));
    }
    Ok(())
}

/// Implements `RequestStore` and `ReapRequests` for a store struct with fields `pool` and
/// `rsql` ([`RequestStatements`]) and an inherent `run_take_over(query)` that executes the
/// take-over statement and returns its rows affected, or `None` when it could not run without
/// waiting for another executor (SQLite's write lock). `$stamp` as for
/// `impl_sql_capabilities!`: `Some(now)` is bound last to every statement but `release`.
/// The first form also generates `run_take_over` as a plain execution on the pool; the second
/// (`…, custom_take_over`) expects the store to define it.
macro_rules! impl_request_capabilities {
    ($store:ty, $db:ty, $max_key_len:expr, $stamp:path) => {
        impl $store {
            /// Runs the take-over statement on the pool. A row lock it meets is the old
            /// executor's completion, about to commit, so waiting for it is short.
            async fn run_take_over<'q>(
                &self,
                q: sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>>,
            ) -> Result<Option<u64>, sqlx::Error> {
                q.execute(&self.pool).await.map(|r| Some(r.rows_affected()))
            }
        }

        $crate::requests::impl_request_capabilities!(
            $store,
            $db,
            $max_key_len,
            $stamp,
            custom_take_over
        );
    };
    ($store:ty, $db:ty, $max_key_len:expr, $stamp:path, custom_take_over) => {
        impl $store {
            fn request_now() -> Option<i64> {
                $stamp(idem_core::Stamp::StoreClock)
            }
        }

        impl idem_core::store::RequestStore for $store {
            fn max_key_len(&self) -> usize {
                $max_key_len
            }

            async fn begin_request(
                &self,
                key: &idem_core::RequestKey,
                fingerprint: &idem_core::Fingerprint,
                lease: std::time::Duration,
                ttl: std::time::Duration,
            ) -> Result<idem_core::Begin, idem_core::Error> {
                use $crate::requests::{Next, decide, is_unique_violation, next_fence};
                let err = |e| $crate::errors::store_error("beginning an idempotent request", e);
                let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
                let fp = &fingerprint.as_bytes()[..];
                let (lease, ttl) = ($crate::requests::span(lease), $crate::requests::span(ttl));
                for _ in 0..$crate::requests::MAX_ATTEMPTS {
                    let now = Self::request_now();
                    let mut q = sqlx::query_as::<$db, $crate::requests::RecordRow>(&self.rsql.read)
                        .bind(fp)
                        .bind(scope)
                        .bind(id);
                    if let Some(now) = now {
                        q = q.bind(now);
                    }
                    let row = q.fetch_one(&self.pool).await.map_err(err)?;
                    match decide(row, fingerprint)? {
                        Next::Answer(answer) => return Ok(answer),
                        Next::Insert { fence } => {
                            let mut q = sqlx::query::<$db>(&self.rsql.insert)
                                .bind(scope)
                                .bind(id)
                                .bind(fp)
                                .bind(fence)
                                .bind(lease)
                                .bind(ttl);
                            if let Some(now) = now {
                                q = q.bind(now);
                            }
                            let inserted = match q.execute(&self.pool).await {
                                Ok(r) => r.rows_affected() == 1,
                                Err(e) if is_unique_violation(&e) => false,
                                Err(e) => return Err(err(e)),
                            };
                            if inserted {
                                return Ok(idem_core::Begin::Acquired {
                                    fence: $crate::requests::stored_fence(fence)?,
                                    takeover: false,
                                });
                            }
                        }
                        Next::Reset { fence, takeover } => {
                            let mut q = sqlx::query::<$db>(&self.rsql.reset)
                                .bind(fp)
                                .bind(lease)
                                .bind(ttl)
                                .bind(scope)
                                .bind(id)
                                .bind(fence);
                            if let Some(now) = now {
                                q = q.bind(now);
                            }
                            if q.execute(&self.pool).await.map_err(err)?.rows_affected() == 1 {
                                return Ok(idem_core::Begin::Acquired {
                                    fence: next_fence(fence)?,
                                    takeover,
                                });
                            }
                        }
                        Next::TakeOver { fence } => {
                            let mut q = sqlx::query::<$db>(&self.rsql.take_over)
                                .bind(lease)
                                .bind(scope)
                                .bind(id)
                                .bind(fence);
                            if let Some(now) = now {
                                q = q.bind(now);
                            }
                            match self.run_take_over(q).await.map_err(err)? {
                                Some(1) => {
                                    return Ok(idem_core::Begin::Acquired {
                                        fence: next_fence(fence)?,
                                        takeover: true,
                                    });
                                }
                                Some(_) => {}
                                // The lease ran out, but its executor may still be writing:
                                // report it in progress rather than wait for it.
                                None => {
                                    return Ok(idem_core::Begin::InProgress {
                                        retry_after: idem_core::retry_after(
                                            std::time::Duration::ZERO,
                                        ),
                                    });
                                }
                            }
                        }
                    }
                }
                Err(idem_core::Error::new(
                    idem_core::ErrorKind::Transient,
                    "the request record kept changing under concurrent lookups; retry",
                ))
            }

            async fn complete_in(
                &self,
                tx: &mut Self::Tx,
                key: &idem_core::RequestKey,
                fence: idem_core::Fence,
                result: &[u8],
                ttl: std::time::Duration,
            ) -> Result<(), idem_core::Error> {
                let conn: &mut <$db as sqlx::Database>::Connection = tx;
                let mut q = sqlx::query::<$db>(&self.rsql.complete)
                    .bind(result)
                    .bind($crate::requests::span(ttl))
                    .bind(&key.scope.as_bytes()[..])
                    .bind(key.key.as_str().as_bytes())
                    .bind($crate::requests::bound_fence(fence));
                if let Some(now) = Self::request_now() {
                    q = q.bind(now);
                }
                let updated = q
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| {
                        $crate::errors::store_error("completing an idempotent request", e)
                    })?
                    .rows_affected();
                if updated == 1 {
                    Ok(())
                } else {
                    Err($crate::requests::lease_lost(fence))
                }
            }

            async fn release(
                &self,
                key: &idem_core::RequestKey,
                fence: idem_core::Fence,
            ) -> Result<(), idem_core::Error> {
                sqlx::query::<$db>(&self.rsql.release)
                    .bind(&key.scope.as_bytes()[..])
                    .bind(key.key.as_str().as_bytes())
                    .bind($crate::requests::bound_fence(fence))
                    .execute(&self.pool)
                    .await
                    .map(drop)
                    .map_err(|e| $crate::errors::store_error("releasing an idempotent request", e))
            }

            async fn extend_lease(
                &self,
                key: &idem_core::RequestKey,
                fence: idem_core::Fence,
                lease: std::time::Duration,
            ) -> Result<bool, idem_core::Error> {
                let mut q = sqlx::query::<$db>(&self.rsql.extend)
                    .bind($crate::requests::span(lease))
                    .bind(&key.scope.as_bytes()[..])
                    .bind(key.key.as_str().as_bytes())
                    .bind($crate::requests::bound_fence(fence));
                if let Some(now) = Self::request_now() {
                    q = q.bind(now);
                }
                q.execute(&self.pool)
                    .await
                    .map(|r| r.rows_affected() == 1)
                    .map_err(|e| $crate::errors::store_error("extending a request's lease", e))
            }
        }

        impl idem_core::store::ReapRequests for $store {
            async fn reap_batch(&self, limit: u32) -> Result<u64, idem_core::Error> {
                let mut q = sqlx::query::<$db>(&self.rsql.reap).bind(i64::from(limit));
                if let Some(now) = Self::request_now() {
                    q = q.bind(now);
                }
                q.execute(&self.pool)
                    .await
                    .map(|r| r.rows_affected())
                    .map_err(|e| $crate::errors::store_error("reaping expired requests", e))
            }
        }
    };
}

pub(crate) use impl_request_capabilities;

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000_000;

    fn row(fp: &Fingerprint, state: i16, lease_until: i64, expires_at: i64) -> RecordRow {
        let result = (state == COMPLETED).then(|| b"r".to_vec());
        let fp = Some(fp.as_bytes().to_vec());
        (
            fp,
            Some(state),
            Some(7),
            Some(lease_until),
            Some(expires_at),
            NOW,
            result,
        )
    }

    #[test]
    fn lookups_decide_by_state_fingerprint_lease_and_expiry() {
        let fp = Fingerprint::of(b"body");
        let other = Fingerprint::of(b"other");
        let later = NOW + 2_500_000;
        let absent = (None, None, None, None, None, NOW, None);
        assert_eq!(decide(absent, &fp).unwrap(), Next::Insert { fence: NOW });
        assert_eq!(
            decide(row(&fp, IN_PROGRESS, later, later), &fp).unwrap(),
            Next::Answer(Begin::InProgress {
                retry_after: Duration::from_secs(3)
            })
        );
        assert_eq!(
            decide(row(&other, IN_PROGRESS, later, later), &fp).unwrap(),
            Next::Answer(Begin::Mismatch)
        );
        assert_eq!(
            decide(row(&fp, COMPLETED, NOW, later), &fp).unwrap(),
            Next::Answer(Begin::Completed {
                result: b"r".to_vec()
            })
        );
        assert_eq!(
            decide(row(&fp, IN_PROGRESS, NOW, later), &fp).unwrap(),
            Next::TakeOver { fence: 7 }
        );
        // Expired: absent, whatever the fingerprint — unless a live lease still holds it.
        assert_eq!(
            decide(row(&other, COMPLETED, NOW, NOW), &fp).unwrap(),
            Next::Reset {
                fence: 7,
                takeover: false
            }
        );
        assert_eq!(
            decide(row(&fp, IN_PROGRESS, NOW - 1, NOW), &fp).unwrap(),
            Next::Reset {
                fence: 7,
                takeover: true
            }
        );
        assert!(matches!(
            decide(row(&fp, IN_PROGRESS, later, NOW), &fp).unwrap(),
            Next::Answer(Begin::InProgress { .. })
        ));
        let mut broken = row(&fp, 5, later, later);
        assert!(decide(broken.clone(), &fp).is_err());
        broken.1 = Some(COMPLETED);
        broken.6 = None;
        assert!(decide(broken, &fp).is_err());
    }

    #[test]
    fn fences_round_trip_and_unknown_ones_match_nothing() {
        assert_eq!(next_fence(1).unwrap(), Fence(2));
        assert!(stored_fence(-1).is_err());
        assert_eq!(bound_fence(Fence(u64::MAX)), -1);
    }
}
