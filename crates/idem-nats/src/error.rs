//! Turning async-nats errors into idem's error kinds, in idem's message style
//! (`NATS: <what idem was doing>: <what the server or client said>`).

use std::fmt::{Debug, Display};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::stream::ConsumerErrorKind;
use idem_core::{Error, ErrorKind};

const SYSTEM: &str = "NATS";

/// The broker is out of reach or did not answer in time: the runner backs off and retries.
pub(crate) fn unavailable<E>(what: &str, err: E) -> Error
where
    E: Into<async_nats::Error>,
{
    Error::from_system(ErrorKind::Unavailable, SYSTEM, what, err.into())
}

/// An error kind that can say "the server understood and refused", as opposed to "the server
/// could not be reached".
pub(crate) trait Refusal {
    /// Retrying the same request cannot succeed: a missing stream, a rejected config.
    fn refused(&self) -> bool;
}

impl Refusal for ConsumerErrorKind {
    fn refused(&self) -> bool {
        matches!(
            self,
            ConsumerErrorKind::JetStream(_)
                | ConsumerErrorKind::InvalidName
                | ConsumerErrorKind::InvalidConsumerType
        )
    }
}

impl Refusal for GetStreamErrorKind {
    fn refused(&self) -> bool {
        !matches!(self, GetStreamErrorKind::Request)
    }
}

impl Refusal for CreateStreamErrorKind {
    fn refused(&self) -> bool {
        !matches!(
            self,
            CreateStreamErrorKind::JetStreamUnavailable
                | CreateStreamErrorKind::TimedOut
                | CreateStreamErrorKind::Response
                | CreateStreamErrorKind::ResponseParse
        )
    }
}

impl Refusal for PublishErrorKind {
    fn refused(&self) -> bool {
        matches!(
            self,
            PublishErrorKind::StreamNotFound
                | PublishErrorKind::MaxPayloadExceeded
                | PublishErrorKind::WrongLastMessageId
                | PublishErrorKind::WrongLastSequence
        )
    }
}

/// A JetStream API error: [`ErrorKind::InvalidConfig`] when the server refused, otherwise
/// [`ErrorKind::Unavailable`].
pub(crate) fn api<K>(what: &str, err: async_nats::error::Error<K>) -> Error
where
    K: Refusal + Clone + Debug + Display + PartialEq + Send + Sync + 'static,
{
    let kind = if err.kind().refused() {
        ErrorKind::InvalidConfig
    } else {
        ErrorKind::Unavailable
    };
    Error::from_system(kind, SYSTEM, what, err)
}

/// A publish the server or client refused: a message too large for it (over the server's
/// `max_payload`, headers over JetStream's 64 KiB, over the stream's `max_msg_size`) is
/// [`ErrorKind::Rejected`]: this message can never be published, whatever is retried or
/// reconfigured. The rest as [`api`].
pub(crate) fn publish(what: &str, err: async_nats::error::Error<PublishErrorKind>) -> Error {
    if too_large(&err) {
        return Error::from_system(ErrorKind::Rejected, SYSTEM, what, err);
    }
    api(what, err)
}

fn too_large(err: &async_nats::error::Error<PublishErrorKind>) -> bool {
    if err.kind() == PublishErrorKind::MaxPayloadExceeded {
        return true;
    }
    std::error::Error::source(err)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|e| {
            matches!(
                e.error_code(),
                ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
                    | ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
            )
        })
}

/// A value idem refuses before it reaches the broker.
pub(crate) fn invalid_config(message: String) -> Error {
    Error::new(ErrorKind::InvalidConfig, message)
}
