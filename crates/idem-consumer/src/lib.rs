//! The broker-independent consumer runner of idem.
//!
//! A broker adapter (`idem-nats`, `idem-amqp`, `idem-kafka`, `idem-redis-streams`, `idem-mqtt`)
//! implements [`Source`] and [`Delivery`]; [`Consumer`] does the rest, the same way on every
//! broker:
//!
//! | what happened | what the runner does |
//! |---|---|
//! | handler ran, transaction committed | ack |
//! | already processed ([`Outcome::Duplicate`](idem_core::Outcome)) | ack, nothing else |
//! | same ID, different payload ([`Outcome::Conflict`](idem_core::Outcome)) | dead-letter, reason `conflict` |
//! | no ID, empty ID, ID over the store's limit | dead-letter, reason `missing-id` / `invalid-id` |
//! | payload does not decode | dead-letter, reason `undecodable` |
//! | handler [`Error::reject`](idem_core::Error::reject) | dead-letter, reason `rejected` |
//! | retryable error (handler, deadlock, a statement of the handler the database refuses: a table or privilege it lacks, a row-level-security check) | retry with exponential backoff and jitter; after the last attempt dead-letter, reason `retries-exhausted` |
//! | store unavailable or refusing (unreachable, read-only, full, out of connections), or refusing `BEGIN` or the claim | wait in place with capped backoff, spending no attempts, for as long as it lasts (an outage must not empty the queue into the dead letters); past [`RetryPolicy::outage_limit`] a `warn` line and `idem_store_outage_limit_exceeded_total` |
//! | connection lost while the message ran (its handler or its commit) | probe the store on another connection: down too, an outage as above; up, the message ends its own session: an attempt spent, and after the last dead-letter, reason `connection-lost` (also once the outage limit has passed, for a message that crashes the database every time it runs) |
//! | store misconfigured under idem's own statements (claims table missing, no privilege on it) | stop: `run` returns the `Misconfigured` error; nothing is dead-lettered |
//! | shutdown | stop fetching, finish in-flight messages, ack what committed, leave the rest |
//! | broker connection lost | back off and fetch again; the adapter reconnects |
//!
//! Nothing is acknowledged that did not commit, and nothing is acknowledged silently: every
//! dead letter carries its reason in headers ([`DeadLetter::headers`]).
//!
//! `InMemoryBroker` (feature `test-util`) is an in-memory fake for unit tests of handlers and for
//! the demo; real adapters are tested against real brokers.

pub mod crash;
mod dead_letter;
mod decode;
mod id_source;
#[cfg(feature = "test-util")]
mod in_memory;
pub mod metrics;
mod prune;
mod retry;
mod runner;
pub mod shutdown;
mod source;

pub use dead_letter::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, DETAIL_HEADER, DeadLetter, DeadLetterReason, REASON_HEADER,
};
pub use decode::{Decode, Json, Raw};
pub use id_source::IdSource;
/// The handler shape, defined in idem-core and re-exported where consumers are written.
pub use idem_core::{Handler, SetHandler};
#[cfg(feature = "test-util")]
pub use in_memory::{InMemoryBroker, InMemoryDelivery, InMemorySource, InMemoryStats, Settled};
pub use metrics::RunStats;
pub use prune::prune_periodically;
pub use retry::{ReconnectBackoff, RetryPolicy};
pub use runner::{Batch, Consumer, Observer, PerMessage};
pub use source::{Delivery, Origin, Source};
pub use tokio_util::sync::CancellationToken;
