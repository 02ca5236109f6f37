//! Mapping redis-rs errors onto idem's kinds, in idem's message style
//! (`Redis: <what idem was doing>: <what the server or client said>`).

use std::fmt::Display;

use idem_core::{Error, ErrorKind};

const SYSTEM: &str = "Redis";

/// A command that failed or a server out of reach: the runner backs off and retries (the
/// connections reconnect by themselves).
pub(crate) fn unavailable(what: impl Display, e: redis::RedisError) -> Error {
    Error::from_system(ErrorKind::Unavailable, SYSTEM, what, e)
}

/// A URL redis-rs cannot parse; shown without its password.
pub(crate) fn invalid_url(url: &str, e: redis::RedisError) -> Error {
    Error::from_system(
        ErrorKind::InvalidConfig,
        SYSTEM,
        format_args!("parsing the URL {}", idem_redact::redact_url(url)),
        e,
    )
}
