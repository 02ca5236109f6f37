//! Mapping librdkafka's errors onto idem's kinds, in idem's message style
//! (`Kafka: <what idem was doing>: <what librdkafka said>`).

use std::fmt::Display;

use idem_core::{Error, ErrorKind};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

const SYSTEM: &str = "Kafka";

/// The cluster is out of reach or refused a request for now: the runner backs off and retries.
pub(crate) fn unavailable(what: impl Display, e: KafkaError) -> Error {
    Error::from_system(ErrorKind::Unavailable, SYSTEM, what, e)
}

/// A record too large for the producer's `message.max.bytes` (checked before sending) or the
/// broker's (`MSG_SIZE_TOO_LARGE` in the delivery report) is [`ErrorKind::Rejected`]: it was
/// not written and never will be; anything else is [`ErrorKind::Unavailable`].
pub(crate) fn produce(what: impl Display, e: KafkaError) -> Error {
    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return Error::from_system(
            ErrorKind::Rejected,
            SYSTEM,
            format_args!("{what}: the record is too large"),
            e,
        );
    }
    unavailable(what, e)
}

/// librdkafka refused a setting (or the admin request built from it).
pub(crate) fn invalid_config(what: impl Display, e: KafkaError) -> Error {
    Error::from_system(ErrorKind::InvalidConfig, SYSTEM, what, e)
}

/// librdkafka hit a fatal error and stopped the client (a static member fenced by another
/// with the same ID): waiting does not help; an operator must.
pub(crate) fn fatal(what: impl Display, e: KafkaError) -> Error {
    Error::from_system(ErrorKind::Misconfigured, SYSTEM, what, e)
}
