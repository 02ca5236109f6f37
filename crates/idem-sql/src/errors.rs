//! Maps sqlx errors onto idem's [`ErrorKind`]s by driver code, never by message text.

use idem_core::{Error, ErrorKind};

/// Classifies a driver error: what a consumer should do about it.
pub(crate) fn kind_of(err: &sqlx::Error) -> ErrorKind {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => ErrorKind::Unavailable,
        sqlx::Error::Configuration(_) => ErrorKind::InvalidConfig,
        sqlx::Error::Database(db) => database_kind(db.as_ref()),
        _ => ErrorKind::Store,
    }
}

fn database_kind(db: &dyn sqlx::error::DatabaseError) -> ErrorKind {
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // 1213 deadlock, 1205 lock wait timeout, 1020 record changed (snapshot conflict),
        // 1927/2006/2013 connection killed or lost mid-statement.
        return match my.number() {
            1213 | 1205 | 1020 => ErrorKind::Transient,
            1927 | 2006 | 2013 => ErrorKind::Unavailable,
            _ => ErrorKind::Store,
        };
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // Primary codes SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended variants
        // (extended code & 0xff is the primary code).
        let busy = db
            .code()
            .and_then(|c| c.parse::<u32>().ok())
            .is_some_and(|n| matches!(n & 0xff, 5 | 6));
        return if busy {
            ErrorKind::Transient
        } else {
            ErrorKind::Store
        };
    }
    let code = db.code();
    match code.as_deref() {
        // PostgreSQL: serialization_failure, deadlock_detected, lock_not_available.
        Some("40001" | "40P01" | "55P03") => ErrorKind::Transient,
        // PostgreSQL: admin_shutdown, crash_shutdown, cannot_connect_now, class 08 connection.
        Some("57P01" | "57P02" | "57P03") => ErrorKind::Unavailable,
        Some(c) if c.starts_with("08") => ErrorKind::Unavailable,
        _ => ErrorKind::Store,
    }
}

/// Wraps a driver error from `what` (e.g. "claim") into an idem error.
pub(crate) fn store_error(what: &str, err: sqlx::Error) -> Error {
    let kind = kind_of(&err);
    Error::new(kind, format!("{what} failed: {err}")).with_source(err)
}

/// A failed COMMIT: a broken connection leaves the outcome unknown; an error the server
/// returned means it rolled back.
pub(crate) fn commit_error(err: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &err
        && db.code().as_deref() == Some("25P02")
    {
        return Error::new(
            ErrorKind::Handler,
            "nothing was committed: a statement in the handler failed and the handler went \
                 on without returning the error, so PostgreSQL aborted the transaction \
                 (claim included); handlers must propagate database errors",
        )
        .with_source(err);
    }
    let kind = match kind_of(&err) {
        ErrorKind::Unavailable => ErrorKind::OutcomeUnknown,
        other => other,
    };
    let message = match kind {
        ErrorKind::OutcomeUnknown => format!(
            "connection lost during commit, outcome unknown (retrying is safe: the claim \
             committed with the effect or not at all): {err}"
        ),
        _ => format!("commit failed: {err}"),
    };
    Error::new(kind, message).with_source(err)
}

/// Classifies an arbitrary handler error if it is a sqlx error.
pub(crate) fn classify(err: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    err.downcast_ref::<sqlx::Error>().map(kind_of)
}
