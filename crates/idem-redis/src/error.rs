//! Classification of Redis errors into idem's kinds, by the error's kind and code rather than
//! its text.

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

/// An idem error for a failed `what`.
pub(crate) fn redis_error(what: &str, e: RedisError) -> Error {
    Error::new(kind_of(&e), format!("redis {what} failed: {e}")).with_source(e)
}

/// A reply this crate's scripts never send: a version skew or someone else's data.
pub(crate) fn unexpected(what: &str, reply: &redis::Value) -> Error {
    Error::new(
        ErrorKind::Store,
        format!("unexpected reply from redis to {what}: {reply:?}"),
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
}
