//! The rules of an idempotent-request record in an SQL table, shared by every SQL store
//! (`idem-sql`'s engines, `idem-postgres`): the state values, the decision a lookup leads to
//! from what it read, and the fencing tokens. No database here: a store reads the row, asks
//! [`decide`], and writes with a statement guarded by what it read.
//!
//! Fences: a new record's fence is the store's clock in microseconds when it was looked up
//! absent, and every takeover adds one. A record released (deleted) and taken again therefore
//! gets a fence no holder of its earlier life had — a stale executor's completion or release
//! never matches it — while a takeover (at least a lapsed lease later) stays below the clock.

use std::time::Duration;

use crate::error::{Error, ErrorKind};
use crate::fingerprint::Fingerprint;
use crate::request::recovery::{Recovery, Resume};
use crate::request::{Begin, Fence, IdempotencyKey, RequestKey, RequestScope};

/// Longest idempotency key the requests tables hold (the HTTP layer's default is 255).
pub const MAX_REQUEST_KEY_LEN: usize = 1024;

/// `state` of a record an executor holds under its lease.
pub const IN_PROGRESS: i16 = 0;
/// `state` of a record with a stored result.
pub const COMPLETED: i16 = 1;
/// `state` of a record given up after its recovery points ran out of attempts: its stored
/// result (what the caller is told) replays like a completed one's.
pub const ABANDONED: i16 = 2;

/// The longest lease or TTL a statement adds to the clock (100 years), so that `now + ttl`
/// cannot overflow a BIGINT whatever duration a caller configures.
const MAX_SPAN_MICROS: i64 = 100 * 365 * 86_400 * 1_000_000;

/// A lease or TTL in microseconds, as the statements bind it.
pub fn span(d: Duration) -> i64 {
    i64::try_from(d.as_micros())
        .unwrap_or(i64::MAX)
        .min(MAX_SPAN_MICROS)
}

/// How often a lookup starts over after losing a race before it reports a transient error.
/// Each retry follows a write by someone else, so a handful is plenty.
pub const MAX_ATTEMPTS: usize = 8;

/// One record as `read` returns it: fingerprint, state, fence, lease_until, expires_at, now,
/// result, and 1 when it has a recovery point (else 0).
pub type RecordRow = (
    Option<Vec<u8>>,
    Option<i16>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    i64,
    Option<Vec<u8>>,
    i64,
);

/// One record as the recovery statements return it: scope, key, fence, recovery point,
/// phase state, attempts.
pub type RecoveryRow = (Vec<u8>, Vec<u8>, i64, Option<String>, Option<Vec<u8>>, i64);

/// Reads a [`RecoveryRow`] back: the record's key, its fence, and where it stands.
pub fn recovery_of(row: RecoveryRow) -> Result<(RequestKey, Fence, Recovery), Error> {
    let (scope, key, fence, point, state, attempts) = row;
    let scope = RequestScope::from_slice(&scope).ok_or_else(|| {
        Error::new(
            ErrorKind::Store,
            format!("stored request scope is {} bytes, expected 32", scope.len()),
        )
    })?;
    let key = std::str::from_utf8(&key)
        .ok()
        .and_then(|k| IdempotencyKey::quoted(k, MAX_REQUEST_KEY_LEN).ok())
        .ok_or_else(|| Error::new(ErrorKind::Store, "stored idempotency key is not a key"))?;
    let recovery = Recovery {
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        resume: point.map(|point| Resume {
            point,
            state: state.unwrap_or_default(),
        }),
    };
    Ok((RequestKey::new(scope, key), stored_fence(fence)?, recovery))
}

/// What a lookup does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Answer with this.
    Answer(Begin),
    /// No record: insert one.
    Insert {
        /// The new record's fence: the clock when it was found absent.
        fence: i64,
    },
    /// An expired record: start it afresh.
    Reset {
        /// The fence it has now; the reset is guarded by it.
        fence: i64,
        /// It was still in progress (its executor's lease lapsed): a takeover.
        takeover: bool,
    },
    /// A lapsed lease: take it over.
    TakeOver {
        /// The fence it has now; the takeover is guarded by it.
        fence: i64,
    },
}

/// The stored state a take was decided on: which take, and the fence it is guarded by (an
/// insert's fence is the clock, so not part of it). See [`Next::taking`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taking(u8, i64);

impl Next {
    /// The stored state this take is guarded by; `None` for an answer. A take that affected
    /// no row, followed by a read that decides the same take again, met a record another
    /// transaction holds uncommitted (a one-transaction execution's insert or take-over, which
    /// the take statements do not wait for): answer [`held_uncommitted`].
    pub fn taking(&self) -> Option<Taking> {
        match *self {
            Next::Answer(_) => None,
            Next::Insert { .. } => Some(Taking(0, 0)),
            Next::Reset { fence, .. } => Some(Taking(1, fence)),
            Next::TakeOver { fence } => Some(Taking(2, fence)),
        }
    }
}

/// The answer for a record another transaction holds uncommitted (see [`Next::taking`]): in
/// progress, asked again after a second.
pub fn held_uncommitted() -> Begin {
    Begin::InProgress {
        retry_after: crate::retry_after(Duration::ZERO),
    }
}

/// Decides from what `read` found.
pub fn decide(row: RecordRow, fingerprint: &Fingerprint) -> Result<Next, Error> {
    let (stored_fp, state, fence, lease_until, expires_at, now, result, has_point) = row;
    let (Some(stored_fp), Some(state), Some(fence), Some(lease_until), Some(expires_at)) =
        (stored_fp, state, fence, lease_until, expires_at)
    else {
        return Ok(Next::Insert { fence: now.max(1) });
    };
    if !matches!(state, IN_PROGRESS | COMPLETED | ABANDONED) {
        return Err(Error::new(
            ErrorKind::Store,
            format!("request record has unknown state {state}"),
        ));
    }
    let lapsed = lease_until <= now;
    let ended = state != IN_PROGRESS;
    // Past its TTL the record counts as absent — unless an executor still holds a live lease
    // on it (a long operation kept alive by its heartbeat), whose completion must not be
    // refused for outliving the TTL, or it has a recovery point: phases committed, so it
    // resumes (is taken over) however late, never starts afresh.
    if expires_at <= now && (ended || (lapsed && has_point == 0)) {
        return Ok(Next::Reset {
            fence,
            takeover: state == IN_PROGRESS,
        });
    }
    if stored_fp.as_slice() != fingerprint.as_bytes().as_slice() {
        return Ok(Next::Answer(Begin::Mismatch));
    }
    if ended {
        let result = result
            .ok_or_else(|| Error::new(ErrorKind::Store, "ended request record has no result"))?;
        return Ok(Next::Answer(Begin::Completed { result }));
    }
    if lapsed {
        return Ok(Next::TakeOver { fence });
    }
    let remaining = Duration::from_micros(u64::try_from(lease_until - now).unwrap_or(0));
    Ok(Next::Answer(Begin::InProgress {
        retry_after: crate::retry_after(remaining),
    }))
}

/// The fence after `fence`, as handed to the caller.
pub fn next_fence(fence: i64) -> Result<Fence, Error> {
    stored_fence(fence.saturating_add(1))
}

/// A stored fence as a [`Fence`].
pub fn stored_fence(fence: i64) -> Result<Fence, Error> {
    u64::try_from(fence).map(Fence).map_err(|_| {
        Error::new(
            ErrorKind::Store,
            format!("stored fence {fence} is negative"),
        )
    })
}

/// A [`Fence`] as bound; a fence no store handed out matches no row.
pub fn bound_fence(fence: Fence) -> i64 {
    i64::try_from(fence.0).unwrap_or(-1)
}

/// The error of a completion whose fence lost the record.
pub fn lease_lost(fence: Fence) -> Error {
    Error::new(
        ErrorKind::Request(crate::RequestErrorKind::LeaseLost),
        format!(
            "the request record is no longer held by fence {} (its lease ran out and another \
             executor took it over, or it was released): completion refused; roll the \
             transaction back",
            fence.0
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000_000;

    fn row(fp: &Fingerprint, state: i16, lease_until: i64, expires_at: i64) -> RecordRow {
        let result = (state != IN_PROGRESS).then(|| b"r".to_vec());
        let fp = Some(fp.as_bytes().to_vec());
        (
            fp,
            Some(state),
            Some(7),
            Some(lease_until),
            Some(expires_at),
            NOW,
            result,
            0,
        )
    }

    #[test]
    fn lookups_decide_by_state_fingerprint_lease_and_expiry() {
        let fp = Fingerprint::of(b"body");
        let other = Fingerprint::of(b"other");
        let later = NOW + 2_500_000;
        let absent = (None, None, None, None, None, NOW, None, 0);
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
        // Abandoned replays its result; a record with a recovery point past its TTL is taken
        // over, never reset.
        assert_eq!(
            decide(row(&fp, ABANDONED, NOW, later), &fp).unwrap(),
            Next::Answer(Begin::Completed {
                result: b"r".to_vec()
            })
        );
        let mut with_point = row(&fp, IN_PROGRESS, NOW - 1, NOW);
        with_point.7 = 1;
        assert_eq!(
            decide(with_point, &fp).unwrap(),
            Next::TakeOver { fence: 7 }
        );
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
