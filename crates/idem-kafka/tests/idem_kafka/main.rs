//! The idem-kafka integration tests as one binary (one link, not one per file): the broker
//! conformance suite (`conformance`), consumer groups (`group`), rdkafka's MockCluster
//! (`mock`), resuming from committed offsets (`resume`) and static group membership
//! (`static_member`), over the fixtures in `common`.

mod common;
mod conformance;
mod group;
mod mock;
mod resume;
mod static_member;
