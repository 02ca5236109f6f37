//! Idempotent requests: the API half of the pattern, with no HTTP in it.
//!
//! A client that retries an operation with the same [`IdempotencyKey`] must get the first
//! execution's result back instead of a second execution. The record of one operation lives
//! under a [`RequestKey`] — a [`RequestScope`] (whose operation: the principal, the route…)
//! and the client's key — and holds the request's [`Fingerprint`], its state and an expiry:
//!
//! - **in progress**: taken by one executor under a lease and a fencing token ([`Fence`]); a
//!   retry meanwhile is told so at once ([`Begin::InProgress`]), and a lease that runs out (the
//!   executor crashed) can be taken over, bumping the token so that the old executor's late
//!   completion is refused;
//! - **completed**: the stored result, replayed to every retry until the record expires;
//! - **abandoned**: an operation of phases given up (see [`Recovery`]): its stored result
//!   replays the same way.
//!
//! Stores implement [`RequestStore`](crate::store::RequestStore); SQL stores complete the
//! record inside the transaction that carries the operation's writes, so the effect and the
//! stored result commit together or not at all. PostgreSQL and MariaDB can also *take* it in
//! that transaction ([`BeginIn`], the one-transaction mode): one commit per first execution,
//! no lease, and a crash rolls the take back with everything else.

mod error;
mod key;
pub mod record;
pub(crate) mod recovery;
pub(crate) mod store;

pub use error::{RequestAction, RequestErrorKind};
pub use key::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN, RequestKey, RequestScope};
pub use recovery::{Recovery, Resume, Stuck};

use std::time::Duration;

/// The fencing token of one holder of a record: it grows on every takeover, and completion or
/// release by an older token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub u64);

/// What [`begin_request`](crate::store::RequestStore::begin_request) found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Begin {
    /// The caller holds the record now: run the operation, then complete or release it with
    /// this token. `takeover` is true when an earlier holder's lease had run out.
    Acquired {
        /// The caller's fencing token.
        fence: Fence,
        /// Whether this took over a record whose lease had expired.
        takeover: bool,
    },
    /// Another executor holds a live lease on the record.
    InProgress {
        /// Until its lease runs out (at least one second, rounded up).
        retry_after: Duration,
    },
    /// The operation completed earlier; here is what it stored.
    Completed {
        /// The stored result, byte for byte.
        result: Vec<u8>,
    },
    /// A record under this key holds a different request fingerprint: the client reused a
    /// key for a different request. The record is left untouched.
    Mismatch,
}

/// What [`begin_request_in`](crate::store::RequestStore::begin_request_in) found: the record
/// taken inside a transaction of the operation's, or the same answers as [`Begin`].
///
/// Taken this way, the record is not committed until the operation's transaction is: its
/// effect, the record and the stored result commit once, and a crash (a killed process, a
/// dropped connection) rolls all of it back, which frees the key by itself. A concurrent
/// lookup meanwhile is answered [`Begin::InProgress`] at once (the store holds a lock it does
/// not wait for), never made to wait.
#[non_exhaustive]
pub enum BeginIn<Tx> {
    /// The store cannot take a record inside a transaction (SQLite, whose one write lock
    /// would be held for the whole operation; Redis, which shares no transaction): use
    /// [`begin_request`](crate::store::RequestStore::begin_request), the leased mode.
    Unsupported,
    /// The caller holds the record, uncommitted, in `tx`: run the operation through `tx`,
    /// then complete the record in it and commit, or roll back to free the key.
    Acquired {
        /// The caller's fencing token, as [`Begin::Acquired`]'s.
        fence: Fence,
        /// Whether this took over a record whose lease had run out.
        takeover: bool,
        /// The transaction holding the record.
        tx: Tx,
    },
    /// Any other answer ([`Begin::Completed`], [`Begin::InProgress`], [`Begin::Mismatch`]);
    /// no transaction is left open.
    Answer(Begin),
}

// By hand: a transaction need not be `Debug`.
impl<Tx> std::fmt::Debug for BeginIn<Tx> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unsupported => f.write_str("Unsupported"),
            Self::Acquired {
                fence, takeover, ..
            } => f
                .debug_struct("Acquired")
                .field("fence", fence)
                .field("takeover", takeover)
                .finish_non_exhaustive(),
            Self::Answer(answer) => f.debug_tuple("Answer").field(answer).finish(),
        }
    }
}

/// Rounds a remaining lease up to whole seconds, at least one: what `Retry-After` carries.
pub fn retry_after(remaining: Duration) -> Duration {
    let secs = remaining.as_secs() + u64::from(remaining.subsec_nanos() > 0);
    Duration::from_secs(secs.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_whole_seconds_and_at_least_one() {
        assert_eq!(retry_after(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(
            retry_after(Duration::from_millis(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            retry_after(Duration::from_millis(1001)),
            Duration::from_secs(2)
        );
        assert_eq!(retry_after(Duration::from_secs(3)), Duration::from_secs(3));
    }
}
