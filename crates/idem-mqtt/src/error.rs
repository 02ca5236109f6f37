//! Mapping rumqttc's errors and the broker's refusals onto idem's kinds, in idem's message
//! style (`MQTT: <what idem was doing>: <what the broker or client said>`).

use std::fmt::Display;

use idem_core::{BoxError, Error, ErrorKind};

const SYSTEM: &str = "MQTT";

/// A connection that failed or a request the broker did not take: the runner backs off and
/// retries (rumqttc reconnects on the next poll).
pub(crate) fn unavailable(what: impl Display, e: impl Into<BoxError>) -> Error {
    Error::from_system(ErrorKind::Unavailable, SYSTEM, what, e)
}

/// Something the broker refused whatever its state (a subscription it does not grant).
pub(crate) fn refused(what: impl Display, reason: impl Into<BoxError>) -> Error {
    Error::from_system(ErrorKind::InvalidConfig, SYSTEM, what, reason)
}

/// A value idem refuses before it reaches the broker.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidConfig, msg.into())
}
