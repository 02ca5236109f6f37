//! idem-testkit's integration tests as one binary: the broker conformance suite run against the
//! in-memory broker (`in_memory_broker`), and the `idem-fake-processor` binary (`fake_processor_bin`,
//! with the `fake-processor` feature).

#[cfg(feature = "fake-processor")]
mod fake_processor_bin;
mod in_memory_broker;
