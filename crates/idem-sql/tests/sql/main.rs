//! idem-sql's integration tests, one binary (one link instead of one per file): each module was
//! a test binary of its own, and an engine's modules build when its feature is on. SQLite
//! always runs (it is embedded); PostgreSQL and MySQL/MariaDB read `IDEM_TEST_POSTGRES_URL` and
//! `IDEM_TEST_MYSQL_URL` and print `SKIPPING` when unset. Run one part with a filter on its
//! module, e.g. `cargo test -p idem-sql --features postgres --test sql -- conformance_postgres::`.
//!
//! The tests share this process: each isolates itself by name (a schema, a database, a file,
//! from `idem_testkit::unique_name`, distinct within a process), and none sets anything
//! process-wide (environment variables, a global subscriber).

// Shared by the engines' modules below.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod request_extras;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod states;

#[cfg(feature = "sqlite")]
mod conformance_sqlite;
#[cfg(feature = "sqlite")]
mod outbox_sqlite;
#[cfg(feature = "sqlite")]
mod requests_sqlite;
#[cfg(feature = "sqlite")]
mod spawn;
#[cfg(feature = "sqlite")]
mod states_sqlite;

#[cfg(feature = "postgres")]
mod conformance_postgres;
#[cfg(feature = "postgres")]
mod outbox_postgres;
#[cfg(feature = "postgres")]
mod partitions_postgres;
#[cfg(feature = "postgres")]
mod requests_postgres;
#[cfg(feature = "postgres")]
mod states_postgres;

#[cfg(feature = "mysql")]
mod conformance_mysql;
#[cfg(feature = "mysql")]
mod outbox_mysql;
#[cfg(feature = "mysql")]
mod requests_mysql;
#[cfg(feature = "mysql")]
mod states_mysql;

// Across engines: on when every engine they run is.
#[cfg(all(feature = "postgres", feature = "mysql"))]
mod store_clock;
#[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transactions;
