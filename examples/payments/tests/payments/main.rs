//! The payments example's integration tests as one binary: the service as its README runs it,
//! against each real broker (`payments`).

mod payments;
