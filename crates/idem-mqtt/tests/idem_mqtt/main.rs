//! The idem-mqtt integration tests as one binary (one link, not one per file): the broker
//! conformance suite (`conformance`), the adapter against a real broker (`mqtt`) and across a
//! broker restart (`restart`), over the fixtures in `common`.

mod common;
mod conformance;
mod mqtt;
mod restart;
