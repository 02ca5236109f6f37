//! PostgreSQL's SQLSTATE codes as idem's error kinds: one table for every PostgreSQL driver
//! idem runs on (sqlx in `idem-sql`, tokio-postgres in `idem-postgres`), so an outage or a
//! misconfiguration means the same on both. Pure data: no driver dependency here.

use idem_core::ErrorKind;

/// `read_only_sql_transaction`: a standby, or a session or role with
/// `default_transaction_read_only`. After a failover behind a stale DNS name a connection can
/// stay on the old primary, now a replica, while a new one would reach the new primary.
pub const READ_ONLY_SQL_TRANSACTION: &str = "25006";

/// `in_failed_sql_transaction`: a statement of the transaction failed earlier, so it aborted;
/// what [`COMMIT`](super::COMMIT)'s `SELECT` answers in it.
pub const IN_FAILED_SQL_TRANSACTION: &str = "25P02";

/// `lock_not_available`: a wait past [`LOCK_TIMEOUT`](super::maintenance::LOCK_TIMEOUT).
pub const LOCK_NOT_AVAILABLE: &str = "55P03";

/// `check_violation`: a CHECK constraint refused a row (the error names the constraint), or,
/// naming none, no partition covers the row's key ("no partition of relation … found for
/// row"). Under a claim the latter is an ID of a day whose partition maintenance has not
/// created yet (a producer's clock ahead of the days created), or of a range a round of
/// maintenance is moving (`maintenance::round`): an outage to wait out, never the message's
/// fault ([`kind_with`]).
pub const CHECK_VIOLATION: &str = "23514";

/// PostgreSQL SQLSTATEs (appendix A of its manual). What a database in trouble answers is an
/// outage to wait out, not a verdict on the message; what a wrong deployment answers stops the
/// consumer, because every message would fail the same way.
pub fn kind(code: &str) -> ErrorKind {
    match code {
        // serialization_failure, deadlock_detected, lock_not_available, query_canceled
        // (statement_timeout): the unit rolled back and a retry can succeed.
        "40001" | "40P01" | "55P03" | "57014" => ErrorKind::Transient,
        // read_only_sql_transaction: a failover onto a standby, or a primary demoted.
        "25006" => ErrorKind::Unavailable,
        // admin_shutdown, crash_shutdown, cannot_connect_now.
        "57P01" | "57P02" | "57P03" => ErrorKind::Unavailable,
        // invalid_catalog_name, invalid_schema_name.
        "3D000" | "3F000" => ErrorKind::Misconfigured,
        // Class 08 connection exception; 53 insufficient resources (disk_full, out_of_memory,
        // too_many_connections); 58 system error (io_error).
        c if c.starts_with("08") || c.starts_with("53") || c.starts_with("58") => {
            ErrorKind::Unavailable
        }
        // Class 28 invalid authorization; 42 syntax error or access rule violation
        // (insufficient_privilege 42501, undefined_table 42P01, undefined_column 42703…): the
        // SQL does not fit the database it runs on.
        c if c.starts_with("28") || c.starts_with("42") => ErrorKind::Misconfigured,
        _ => ErrorKind::Store,
    }
}

/// [`kind`], told what the error names: a [`CHECK_VIOLATION`] naming no constraint is a row no
/// partition covers, [`ErrorKind::Unavailable`] (a claim of a day whose partition does not
/// exist yet waits for maintenance to create it; the message is neither failed nor dropped).
/// A CHECK constraint's refusal stays [`ErrorKind::Store`].
pub fn kind_with(code: &str, constraint: Option<&str>) -> ErrorKind {
    if code == CHECK_VIOLATION && constraint.is_none() {
        return ErrorKind::Unavailable;
    }
    kind(code)
}

/// Whether `code` says the server ended the session or the connection failed under a
/// statement that was running: admin_shutdown (57P01, also what `pg_terminate_backend`
/// sends), crash_shutdown (57P02, every session when another backend crashed or was killed
/// for memory), and class 08 except the two codes a new connection is refused with
/// (08001, 08004). [`kind`] calls these outages; under a handler's statement a store reports
/// them as [`ErrorKind::ConnectionLost`], which a consumer probes to tell an outage from a
/// message that ends its own session.
pub fn connection_lost(code: &str) -> bool {
    match code {
        "57P01" | "57P02" => true,
        "08001" | "08004" => false,
        c => c.starts_with("08"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_codes_map_to_kinds() {
        for (code, expected) in [
            ("40001", ErrorKind::Transient),
            ("40P01", ErrorKind::Transient),
            ("25006", ErrorKind::Unavailable),
            ("08006", ErrorKind::Unavailable),
            ("53300", ErrorKind::Unavailable),
            ("57P01", ErrorKind::Unavailable),
            ("42P01", ErrorKind::Misconfigured),
            ("28P01", ErrorKind::Misconfigured),
            ("3D000", ErrorKind::Misconfigured),
            ("23505", ErrorKind::Store),
            ("23514", ErrorKind::Store),
            ("", ErrorKind::Store),
        ] {
            assert_eq!(kind(code), expected, "{code}");
        }
    }

    #[test]
    fn a_row_no_partition_covers_is_an_outage_and_a_check_constraint_is_not() {
        assert_eq!(kind_with("23514", None), ErrorKind::Unavailable);
        assert_eq!(kind_with("23514", Some("positive")), ErrorKind::Store);
        assert_eq!(kind_with("40001", None), ErrorKind::Transient);
    }

    #[test]
    fn sessions_ended_under_a_statement_are_lost_connections_and_refusals_are_not() {
        for code in ["57P01", "57P02", "08006", "08003", "08000", "08P01"] {
            assert!(connection_lost(code), "{code}");
            assert_eq!(kind(code), ErrorKind::Unavailable, "{code}");
        }
        for code in ["08001", "08004", "57P03", "25006", "53300", "42P01", ""] {
            assert!(!connection_lost(code), "{code}");
        }
    }
}
