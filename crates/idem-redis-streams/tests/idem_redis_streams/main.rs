//! The idem-redis-streams integration tests as one binary (one link, not one per file): the
//! broker conformance suite (`conformance`) and the adapter against a real Redis
//! (`redis_streams`).

mod conformance;
mod redis_streams;
