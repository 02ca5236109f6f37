//! The idem-kafka integration tests as one binary (one link, not one per file): the broker
//! conformance suite (`conformance`), consumer groups (`group`), rdkafka's MockCluster
//! (`mock`) and resuming from committed offsets (`resume`), over the fixtures in `common`.

mod common;
mod conformance;
mod group;
mod mock;
mod resume;
