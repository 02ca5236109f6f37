//! Shared by the HTTP tests: the axum adapter of the black-box suite, and the checks that
//! drive the layer as a tower service.

pub(crate) mod app;
pub(crate) mod grpc;
pub(crate) mod hang;
pub(crate) mod phases;
pub(crate) mod suite;
pub(crate) mod write_lock;
