//! idem-testkit's integration tests as one binary: the broker conformance suite run against the
//! in-memory broker (`in_memory_broker`).

mod in_memory_broker;
