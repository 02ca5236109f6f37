//! PostgreSQL's SQLSTATE codes as idem's error kinds: one table for every PostgreSQL driver
//! idem runs on (sqlx in `idem-sql`, tokio-postgres in `idem-postgres`), so an outage or a
//! misconfiguration means the same on both. Pure data: no driver dependency here.

use crate::ErrorKind;

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
            ("", ErrorKind::Store),
        ] {
            assert_eq!(kind(code), expected, "{code}");
        }
    }
}
