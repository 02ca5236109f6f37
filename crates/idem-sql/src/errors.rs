//! Maps sqlx errors onto idem's [`ErrorKind`]s by driver code, never by message text: the
//! kinds every driver shares here, each engine's database codes through
//! [`Engine::database_kind`] (whose tables are `idem_dialect`'s, shared with `idem-postgres`).

use idem_core::{Error, ErrorKind};

use crate::engine::Engine;

/// Classifies a driver error: what a consumer should do about it.
pub(crate) fn kind_of<E: Engine>(err: &sqlx::Error) -> ErrorKind {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => ErrorKind::Unavailable,
        sqlx::Error::Configuration(_) => ErrorKind::InvalidConfig,
        sqlx::Error::Database(db) => E::database_kind(db.as_ref()),
        _ => ErrorKind::Store,
    }
}

/// Wraps a driver error from `what` (e.g. "claim") into an idem error: `"PostgreSQL: claim:
/// …"`.
pub(crate) fn store_error<E: Engine>(what: &str, err: sqlx::Error) -> Error {
    Error::from_system(kind_of::<E>(&err), <E as sqlx::Database>::NAME, what, err)
}

/// A failed COMMIT: a broken connection leaves the outcome unknown; an error the server
/// returned means it rolled back.
pub(crate) fn commit_error<E: Engine>(err: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &err
        && E::aborted(db.as_ref())
    {
        return Error::new(
            ErrorKind::Handler,
            "nothing was committed: a statement in the handler failed and the handler went \
             on without returning the error, so the database aborted the transaction \
             (claim included); handlers must propagate database errors",
        )
        .with_source(err);
    }
    match kind_of::<E>(&err) {
        ErrorKind::Unavailable => Error::from_system(
            ErrorKind::OutcomeUnknown,
            <E as sqlx::Database>::NAME,
            "connection lost during commit, outcome unknown (retrying is safe: the claim \
             committed with the effect or not at all)",
            err,
        ),
        kind => Error::from_system(kind, <E as sqlx::Database>::NAME, "commit", err),
    }
}

/// What a sqlx error a handler returned means for its message: what [`kind_of`] says about
/// idem's own statements, except where the handler running the statement changes it. Its own
/// pool timing out (every connection busy with its other work) is this message's
/// [`ErrorKind::Transient`] failure, not a store outage; a connection that broke under its
/// statement is [`ErrorKind::ConnectionLost`] (a consumer probes the store to tell an outage
/// from a message that ends its own session). A refusal only an operator could mend under
/// idem's statements (`Misconfigured`) is made the message's own failure by
/// [`idem_core::store::handler_error`].
pub(crate) fn handler_kind<E: Engine>(err: &sqlx::Error) -> ErrorKind {
    match err {
        sqlx::Error::PoolTimedOut => ErrorKind::Transient,
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => ErrorKind::ConnectionLost,
        sqlx::Error::Database(db) if E::connection_lost(db.as_ref()) => ErrorKind::ConnectionLost,
        _ => kind_of::<E>(err),
    }
}

/// Classifies an arbitrary handler error if it is a sqlx error (see [`handler_kind`]).
pub(crate) fn classify<E: Engine>(err: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    err.downcast_ref::<sqlx::Error>().map(handler_kind::<E>)
}
