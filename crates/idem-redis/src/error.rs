//! Classification of Redis errors into idem's kinds, by the error's kind and code rather than
//! its text, in idem's message style (`Redis: <what idem was doing>: <what Redis said>`).

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
