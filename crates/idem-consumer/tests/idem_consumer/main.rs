//! The idem-consumer integration tests as one binary (one link, not one per file): the
//! Prometheus exposition (`metrics`), periodic pruning (`prune`), the runner over the
//! in-memory broker (`runner`), store outages (`store_states`) and recovery points from
//! consumer handlers (`phased`). The metrics recorder is
//! process-wide: the tests that read it share the one `recorder` installs, and each reads only
//! its own consumer's lines.

mod local_cache;
mod metrics;
mod phased;
mod prune;
mod recorder;
mod runner;
mod store_states;
