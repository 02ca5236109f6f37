//! Kafka adapter for idem: a consumer-group member whose offsets are committed only after the
//! messages below them were processed (their database transaction committed), duplicates, or
//! dead-lettered.
//!
//! * [`KafkaSource`] is an [`idem_consumer::Source`]: a `StreamConsumer` in a consumer group
//!   with auto-commit off. Offsets are committed per partition up to the lowest offset still in
//!   flight, so the runner may settle messages out of order without the commit overtaking an
//!   unfinished one.
//! * The message ID is read from the `message-id` record header ([`MESSAGE_ID_HEADER`]); set it
//!   with [`KafkaProducer::publish`]. [`IdSource::BrokerId`](idem_consumer::IdSource::BrokerId) (the record's
//!   `topic/partition/offset`) is an explicit opt-in that only protects against redelivery,
//!   not against a producer publishing the same message twice.
//! * Dead letters go to `<topic>.dead-letter` (configurable) with the original key, value and
//!   headers, the reason headers, and [`ORIGINAL_TOPIC_HEADER`] / [`ORIGINAL_PARTITION_HEADER`]
//!   / [`ORIGINAL_OFFSET_HEADER`].
//! * Bad input: the ID is bytes, so an ID that is not UTF-8 or holds NUL bytes is processed
//!   like any other. A record without the `message-id` header, with it empty, or with a null
//!   value is dead-lettered as `missing-id` — the record key is never read as the ID. An ID
//!   over the processor's limit is `invalid-id`, cut to its first 1 KiB on the dead letter
//!   ([`DeadLetter::forward`](idem_consumer::DeadLetter::forward)) so that the copy still
//!   fits `message.max.bytes`. [`KafkaProducer::publish`] refuses an empty ID and, as
//!   [`ErrorKind::Rejected`](idem_core::ErrorKind::Rejected), a record over
//!   `message.max.bytes` (1 000 000 bytes by default, ID header included).
//! * [`ensure_topics`] creates the topic and its dead-letter topic where the cluster does not
//!   create topics on first use.
//! * Static membership (KIP-345) is one call:
//!   [`KafkaSourceBuilder::static_member`]`(instance_id)`. A replica restarted within the
//!   session timeout ([`STATIC_SESSION_TIMEOUT`], 45 s, by default) takes its partitions back
//!   and the rest of the group is not rebalanced; the price is that a static member never
//!   leaves the group, so the partitions of one that stops for good wait that long for
//!   another member. [`KafkaSource::membership`] shows what the group did to a member
//!   (assignments, revocations, the partitions it holds).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use std::sync::Arc;
//! use idem_consumer::{Consumer, Handler, Json, shutdown};
//! use idem_core::{BoxError, Message, Migrate, Processor};
//! use idem_kafka::{KafkaProducer, KafkaSource};
//! use idem_sql::{SqliteOptions, SqliteStore, Tx};
//!
//! #[derive(serde::Deserialize)]
//! struct Payment { account: String, amount_cents: i64 }
//!
//! struct Charge;
//! impl Handler<Tx<sqlx::Sqlite>, Payment> for Charge {
//!     type Output = ();
//!     async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Payment>) -> Result<(), BoxError> {
//!         let p = msg.payload();
//!         sqlx::query("UPDATE accounts SET balance = balance - ? WHERE id = ?")
//!             .bind(p.amount_cents).bind(&p.account)
//!             .execute(&mut **tx).await?;
//!         Ok(())
//!     }
//! }
//!
//! // The topic and its dead-letter topic, one partition and one replica each.
//! idem_kafka::ensure_topics("localhost:9092", &["payments", "payments.dead-letter"], 1, 1).await?;
//!
//! // Producer side: the ID is the producer's, stable across its retries.
//! let producer = KafkaProducer::connect("localhost:9092").await?;
//! producer.publish("payments", Some(b"acct-7"), "pay-0001",
//!     br#"{"account":"acct-7","amount_cents":500}"#).await?;
//!
//! // Consumer side: replica `billing-0` of the group, the same name after every restart.
//! let source = KafkaSource::builder("payments", "billing")
//!     .static_member("billing-0")
//!     .connect("localhost:9092")
//!     .await?;
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! store.migrate().await?;
//! let processor = Arc::new(Processor::builder(store, "billing").build()?);
//! Consumer::new(processor, source)
//!     .concurrency(8)
//!     .run(Json::<Payment>::new(), Charge, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```

mod builder;
mod delivery;
mod error;
mod membership;
mod offsets;
mod producer;
mod source;
mod topology;

pub use builder::KafkaSourceBuilder;
pub use delivery::{
    KafkaDelivery, ORIGINAL_OFFSET_HEADER, ORIGINAL_PARTITION_HEADER, ORIGINAL_TOPIC_HEADER,
};
pub use membership::{Membership, STATIC_SESSION_TIMEOUT};
pub use producer::{KafkaProducer, Published};
/// The Kafka client this adapter is built on, for naming its types (configs, producers,
/// records, the admin client).
pub use rdkafka;
pub use source::KafkaSource;
pub use topology::{delete_topics, ensure_topics};

/// The record header carrying the producer-set message ID, read by default.
pub const MESSAGE_ID_HEADER: &str = "message-id";
