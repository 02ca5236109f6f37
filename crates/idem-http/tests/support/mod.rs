//! Shared by the HTTP tests: the store fixtures, the service under test and the checks.

pub(crate) mod app;
pub(crate) mod fixtures;
pub(crate) mod grpc;
pub(crate) mod hang;
pub(crate) mod suite;
pub(crate) mod write_lock;
