//! idem-chaos's integration tests as one binary: the bounded chaos runs CI makes (`chaos`),
//! and those of operations of recovery points (`phases`).

mod chaos;
mod phases;
