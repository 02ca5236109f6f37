//! Mapping lapin's errors onto idem's kinds: every broker failure is `Unavailable`, so the
//! runner backs off and the source reconnects; bad configuration is `InvalidConfig`.

use idem_core::{Error, ErrorKind};

/// A broker-side failure while doing `what`.
pub(crate) fn unavailable(what: &str, e: lapin::Error) -> Error {
    Error::new(ErrorKind::Unavailable, format!("AMQP {what} failed: {e}")).with_source(e)
}

/// A broker-side failure without an underlying lapin error (timeouts, nacks, returns).
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
            "AMQP {what} {s:?} is not a valid short string: {e}"
        ))
    })
}
