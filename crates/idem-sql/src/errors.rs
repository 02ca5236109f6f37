//! Maps sqlx errors onto idem's [`ErrorKind`]s by driver code, never by message text: the
//! kinds every driver shares here, each engine's database codes in its own function (called
//! through [`Engine::database_kind`]).

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

/// MySQL / MariaDB server error numbers.
#[cfg(feature = "mysql")]
pub(crate) fn mysql_kind(number: u16) -> ErrorKind {
    match number {
        // 1213 deadlock, 1205 lock wait timeout, 1020 record changed (snapshot conflict),
        // 3024 / 1969 statement time limit (MySQL / MariaDB).
        1213 | 1205 | 1020 | 3024 | 1969 => ErrorKind::Transient,
        // 1290 running with --read-only, 1792 read-only transaction, 1836 read-only mode;
        // 1021 disk full, 1114 table full; 1040 too many connections, 1203 / 1226 per-user
        // connection limits; 1037 / 1038 / 1041 out of memory; 1053 server shutdown;
        // 1927 connection killed, 2006 server gone away, 2013 lost connection mid-query,
        // 1158–1161 network read/write errors.
        1290
        | 1792
        | 1836
        | 1021
        | 1114
        | 1040
        | 1203
        | 1226
        | 1037
        | 1038
        | 1041
        | 1053
        | 1927
        | 2006
        | 2013
        | 1158..=1161 => ErrorKind::Unavailable,
        // 1044 / 1045 / 1142 / 1143 / 1227 / 1370 access denied; 1046 no database selected,
        // 1049 unknown database, 1054 unknown column, 1064 SQL syntax, 1109 unknown table,
        // 1146 no such table, 1305 no such function or procedure.
        1044 | 1045 | 1142 | 1143 | 1227 | 1370 | 1046 | 1049 | 1054 | 1064 | 1109 | 1146
        | 1305 => ErrorKind::Misconfigured,
        _ => ErrorKind::Store,
    }
}

/// MySQL / MariaDB server error numbers that end the session under a running statement: 1927
/// connection killed (`KILL`), 2006 server gone away, 2013 lost connection mid-query,
/// 1158–1161 network read/write errors, 1053 server shutdown. [`mysql_kind`] calls them
/// outages; under a handler's statement they are [`ErrorKind::ConnectionLost`].
#[cfg(feature = "mysql")]
pub(crate) fn mysql_connection_lost(number: u16) -> bool {
    matches!(number, 1927 | 2006 | 2013 | 1158..=1161 | 1053)
}

/// SQLite result codes (extended codes carry the primary code in their low byte).
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_kind(code: u32, message: &str) -> ErrorKind {
    match code & 0xff {
        // SQLITE_BUSY, SQLITE_LOCKED: another writer holds the lock.
        5 | 6 => ErrorKind::Transient,
        // SQLITE_READONLY (a read-only file or mount), SQLITE_IOERR, SQLITE_FULL (disk or
        // max_page_count), SQLITE_CANTOPEN: the database cannot take writes now.
        8 | 10 | 13 | 14 => ErrorKind::Unavailable,
        // SQLITE_PERM, SQLITE_AUTH; SQLITE_CORRUPT, SQLITE_NOTADB: a damaged file is for an
        // operator, not for retries.
        3 | 23 | 11 | 26 => ErrorKind::Misconfigured,
        // SQLITE_ERROR is every SQL error at once; SQLite has no separate code for a missing
        // table or column, so the prefix of its message is the only signal there is.
        1 if message.starts_with("no such table")
            || message.starts_with("no such column")
            || message.starts_with("no such function") =>
        {
            ErrorKind::Misconfigured
        }
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
