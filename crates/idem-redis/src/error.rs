//! Classification of Redis errors into idem's kinds, by the error's kind and code rather than
//! its text, in idem's message style (`Redis: <what idem was doing>: <what Redis said>`).

use std::fmt;
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use redis::{RedisError, ServerErrorKind};

/// What a failed command means for the caller.
pub(crate) fn kind_of(e: &RedisError) -> ErrorKind {
    use redis::ErrorKind as K;
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return ErrorKind::Unavailable;
    }
    match e.kind() {
        // Up but refusing work for now: loading a dump, a failover in progress (a write on a
        // demoted primary), a cluster reconfiguring.
        K::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly,
        )
        | K::ClusterConnectionNotFound => ErrorKind::Unavailable,
        K::AuthenticationFailed
        | K::Server(ServerErrorKind::NoPerm | ServerErrorKind::CrossSlot) => {
            ErrorKind::Misconfigured
        }
        K::InvalidClientConfig => ErrorKind::InvalidConfig,
        _ => match e.code() {
            // Out of memory under `maxmemory`, a long script blocking the server, writes
            // refused after a failed RDB save: wait it out.
            Some("OOM" | "BUSY" | "MISCONF") => ErrorKind::Unavailable,
            // Something else lives under this store's key names, or the user lacks rights:
            // every request would fail the same way.
            Some("WRONGTYPE" | "NOAUTH" | "WRONGPASS") => ErrorKind::Misconfigured,
            _ => ErrorKind::Store,
        },
    }
}

/// The name every error Redis reported starts with.
pub(crate) const SYSTEM: &str = "Redis";

/// An idem error for a failed `what`.
pub(crate) fn redis_error(what: &str, e: RedisError) -> Error {
    Error::from_system(kind_of(&e), SYSTEM, what, e)
}

/// A reply this crate's scripts never send: a version skew or someone else's data.
pub(crate) fn unexpected(what: &str, reply: &redis::Value) -> Error {
    Error::from_system(
        ErrorKind::Store,
        SYSTEM,
        what,
        format!("unexpected reply {reply:?}"),
    )
}

/// Which write fewer replicas than asked acknowledged in time (see [`ReplicasNotConfirmed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnconfirmedWrite {
    /// Taking a record (new, or a takeover). The store released the record again before
    /// failing with [`ErrorKind::Unavailable`]: nothing ran and the key is free, so a retry
    /// later takes it anew.
    Take,
    /// Completing a record. The result **is stored on the primary**; the store fails with
    /// [`ErrorKind::OutcomeUnknown`] because a failover before the replicas catch up would
    /// lose it. A retry replays it from the primary, or, after such a failover, runs the
    /// operation again.
    Complete,
}

/// The source of the error when, with
/// [`wait_for_replicas`](crate::RedisRequestStoreBuilder::wait_for_replicas), fewer replicas
/// than asked acknowledged a take or a completion within the timeout (`WAIT` answered with a
/// smaller count). Find it with [`ReplicasNotConfirmed::of`]; the error's kind already says
/// what to do (see [`UnconfirmedWrite`]).
///
/// ```
/// # fn handle(err: idem_core::Error) {
/// use idem_redis::{ReplicasNotConfirmed, UnconfirmedWrite};
///
/// if let Some(why) = ReplicasNotConfirmed::of(&err) {
///     eprintln!(
///         "{} of {} replicas confirmed the {:?} in {:?}",
///         why.acknowledged(), why.asked(), why.write(), why.timeout()
///     );
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicasNotConfirmed {
    write: UnconfirmedWrite,
    asked: usize,
    acknowledged: usize,
    timeout: Duration,
}

impl ReplicasNotConfirmed {
    pub(crate) fn new(
        write: UnconfirmedWrite,
        asked: usize,
        acknowledged: usize,
        timeout: Duration,
    ) -> Self {
        Self {
            write,
            asked,
            acknowledged,
            timeout,
        }
    }

    /// The `ReplicasNotConfirmed` in `error`'s chain of sources, if there is one.
    pub fn of<'e>(error: &'e (dyn std::error::Error + 'static)) -> Option<&'e Self> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<Self>() {
                return Some(found);
            }
            next = e.source();
        }
        None
    }

    /// The write that was not confirmed.
    pub fn write(&self) -> UnconfirmedWrite {
        self.write
    }

    /// How many replicas the store waits for.
    pub fn asked(&self) -> usize {
        self.asked
    }

    /// How many acknowledged within [`timeout`](Self::timeout).
    pub fn acknowledged(&self) -> usize {
        self.acknowledged
    }

    /// How long the store waited.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl fmt::Display for ReplicasNotConfirmed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.write {
            UnconfirmedWrite::Take => "taking the record",
            UnconfirmedWrite::Complete => "completing the record",
        };
        write!(
            f,
            "{} of {} Redis replicas acknowledged {what} within {:?}",
            self.acknowledged, self.asked, self.timeout
        )
    }
}

impl std::error::Error for ReplicasNotConfirmed {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_and_server_states_are_classified() {
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        assert_eq!(kind_of(&io), ErrorKind::Unavailable);
        let read_only = RedisError::from((
            redis::ErrorKind::Server(ServerErrorKind::ReadOnly),
            "READONLY You can't write against a read only replica.",
        ));
        assert_eq!(kind_of(&read_only), ErrorKind::Unavailable);
        let auth = RedisError::from((redis::ErrorKind::AuthenticationFailed, "bad password"));
        assert_eq!(kind_of(&auth), ErrorKind::Misconfigured);
        let other = RedisError::from((
            redis::ErrorKind::Server(ServerErrorKind::ResponseError),
            "ERR something",
        ));
        assert_eq!(kind_of(&other), ErrorKind::Store);
    }

    #[test]
    fn messages_start_with_the_system_and_say_what_idem_was_doing() {
        let refused = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        let err = redis_error("begin request", refused);
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        assert!(
            err.to_string().starts_with("Redis: begin request: "),
            "{err}"
        );
        let err = unexpected("the begin script", &redis::Value::Int(7));
        assert_eq!(err.kind(), ErrorKind::Store);
        assert_eq!(
            err.to_string(),
            "Redis: the begin script: unexpected reply int(7)"
        );
    }
}
