//! idem-relay's one test binary: the relay publishing through `AnyProducer` to real brokers,
//! read back by idem's own sources; its crash points on a child process; rounds in flight
//! against a real outbox's lease.

mod brokers;
mod crash;
mod outbox;
mod pipeline;
