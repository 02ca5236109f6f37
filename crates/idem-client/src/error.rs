//! The middleware's own errors. Transport failures stay `reqwest` errors (so `is_timeout()`
//! and `is_connect()` keep working); only what idem-client itself refuses is an [`Error`],
//! carried in [`reqwest_middleware::Error::Middleware`].

use std::borrow::Cow;

/// What idem-client refused, to match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's idempotency key is empty, too long or not visible ASCII; nothing was
    /// sent. The source is an [`idem_core::Error`] of kind
    /// `ErrorKind::Request(RequestErrorKind::InvalidKey)`, the rule idem's servers apply.
    InvalidKey,
    /// A retry was needed but the request's body is a stream, which cannot be sent twice
    /// (reqwest cannot clone it). The first attempt was sent and may have taken effect: send
    /// a buffered body (bytes, JSON, a form) to have it retried.
    BodyNotReplayable,
}

/// An error raised by the idem-client middleware itself; find it in a
/// [`reqwest_middleware::Error`] with [`Error::of`].
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: Cow<'static, str>,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The idem-client error inside `error`, if the middleware raised it.
    ///
    /// ```
    /// use idem_client::{Error, ErrorKind};
    ///
    /// # fn check(err: reqwest_middleware::Error) {
    /// if let Some(e) = Error::of(&err) {
    ///     assert_eq!(e.kind(), ErrorKind::InvalidKey);
    /// }
    /// # }
    /// ```
    pub fn of(error: &reqwest_middleware::Error) -> Option<&Self> {
        match error {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<Self>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    pub(crate) fn into_middleware(self) -> reqwest_middleware::Error {
        reqwest_middleware::Error::Middleware(anyhow::Error::new(self))
    }
}
