//! One error type for the whole toolkit: a [`ErrorKind`] to match on, a message, a boxed source,
//! and a [`Disposition`] that tells a broker adapter whether to redeliver or dead-letter.
//!
//! Messages read the same in every crate: an error a database or broker reported starts with
//! that system's name ([`Error::from_system`]: `PostgreSQL: claim: …`, `NATS: publishing the
//! dead letter to orders.dead-letter: …`); an error idem raises itself (a bad ID, a refused
//! configuration) is a plain lower-case sentence.

use std::borrow::Cow;
use std::fmt;

use crate::request::RequestErrorKind;

/// A boxed error from a handler or a driver.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong, in the pattern's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The message has no usable ID (empty, oversized). Redelivery cannot fix it.
    InvalidMessageId,
    /// A configuration the library refuses to run with (bad table name, retention shorter
    /// than the redelivery window, unknown store URL scheme).
    InvalidConfig,
    /// The store is out of reach, or up but refusing work for now: no connection could be
    /// opened, or one broke under idem's own statements before the handler ran; the database
    /// is read-only (a failover onto a standby), its disk is full, or it has no connection to
    /// spare. Says nothing about the message: a consumer waits it out in place, without
    /// spending the message's attempts.
    Unavailable,
    /// The connection broke while the message's handler ran its statements (the server ended
    /// the session or the socket failed); everything rolled back. Either the store went down for
    /// everyone (an outage, as [`ErrorKind::Unavailable`]) or this message's own statements
    /// end their session (a crash, an out-of-memory kill): a consumer tells which by
    /// [probing](crate::TransactionalStore::probe) the store right after, and spends an
    /// attempt of the message only when the store answers.
    ConnectionLost,
    /// The store refuses one of idem's own statements (begin, claim, commit, migrate, prune)
    /// for a reason only an operator can fix: a missing table (its migration never ran),
    /// missing privileges, a schema that does not match the SQL, a damaged database file.
    /// Every message would fail the same way, so a consumer stops. The same refusal of a
    /// handler's own statement is that message's failure ([`ErrorKind::Store`]), never this.
    Misconfigured,
    /// A deadlock, serialization failure or lock timeout; the whole unit rolled back and can
    /// simply be retried.
    Transient,
    /// The connection was lost while committing: the transaction may or may not have committed.
    /// Retrying is safe precisely because the claim committed with the effect: a retry either
    /// does the work or finds a duplicate.
    OutcomeUnknown,
    /// The handler failed; its writes and the claim rolled back. Worth retrying.
    Handler,
    /// The handler rejected the message as permanently unprocessable (see [`Error::reject`]).
    Rejected,
    /// A failure only an idempotent request can have (an invalid key, a key in progress or
    /// reused, a lost lease): the request API's own kinds, in
    /// [`RequestErrorKind`]; what its caller should do is
    /// [`RequestAction::of`](crate::RequestAction::of).
    Request(RequestErrorKind),
    /// Any other error reported by the store (a constraint the handler's write violates, a
    /// value out of range), and any refusal of the handler's own statements (a table or
    /// privilege it lacks, a row-level-security check): retried like a handler failure.
    Store,
}

/// What a consumer should do with the delivery after an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Disposition {
    /// Negative-ack or let the broker redeliver, with backoff.
    Retry,
    /// Move the message to the dead-letter destination with the error as its reason.
    DeadLetter,
    /// Stop consuming: the process is misconfigured and every message would fail the same way.
    Fatal,
}

impl ErrorKind {
    /// The default action for this kind of error.
    pub const fn disposition(self) -> Disposition {
        match self {
            ErrorKind::InvalidMessageId
            | ErrorKind::Rejected
            | ErrorKind::Request(RequestErrorKind::InvalidKey | RequestErrorKind::KeyReused) => {
                Disposition::DeadLetter
            }
            ErrorKind::InvalidConfig | ErrorKind::Misconfigured => Disposition::Fatal,
            ErrorKind::Unavailable
            | ErrorKind::ConnectionLost
            | ErrorKind::Transient
            | ErrorKind::OutcomeUnknown
            | ErrorKind::Handler
            | ErrorKind::Request(_)
            | ErrorKind::Store => Disposition::Retry,
        }
    }
}

/// The error type of every idem crate.
#[derive(thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: Cow<'static, str>,
    #[source]
    source: Option<BoxError>,
    retry_after: Option<std::time::Duration>,
}

impl Error {
    /// An error of `kind` with a human-readable message.
    pub fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
            retry_after: None,
        }
    }

    /// An error a database or broker reported while idem was doing `what`, in the one message
    /// style of every idem crate: `"{system}: {what}: {source}"` (`"Redis: XACK: connection
    /// refused"`). `system` is the server's proper name (`PostgreSQL`, `MySQL`, `SQLite`,
    /// `Redis`, `NATS`, `AMQP`, `Kafka`, `MQTT`); the source stays attached.
    pub fn from_system(
        kind: ErrorKind,
        system: &str,
        what: impl fmt::Display,
        source: impl Into<BoxError>,
    ) -> Self {
        let source = source.into();
        Self::new(kind, format!("{system}: {what}: {source}")).with_source(source)
    }

    /// Says when retrying may succeed (an execution in progress ends its lease by then).
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// When retrying may succeed, if the error knows.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_after
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// For handlers: this message can never succeed (undecodable payload, unknown account);
    /// roll back and dead-letter it instead of retrying.
    pub fn reject(reason: impl Into<BoxError>) -> Self {
        let source = reason.into();
        Self::new(
            ErrorKind::Rejected,
            format!("handler rejected the message: {source}"),
        )
        .with_source(source)
    }

    /// For handlers: roll back and retry later (e.g. a downstream API is briefly down).
    pub fn retry(reason: impl Into<BoxError>) -> Self {
        let source = reason.into();
        Self::new(ErrorKind::Handler, format!("handler failed: {source}")).with_source(source)
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What to do with the delivery.
    pub fn disposition(&self) -> Disposition {
        self.kind.disposition()
    }

    /// Whether retrying the same message may succeed.
    pub fn is_retryable(&self) -> bool {
        self.disposition() == Disposition::Retry
    }

    /// Whether the store, not the message, may be the problem: out of reach or refusing work
    /// for now ([`ErrorKind::Unavailable`]), or the connection lost while the message ran
    /// ([`ErrorKind::ConnectionLost`]) or during its commit ([`ErrorKind::OutcomeUnknown`]).
    /// Worth waiting out in place without spending the message's attempts — except a lost
    /// connection while the store answers (see [`Error::is_connection_lost`]).
    pub fn is_outage(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Unavailable | ErrorKind::ConnectionLost | ErrorKind::OutcomeUnknown
        )
    }

    /// Whether the connection broke after the message had begun to run: in its handler
    /// ([`ErrorKind::ConnectionLost`]) or during its commit ([`ErrorKind::OutcomeUnknown`]).
    /// An outage if the store is down for everyone; if a [probe](crate::TransactionalStore::probe)
    /// right after succeeds, the message itself may be what ends its session, and retrying it
    /// should spend its attempts.
    pub fn is_connection_lost(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::ConnectionLost | ErrorKind::OutcomeUnknown
        )
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("message", &self.message);
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_dispositions() {
        assert_eq!(
            Error::reject("bad json").disposition(),
            Disposition::DeadLetter
        );
        assert_eq!(Error::retry("503").disposition(), Disposition::Retry);
        assert!(Error::new(ErrorKind::OutcomeUnknown, "x").is_retryable());
        assert_eq!(ErrorKind::InvalidConfig.disposition(), Disposition::Fatal);
        assert_eq!(ErrorKind::Misconfigured.disposition(), Disposition::Fatal);
        assert_eq!(ErrorKind::Unavailable.disposition(), Disposition::Retry);
        assert_eq!(ErrorKind::ConnectionLost.disposition(), Disposition::Retry);
    }

    #[test]
    fn lost_connections_are_outages_that_a_probe_may_pin_on_the_message() {
        for kind in [ErrorKind::ConnectionLost, ErrorKind::OutcomeUnknown] {
            let err = Error::new(kind, "x");
            assert!(err.is_outage() && err.is_connection_lost(), "{kind:?}");
        }
        let refusing = Error::new(ErrorKind::Unavailable, "read-only");
        assert!(refusing.is_outage() && !refusing.is_connection_lost());
        assert!(!Error::new(ErrorKind::Store, "x").is_connection_lost());
    }

    #[test]
    fn system_errors_name_the_system_and_keep_the_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = Error::from_system(ErrorKind::Unavailable, "Redis", "XACK", io);
        assert_eq!(err.to_string(), "Redis: XACK: refused");
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        let source = std::error::Error::source(&err).expect("source kept");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
    }

    #[test]
    fn reject_keeps_the_reason_and_the_source() {
        let err = Error::reject("amount must be positive");
        assert!(err.to_string().contains("amount must be positive"));
        assert!(std::error::Error::source(&err).is_some());
    }
}
