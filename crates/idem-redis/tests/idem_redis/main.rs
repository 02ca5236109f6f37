//! The idem-redis integration tests as one binary (one link, not one per file): the
//! idempotent-request conformance suite (`conformance`) and what it cannot see (`redis_store`,
//! with `redis_store::durability` on servers of the tests' own), against a real Redis
//! (`IDEM_TEST_REDIS_URL`).
//!
//! The tests share this process and the one server: each works under its own key prefix (from
//! `idem_testkit::unique_name`, distinct within a process) and removes only its own keys; the
//! durability tests reconfigure, freeze and kill only the `redis-server` processes they start,
//! on free loopback ports.

mod conformance;
mod redis_store;
