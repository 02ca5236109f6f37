//! Mapping lapin's errors onto idem's kinds: every broker failure is `Unavailable`, so the
//! runner backs off and the source reconnects; bad configuration is `InvalidConfig`.

use std::fmt::Display;

use idem_core::{BoxError, Error, ErrorKind};

const SYSTEM: &str = "AMQP";

/// A broker-side failure while doing `what`: lapin's error, or the broker's own answer (a
/// nack, a returned message) when it sent no error.
pub(crate) fn unavailable(what: impl Display, e: impl Into<BoxError>) -> Error {
    Error::from_system(ErrorKind::Unavailable, SYSTEM, what, e)
}

/// A broker that did not answer in time, or a session idem gave up on: `Unavailable`, so the
/// runner backs off and the source reconnects.
pub(crate) fn broker(message: String) -> Error {
    Error::new(ErrorKind::Unavailable, message)
}

/// A name or URL the broker would refuse whatever its state.
pub(crate) fn config(message: String) -> Error {
    Error::new(ErrorKind::InvalidConfig, message)
}

/// AMQP names (queues, exchanges, routing keys) are short strings: at most 255 bytes.
pub(crate) fn short_string(what: &str, s: &str) -> Result<lapin::types::ShortString, Error> {
    lapin::types::ShortString::try_new(s).map_err(|e| {
        config(format!(
            "{what} {s:?} is not a valid AMQP short string: {e}"
        ))
    })
}
