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

use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{Begin, Error, ErrorKind, Fence, Fingerprint, RequestKey};
use tokio_postgres::types::ToSql;

use crate::errors::store_error;
use crate::store::PgStore;
use crate::tx::PgTx;

/// Longest idempotency key the requests table holds (the HTTP layer's default is 255).
pub const MAX_REQUEST_KEY_LEN: usize = 1024;

/// `state` of a record an executor holds under its lease.
const IN_PROGRESS: i16 = 0;
/// `state` of a record with a stored result.
const COMPLETED: i16 = 1;

/// The longest lease or TTL a statement adds to the clock (100 years), so that `now + ttl`
/// cannot overflow a BIGINT whatever duration a caller configures.
const MAX_SPAN_MICROS: i64 = 100 * 365 * 86_400 * 1_000_000;

/// How often a lookup starts over after losing a race before it reports a transient error.
/// Each retry follows a write by someone else, so a handful is plenty.
const MAX_ATTEMPTS: usize = 8;

/// A lease or TTL in microseconds, as the statements bind it.
fn span(d: Duration) -> i64 {
    i64::try_from(d.as_micros())
        .unwrap_or(i64::MAX)
        .min(MAX_SPAN_MICROS)
}

/// One record as the `read` statement returns it (all `None` but `now` when absent).
#[derive(Debug)]
struct Record {
    fingerprint: Option<Vec<u8>>,
    state: Option<i16>,
    fence: Option<i64>,
    lease_until: Option<i64>,
    expires_at: Option<i64>,
    now: i64,
    result: Option<Vec<u8>>,
}

impl Record {
    fn from_row(r: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            fingerprint: r.try_get(0)?,
            state: r.try_get(1)?,
            fence: r.try_get(2)?,
            lease_until: r.try_get(3)?,
            expires_at: r.try_get(4)?,
            now: r.try_get(5)?,
            result: r.try_get(6)?,
        })
    }
}

/// What a lookup does next.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Answer with this.
    Answer(Begin),
    /// No record: insert one with this fence (the clock when it was found absent).
    Insert { fence: i64 },
    /// An expired record with this fence: start it afresh (`takeover` if it was in progress).
    Reset { fence: i64, takeover: bool },
    /// A lapsed lease under this fence: take it over.
    TakeOver { fence: i64 },
}

/// Decides from what `read` found: the rules of `idem-sql`'s request records, which this store
/// shares its table with.
fn decide(row: Record, fingerprint: &Fingerprint) -> Result<Next, Error> {
    let Record {
        fingerprint: stored_fp,
        state,
        fence,
        lease_until,
        expires_at,
        now,
        result,
    } = row;
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

/// A stored fence as a [`Fence`].
fn stored_fence(fence: i64) -> Result<Fence, Error> {
    u64::try_from(fence).map(Fence).map_err(|_| {
        Error::new(
            ErrorKind::Store,
            format!("stored fence {fence} is negative"),
        )
    })
}

/// The fence after `fence`, as handed to the caller.
fn next_fence(fence: i64) -> Result<Fence, Error> {
    stored_fence(fence.saturating_add(1))
}

/// A [`Fence`] as bound; a fence no store handed out matches no row.
fn bound_fence(fence: Fence) -> i64 {
    i64::try_from(fence.0).unwrap_or(-1)
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
        let what = "beginning an idempotent request";
        let err = |e| store_error(what, e);
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fp = &fingerprint.as_bytes()[..];
        let (lease, ttl) = (span(lease), span(ttl));
        // One connection for the whole lookup; each statement commits on its own.
        let conn = self.lease().await?;
        let client = conn.client();
        let read = conn.prepare(&self.rsql.read).await.map_err(err)?;
        for _ in 0..MAX_ATTEMPTS {
            let row = client
                .query_one(&read, &[&fp, &scope, &id])
                .await
                .map_err(err)?;
            let record = Record::from_row(&row).map_err(err)?;
            match decide(record, fingerprint)? {
                Next::Answer(answer) => return Ok(answer),
                Next::Insert { fence } => {
                    let insert = conn.prepare(&self.rsql.insert).await.map_err(err)?;
                    let params: [&(dyn ToSql + Sync); 6] = [&scope, &id, &fp, &fence, &lease, &ttl];
                    if client.execute(&insert, &params).await.map_err(err)? == 1 {
                        return Ok(Begin::Acquired {
                            fence: stored_fence(fence)?,
                            takeover: false,
                        });
                    }
                }
                Next::Reset { fence, takeover } => {
                    let reset = conn.prepare(&self.rsql.reset).await.map_err(err)?;
                    let params: [&(dyn ToSql + Sync); 6] = [&fp, &lease, &ttl, &scope, &id, &fence];
                    if client.execute(&reset, &params).await.map_err(err)? == 1 {
                        return Ok(Begin::Acquired {
                            fence: next_fence(fence)?,
                            takeover,
                        });
                    }
                }
                Next::TakeOver { fence } => {
                    // A row lock it meets is the old executor's completion about to commit,
                    // so waiting is short.
                    let take_over = conn.prepare(&self.rsql.take_over).await.map_err(err)?;
                    let params: [&(dyn ToSql + Sync); 4] = [&lease, &scope, &id, &fence];
                    if client.execute(&take_over, &params).await.map_err(err)? == 1 {
                        return Ok(Begin::Acquired {
                            fence: next_fence(fence)?,
                            takeover: true,
                        });
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
        tx: &mut PgTx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let err = |e| store_error("completing an idempotent request", e);
        let complete = tx.prepare_cached(&self.rsql.complete).await.map_err(err)?;
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let (ttl, fence_bound) = (span(ttl), bound_fence(fence));
        let params: [&(dyn ToSql + Sync); 5] = [&result, &ttl, &scope, &id, &fence_bound];
        if tx.execute(&complete, &params).await.map_err(err)? == 1 {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::LeaseLost,
                format!(
                    "the request record is no longer held by fence {} (its lease ran out and \
                     another executor took it over, or it was released): completion refused; \
                     roll the transaction back",
                    fence.0
                ),
            ))
        }
    }

    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let (scope, id) = (&key.scope.as_bytes()[..], key.key.as_str().as_bytes());
        let fence = bound_fence(fence);
        self.execute_alone(
            "releasing an idempotent request",
            &self.rsql.release,
            &[&scope, &id, &fence],
        )
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

impl ReapRequests for PgStore {
    async fn reap_batch(&self, limit: u32) -> Result<u64, Error> {
        let limit = i64::from(limit);
        self.execute_alone("reaping expired requests", &self.rsql.reap, &[&limit])
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000_000;

    fn row(fp: &Fingerprint, state: i16, lease_until: i64, expires_at: i64) -> Record {
        Record {
            fingerprint: Some(fp.as_bytes().to_vec()),
            state: Some(state),
            fence: Some(7),
            lease_until: Some(lease_until),
            expires_at: Some(expires_at),
            now: NOW,
            result: (state == COMPLETED).then(|| b"r".to_vec()),
        }
    }

    #[test]
    fn lookups_decide_by_state_fingerprint_lease_and_expiry() {
        let fp = Fingerprint::of(b"body");
        let other = Fingerprint::of(b"other");
        let later = NOW + 2_500_000;
        let absent = Record {
            fingerprint: None,
            state: None,
            fence: None,
            lease_until: None,
            expires_at: None,
            now: NOW,
            result: None,
        };
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
        assert_eq!(
            decide(row(&other, COMPLETED, NOW, NOW), &fp).unwrap(),
            Next::Reset {
                fence: 7,
                takeover: false
            }
        );
        assert!(matches!(
            decide(row(&fp, IN_PROGRESS, later, NOW), &fp).unwrap(),
            Next::Answer(Begin::InProgress { .. })
        ));
        let mut broken = row(&fp, 5, later, later);
        assert!(decide(broken, &fp).is_err());
        broken = row(&fp, COMPLETED, later, later);
        broken.result = None;
        assert!(decide(broken, &fp).is_err());
    }

    #[test]
    fn fences_round_trip_and_unknown_ones_match_nothing() {
        assert_eq!(next_fence(1).unwrap(), Fence(2));
        assert!(stored_fence(-1).is_err());
        assert_eq!(bound_fence(Fence(u64::MAX)), -1);
    }
}
