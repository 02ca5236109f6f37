//! The SQL idem's stores run, once per engine, as plain data: no driver, no connection.
//!
//! Two stores run on PostgreSQL (`idem-sql` on sqlx, `idem-postgres` on tokio-postgres) and
//! share their tables, so what they send must be the same text: this crate is where that text
//! lives, and each store only binds parameters and executes it with its own driver. Per engine
//! ([`postgres`], [`mysql`], [`sqlite`]):
//!
//! - the claim statements ([`ClaimStatements`]) and the idempotent-request statements
//!   ([`RequestStatements`]) for a table, with the order their parameters are bound in;
//! - the outbox statements ([`OutboxStatements`]), each with what it binds in which order, and
//!   the outbox's shared rules ([`outbox`]: header encoding, the per-key lease rule);
//! - the migration: the statements that create the tables, their indexes and comments (the
//!   outbox's: `outbox_migration`);
//! - how the driver's error codes map onto [`idem_core::ErrorKind`]s (PostgreSQL's SQLSTATEs,
//!   MySQL's error numbers, SQLite's result codes);
//! - for PostgreSQL, claims partitioned by the ID's time ([`postgres::partition`]) and their
//!   maintenance ([`postgres::maintenance`]): partition names, the DDL scripts, and a pure
//!   planner that says which days to create and drop given the partitions that exist and the
//!   time, tested without a database.
//!
//! ```
//! use idem_core::TableName;
//! use idem_dialect::postgres;
//!
//! let t = TableName::new("claims")?;
//! let sql = postgres::claim_statements(&t, false);
//! assert!(sql.claim.starts_with("INSERT INTO claims"));
//! assert!(sql.claim.contains("ON CONFLICT (consumer, message_id) DO NOTHING"));
//! assert_eq!(postgres::sqlstate::kind("40P01"), idem_core::ErrorKind::Transient);
//! # Ok::<(), idem_core::Error>(())
//! ```

pub mod mysql;
pub mod outbox;
pub mod postgres;
pub mod sqlite;
mod statements;

pub use statements::{
    ClaimStatements, ENQUEUE_ROW, EnqueueStatement, OutboxParam, OutboxStatement, OutboxStatements,
    RecoveryMigration, RequestStatements,
};

/// A duration in microseconds, saturating, as prune statements and partition cut-offs bind it.
pub fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}
