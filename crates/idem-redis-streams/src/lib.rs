//! Redis Streams adapter for idem: consume a stream through a consumer group, acknowledge
//! (`XACK`) only after the message's transaction committed, take over entries of crashed
//! members with `XAUTOCLAIM`, and move poison to a dead-letter stream.
//!
//! Producers write the message ID and the body in fields of the entry (`message_id` and
//! `payload` by default, see [`RedisStreamProducer`]); every field is a header to the runner.
//!
//! | broker event | what happens |
//! |---|---|
//! | entry committed or found a duplicate | `XACK` |
//! | poison (no ID, undecodable, conflict, rejected, retries exhausted) | `XADD` to `<stream>:dead-letter` with every original field plus the `idem-dead-letter-*` fields, then `XACK`, in one script (the ack never happens without the dead letter) |
//! | entry without the payload field | dead-lettered by the adapter itself, reason `undecodable` |
//! | shutdown, or a retry given up here | nothing: the entry stays pending |
//! | consumer restarted under the same name | its pending entries are read again first |
//! | consumer gone for good | its pending entries are reclaimed by another member after `min_idle`; [`previous_deliveries`](idem_consumer::Delivery::previous_deliveries) counts the earlier tries |
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use std::sync::Arc;
//! use idem_consumer::{Consumer, Handler, Raw, shutdown};
//! use idem_core::{BoxError, Message, Processor};
//! use idem_redis_streams::RedisStreamSource;
//! use idem_sql::{SqliteOptions, SqliteStore, Tx};
//!
//! struct Record;
//! impl Handler<Tx<sqlx::Sqlite>, Vec<u8>> for Record {
//!     type Output = ();
//!     async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Vec<u8>>) -> Result<(), BoxError> {
//!         sqlx::query("INSERT INTO events (body) VALUES (?)")
//!             .bind(msg.payload().as_slice())
//!             .execute(&mut **tx).await?;
//!         Ok(())
//!     }
//! }
//!
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! let processor = Arc::new(Processor::builder(store, "events").build()?);
//! // The consumer name must be stable per process instance (pod name, hostname).
//! let source = RedisStreamSource::builder("events", "event-recorder", "recorder-0")
//!     .connect("redis://127.0.0.1:6379")
//!     .await?;
//! Consumer::new(processor, source)
//!     .run(Raw, Record, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Bad input: fields are bytes up to Redis's `proto-max-bulk-len` (512 MiB by default), so an
//! ID that is not UTF-8 or holds NUL bytes is processed like any other, and a 10 MiB ID is
//! published and then dead-lettered as `invalid-id`, the dead letter carrying its first 1 KiB
//! ([`DeadLetter::forward`](idem_consumer::DeadLetter::forward)). An entry without the ID
//! field, or with it empty (the producer refuses to write one), is `missing-id`.
//!
//! Redis acknowledges an entry independently of your database: the claim, committed with the
//! side effect, is what makes a reclaimed or re-read entry a harmless duplicate.

mod builder;
mod delivery;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod producer;
mod reply;
mod source;
mod topology;

pub use builder::{
    DEAD_LETTER_SUFFIX, DEFAULT_ID_FIELD, DEFAULT_PAYLOAD_FIELD, RedisStreamSourceBuilder,
    StartFrom,
};
pub use delivery::{ORIGINAL_ID_FIELD, ORIGINAL_STREAM_FIELD, RedisStreamDelivery};
pub use producer::{AsMessageId, RedisStreamProducer};
/// The Redis client this adapter is built on, for naming its types (clients, connections,
/// values).
pub use redis;
pub use source::RedisStreamSource;
pub use topology::ensure_group;
