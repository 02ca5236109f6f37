//! idem's transactions against the real servers (`IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_MYSQL_URL`; SQLite always runs): nested transactions inside a handler are
//! savepoints on every engine, pooled and held (`nesting`), the pool gets its connections back
//! as sqlx expects them and a transaction costs the round trips it did (`round_trips`), an
//! idempotent request in its transaction costs no more than it must (`request_round_trips`), and
//! held connections are given up when they age, idle, hang at `BEGIN` or keep answering
//! read-only (`recycling`). Each test isolates itself (a schema, a database, a file).

mod fixture;
mod nesting;
mod proxy;
mod recycling;
mod request_round_trips;
mod round_trips;
