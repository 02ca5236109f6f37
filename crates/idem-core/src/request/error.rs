//! The request API's own error kinds, and the one answer to "what now?" that every caller of it
//! shares — idem-http and idem-actix (which status to answer), `Idempotency::call` (what its
//! caller does with the error).

use std::time::Duration;

use crate::{Error, ErrorKind};

/// What went wrong that only an idempotent request can say: an [`Error`] of
/// [`ErrorKind::Request`] carries one ([`Error::request_kind`]). The store's own failures
/// (busy, unavailable, misconfigured) keep their [`ErrorKind`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestErrorKind {
    /// An idempotency key that is empty, too long or not visible ASCII. A client error.
    InvalidKey,
    /// An execution with this idempotency key is still running elsewhere; ask again after
    /// [`Error::retry_after`].
    InProgress,
    /// The idempotency key was already used for a different request (another fingerprint).
    KeyReused,
    /// This executor's lease on a request record was taken over after it ran out; its
    /// completion was refused and its writes rolled back.
    LeaseLost,
}

/// What the caller of an idempotent request should do after an error: the one mapping the
/// HTTP integrations and [`Idempotency::call`](https://docs.rs/idem-request) share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestAction {
    /// Try again with the same key, after a backoff: nothing was stored (the store was busy
    /// or out of reach, the operation failed and rolled back), or a takeover's result is being
    /// stored (the lease was lost) and the retry gets it.
    Retry,
    /// Ask again with the same key after the hint: an execution with it is still running.
    Wait(Option<Duration>),
    /// Do not send this request again as it is: the key is invalid or was used for another
    /// request, or the service is misconfigured and needs an operator.
    GiveUp,
}

impl RequestAction {
    /// What to do after `error`, from its kind.
    pub fn of(error: &Error) -> Self {
        match error.kind() {
            ErrorKind::Request(RequestErrorKind::InProgress) => Self::Wait(error.retry_after()),
            ErrorKind::Request(RequestErrorKind::InvalidKey | RequestErrorKind::KeyReused)
            | ErrorKind::InvalidConfig
            | ErrorKind::Misconfigured
            | ErrorKind::InvalidMessageId
            | ErrorKind::Rejected => Self::GiveUp,
            _ => Self::Retry,
        }
    }
}

impl Error {
    /// A request error of `kind` with a human-readable message.
    pub fn request(
        kind: RequestErrorKind,
        message: impl Into<std::borrow::Cow<'static, str>>,
    ) -> Self {
        Self::new(ErrorKind::Request(kind), message)
    }

    /// The request API's kind of this error, if it is one.
    pub fn request_kind(&self) -> Option<RequestErrorKind> {
        match self.kind() {
            ErrorKind::Request(kind) => Some(kind),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_one_action() {
        let wait = Error::request(RequestErrorKind::InProgress, "x")
            .with_retry_after(Duration::from_secs(2));
        assert_eq!(
            RequestAction::of(&wait),
            RequestAction::Wait(Some(Duration::from_secs(2)))
        );
        for kind in [RequestErrorKind::InvalidKey, RequestErrorKind::KeyReused] {
            assert_eq!(
                RequestAction::of(&Error::request(kind, "x")),
                RequestAction::GiveUp
            );
        }
        let lost = Error::request(RequestErrorKind::LeaseLost, "x");
        assert_eq!(RequestAction::of(&lost), RequestAction::Retry);
        assert_eq!(lost.request_kind(), Some(RequestErrorKind::LeaseLost));
        for kind in [
            ErrorKind::Transient,
            ErrorKind::Unavailable,
            ErrorKind::Store,
        ] {
            assert_eq!(
                RequestAction::of(&Error::new(kind, "x")),
                RequestAction::Retry
            );
            assert_eq!(Error::new(kind, "x").request_kind(), None);
        }
        let misconfigured = Error::new(ErrorKind::Misconfigured, "x");
        assert_eq!(RequestAction::of(&misconfigured), RequestAction::GiveUp);
    }
}
