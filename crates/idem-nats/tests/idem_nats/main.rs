//! The idem-nats integration tests as one binary (one link, not one per file): the broker
//! conformance suite (`conformance`), the adapter against a real JetStream (`jetstream`) and
//! across a server restart (`restart`), over the fixtures in `common`.

mod common;
mod conformance;
mod jetstream;
mod restart;
