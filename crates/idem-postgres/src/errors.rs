//! tokio-postgres's (and deadpool's) errors as idem's [`ErrorKind`]s: by SQLSTATE through
//! [`idem_dialect::postgres::sqlstate::kind_with`], the table `idem-sql` classifies with too, never by message
//! text; a connection that closed or failed at the socket is [`ErrorKind::Unavailable`], and at
//! `COMMIT` [`ErrorKind::OutcomeUnknown`].

use std::error::Error as StdError;
use std::fmt;

use idem_core::{Error, ErrorKind};
use tokio_postgres::error::SqlState;

/// The system name every error this crate reports starts with.
pub(crate) const SYSTEM: &str = "PostgreSQL";

/// What a consumer should do about a tokio-postgres error.
pub(crate) fn kind_of(err: &tokio_postgres::Error) -> ErrorKind {
    if let Some(code) = err.code() {
        let constraint = err.as_db_error().and_then(|db| db.constraint());
        return idem_dialect::postgres::sqlstate::kind_with(code.code(), constraint);
    }
    // No SQLSTATE: the server never answered. tokio-postgres says so through `is_closed` (the
    // connection ended, so every request on it fails) or an I/O error in the source chain
    // (refused, reset, broken pipe); its other code-less errors (a parameter it cannot
    // encode, a column it cannot decode) are about the statement, not the server.
    if err.is_closed() || has_io_source(err) {
        ErrorKind::Unavailable
    } else {
        ErrorKind::Store
    }
}

fn has_io_source(err: &(dyn StdError + 'static)) -> bool {
    let mut cause = err.source();
    while let Some(e) = cause {
        if e.is::<std::io::Error>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// A tokio-postgres error as idem reports it. tokio-postgres displays a server error only as
/// "db error" (what the server said is its source); this shows the server's severity, message
/// and SQLSTATE, and keeps the error itself as the source, so callers can still downcast it.
#[derive(Debug)]
pub(crate) struct Reported(pub(crate) tokio_postgres::Error);

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_db_error() {
            Some(db) => write!(
                f,
                "{}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            ),
            None => {
                write!(f, "{}", self.0)?;
                if let Some(cause) = self.0.source() {
                    write!(f, ": {cause}")?;
                }
                Ok(())
            }
        }
    }
}

impl StdError for Reported {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.0)
    }
}

/// A driver error from `what` (e.g. "claim"): `"PostgreSQL: claim: ERROR: … (SQLSTATE …)"`.
pub(crate) fn store_error(what: &str, err: tokio_postgres::Error) -> Error {
    Error::from_system(kind_of(&err), SYSTEM, what, Reported(err))
}

/// A failed `SELECT 1; COMMIT`. The `SELECT` failing with 25P02 means a statement of the
/// transaction had failed and the handler went on without returning the error: PostgreSQL
/// aborted the transaction, and a bare `COMMIT` would have rolled it back *and reported
/// success*. A connection lost meanwhile leaves the outcome unknown; any other error the
/// server returned means it rolled back.
pub(crate) fn commit_error(err: tokio_postgres::Error) -> Error {
    if err.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) {
        return Error::new(
            ErrorKind::Handler,
            "nothing was committed: a statement in the handler failed and the handler went \
             on without returning the error, so the database aborted the transaction \
             (claim included); handlers must propagate database errors",
        )
        .with_source(Reported(err));
    }
    match kind_of(&err) {
        ErrorKind::Unavailable => Error::from_system(
            ErrorKind::OutcomeUnknown,
            SYSTEM,
            "connection lost during commit, outcome unknown (retrying is safe: the claim \
             committed with the effect or not at all)",
            Reported(err),
        ),
        kind => Error::from_system(kind, SYSTEM, "commit", Reported(err)),
    }
}

/// A connection the pool could not hand out.
#[cfg(feature = "deadpool")]
pub(crate) fn pool_error(what: &str, err: deadpool_postgres::PoolError) -> Error {
    match err {
        deadpool_postgres::PoolError::Backend(e) => store_error(what, e),
        other => Error::from_system(pool_kind(&other), SYSTEM, what, other),
    }
}

#[cfg(feature = "deadpool")]
fn pool_kind(err: &deadpool_postgres::PoolError) -> ErrorKind {
    use deadpool_postgres::{HookError, PoolError};
    match err {
        PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => kind_of(e),
        // Every connection busy for the whole wait, or none could be opened in time: the
        // database is overloaded or out of reach.
        PoolError::Timeout(_) | PoolError::Closed => ErrorKind::Unavailable,
        // Timeouts configured on a pool built without a runtime to measure them.
        PoolError::NoRuntimeSpecified => ErrorKind::InvalidConfig,
        PoolError::PostCreateHook(_) => ErrorKind::Store,
    }
}

/// What a tokio-postgres error under a handler's statement means for its message: as
/// [`kind_of`], except that a session the server ended (57P01, 57P02, class 08) or a
/// connection that closed or failed at the socket is [`ErrorKind::ConnectionLost`], which a
/// consumer probes to tell an outage from a message that ends its own session.
fn handler_kind(err: &tokio_postgres::Error) -> ErrorKind {
    let lost = match err.code() {
        Some(code) => idem_dialect::postgres::sqlstate::connection_lost(code.code()),
        None => err.is_closed() || has_io_source(err),
    };
    if lost {
        ErrorKind::ConnectionLost
    } else {
        kind_of(err)
    }
}

/// Classifies an error a handler returned, if it came from tokio-postgres or the pool (see
/// [`handler_kind`]). The handler's own pool timing out is this message's
/// [`ErrorKind::Transient`] failure, not a store outage. A refusal only an operator could mend
/// under idem's statements (`Misconfigured`) is made the message's own failure by
/// [`idem_core::store::handler_error`].
pub(crate) fn classify(err: &(dyn StdError + 'static)) -> Option<ErrorKind> {
    if let Some(e) = err.downcast_ref::<tokio_postgres::Error>() {
        return Some(handler_kind(e));
    }
    if let Some(e) = err.downcast_ref::<Reported>() {
        return Some(handler_kind(&e.0));
    }
    #[cfg(feature = "deadpool")]
    if let Some(e) = err.downcast_ref::<deadpool_postgres::PoolError>() {
        return Some(match e {
            deadpool_postgres::PoolError::Backend(e) => handler_kind(e),
            deadpool_postgres::PoolError::Timeout(_) => ErrorKind::Transient,
            other => pool_kind(other),
        });
    }
    None
}
