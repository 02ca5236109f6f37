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
//! Fences: a new record's fence is the store's clock in microseconds when it was looked up
//! absent, and every takeover adds one. A record released (deleted) and taken again therefore
//! gets a fence no holder of its earlier life had — a stale executor's completion or release
//! never matches it — while a takeover (at least a lapsed lease later) stays below the clock.

use std::time::Duration;

use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{Begin, Error, ErrorKind, Fence, Fingerprint, RequestKey};

use crate::engine::{Engine, Param};
use crate::errors::store_error;
use crate::store::SqlStore;
use crate::tx::Tx;

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
pub struct RequestStatements {
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

impl<E: Engine> RequestStore for SqlStore<E> {
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
        let err = |e| store_error::<E>("beginning an idempotent request", e);
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fp = &fingerprint.as_bytes()[..];
        let (lease, ttl) = (Param::Int(span(lease)), Param::Int(span(ttl)));
        let (scope, id, fp) = (Param::Bytes(scope), Param::Bytes(id), Param::Bytes(fp));
        for _ in 0..MAX_ATTEMPTS {
            let now = Clocked::<E>::now();
            let row = E::fetch_record(&self.pool, &self.rsql.read, &now.params([fp, scope, id]))
                .await
                .map_err(err)?;
            match decide(row, fingerprint)? {
                Next::Answer(answer) => return Ok(answer),
                Next::Insert { fence } => {
                    let params = now.params([scope, id, fp, Param::Int(fence), lease, ttl]);
                    let inserted =
                        match E::execute_pool(&self.pool, &self.rsql.insert, &params).await {
                            Ok(rows) => rows == 1,
                            Err(e) if is_unique_violation(&e) => false,
                            Err(e) => return Err(err(e)),
                        };
                    if inserted {
                        return Ok(Begin::Acquired {
                            fence: stored_fence(fence)?,
                            takeover: false,
                        });
                    }
                }
                Next::Reset { fence, takeover } => {
                    let params = now.params([fp, lease, ttl, scope, id, Param::Int(fence)]);
                    let reset = E::execute_pool(&self.pool, &self.rsql.reset, &params)
                        .await
                        .map_err(err)?;
                    if reset == 1 {
                        return Ok(Begin::Acquired {
                            fence: next_fence(fence)?,
                            takeover,
                        });
                    }
                }
                Next::TakeOver { fence } => {
                    let params = now.params([lease, scope, id, Param::Int(fence)]);
                    match E::take_over(&self.pool, &self.rsql.take_over, &params)
                        .await
                        .map_err(err)?
                    {
                        Some(1) => {
                            return Ok(Begin::Acquired {
                                fence: next_fence(fence)?,
                                takeover: true,
                            });
                        }
                        Some(_) => {}
                        // The lease ran out, but its executor may still be writing: report it
                        // in progress rather than wait for it.
                        None => {
                            return Ok(Begin::InProgress {
                                retry_after: idem_core::retry_after(Duration::ZERO),
                            });
                        }
                    }
                }
            }
        }
        Err(Error::new(
            ErrorKind::Transient,
            "the request record kept changing under concurrent lookups; retry",
        ))
    }

    async fn complete_in(
        &self,
        tx: &mut Tx<E>,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let params = Clocked::<E>::now().params([
            Param::Bytes(result),
            Param::Int(span(ttl)),
            Param::Bytes(&key.scope.as_bytes()[..]),
            Param::Bytes(key.key.as_str().as_bytes()),
            Param::Int(bound_fence(fence)),
        ]);
        let updated = E::execute(tx, &self.rsql.complete, &params)
            .await
            .map_err(|e| store_error::<E>("completing an idempotent request", e))?;
        if updated == 1 {
            Ok(())
        } else {
            Err(lease_lost(fence))
        }
    }

    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let params = [
            Param::Bytes(&key.scope.as_bytes()[..]),
            Param::Bytes(key.key.as_str().as_bytes()),
            Param::Int(bound_fence(fence)),
        ];
        E::execute_pool(&self.pool, &self.rsql.release, &params)
            .await
            .map(drop)
            .map_err(|e| store_error::<E>("releasing an idempotent request", e))
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
        E::execute_pool(&self.pool, &self.rsql.extend, &params)
            .await
            .map(|rows| rows == 1)
            .map_err(|e| store_error::<E>("extending a request's lease", e))
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
