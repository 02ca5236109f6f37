//! idem-bench's integration tests as one binary: the prune scenario (`prune`) and the outbox
//! scenario (`outbox`), test-sized, against the real PostgreSQL (and NATS).

mod outbox;
mod prune;
