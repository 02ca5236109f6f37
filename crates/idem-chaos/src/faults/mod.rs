//! The faults the harness injects besides killing consumers.

pub(crate) mod nats_cluster;
pub(crate) mod postgres;
pub(crate) mod proxy;
