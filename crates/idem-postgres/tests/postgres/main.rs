//! idem-postgres's integration tests against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL` (`SKIPPING` when unset), one binary (one link instead of one per
//! file): each module was a test binary of its own. Run one part with a filter on its module,
//! e.g. `cargo test -p idem-postgres --test postgres -- pipelining::`.
//!
//! The tests share this process: each isolates itself by name (a schema, a role, from
//! `idem_testkit::unique_name`, distinct within a process), and none sets anything
//! process-wide (environment variables, a global subscriber).

mod common;
// idem-sql's extra request checks, run here unchanged on this crate's store.
#[path = "../../../idem-sql/tests/sql/request_extras.rs"]
mod request_extras;

mod conformance;
mod interop;
mod outbox;
mod partitions;
mod pipelining;
mod requests;
mod states;
mod transactions;
