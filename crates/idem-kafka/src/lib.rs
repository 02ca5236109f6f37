//! Kafka adapter for idem: a consumer-group member whose offsets are committed only after the
//! messages below them were processed (their database transaction committed), duplicates, or
//! dead-lettered.
//!
//! * [`KafkaSource`] is an [`idem_consumer::Source`]: a `StreamConsumer` in a consumer group
//!   with auto-commit off. Offsets are committed per partition up to the lowest offset still in
//!   flight, so the runner may settle messages out of order without the commit overtaking an
//!   unfinished one.
//! * The message ID is read from the `message-id` record header ([`MESSAGE_ID_HEADER`]); set it
//!   with [`publish`]. [`IdSource::BrokerId`](idem_consumer::IdSource::BrokerId) (the record's
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
//!   fits `message.max.bytes`. [`publish`] refuses an empty ID and, as
//!   [`ErrorKind::Rejected`], a record over `message.max.bytes` (1 000 000 bytes by default,
//!   ID header included).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use std::sync::Arc;
//! use idem_consumer::{Consumer, Handler, Json, shutdown};
//! use idem_core::{BoxError, Message, Migrate, Processor};
//! use idem_kafka::KafkaSource;
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
//! // Producer side: the ID is the producer's, stable across its retries.
//! let producer = idem_kafka::producer("localhost:9092")?;
//! idem_kafka::publish(&producer, "payments", Some(b"acct-7"), "pay-0001",
//!     br#"{"account":"acct-7","amount_cents":500}"#).await?;
//!
//! // Consumer side.
//! let source = KafkaSource::builder("localhost:9092", "billing")
//!     .topic("payments")
//!     .set_consumer("session.timeout.ms", "10000")
//!     .build()?;
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! store.migrate().await?;
//! let processor = Arc::new(Processor::builder(store, "billing").build()?);
//! Consumer::new(processor, source)
//!     .concurrency(8)
//!     .run(Json::<Payment>::new(), Charge, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```

mod delivery;
mod offsets;
mod source;

use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::AsyncRuntime;

pub use delivery::{
    KafkaDelivery, ORIGINAL_OFFSET_HEADER, ORIGINAL_PARTITION_HEADER, ORIGINAL_TOPIC_HEADER,
};
pub use rdkafka;
pub use source::{KafkaSource, KafkaSourceBuilder};

/// The record header carrying the producer-set message ID, read by default.
pub const MESSAGE_ID_HEADER: &str = "message-id";

/// How long [`publish`] waits for room in the producer's queue.
const PUBLISH_QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a published record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The partition it was written to.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
}

/// A producer for `brokers` with librdkafka's defaults (`acks=all`).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when librdkafka refuses the configuration.
pub fn producer(brokers: &str) -> Result<FutureProducer, Error> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid Kafka producer configuration: {e}"),
            )
            .with_source(e)
        })
}

/// Publishes `payload` to `topic` with the `message-id` header set to `id` and waits for the
/// broker's delivery report.
///
/// Keep `id` stable across the producer's own retries (derive it from the business event, or
/// generate it once and store it with the outbox row); that is what makes a second publish a
/// duplicate for the consumer. Kafka headers are bytes, so `id` is any bytes: a `&str`, a
/// [`MessageId`](idem_core::MessageId), a derived key's
/// [`to_message_id`](idem_core::DerivedKey::to_message_id).
///
/// # Errors
/// [`ErrorKind::InvalidMessageId`] when `id` is empty (every consumer would dead-letter the
/// record as `missing-id`); [`ErrorKind::Rejected`] when the record, key, headers and value
/// together, is larger than the producer's `message.max.bytes` (1 000 000 by default) or the
/// broker's limit: it was not written, and publishing it again cannot succeed;
/// [`ErrorKind::Unavailable`] when the broker did not accept the record otherwise (it may or
/// may not have been written: publishing again with the same `id` is safe).
pub async fn publish<C, R>(
    producer: &FutureProducer<C, R>,
    topic: &str,
    key: Option<&[u8]>,
    id: impl AsRef<[u8]>,
    payload: &[u8],
) -> Result<Published, Error>
where
    C: ClientContext + 'static,
    R: AsyncRuntime,
{
    let id = id.as_ref();
    if id.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidMessageId,
            "message ID is empty; the producer must set a stable ID",
        ));
    }
    let headers = OwnedHeaders::new_with_capacity(1).insert(Header {
        key: MESSAGE_ID_HEADER,
        value: Some(id),
    });
    let mut record = FutureRecord::<[u8], [u8]>::to(topic)
        .payload(payload)
        .headers(headers);
    if let Some(k) = key {
        record = record.key(k);
    }
    match producer.send(record, PUBLISH_QUEUE_TIMEOUT).await {
        Ok(d) => Ok(Published {
            partition: d.partition,
            offset: d.offset,
        }),
        Err((e, _)) => Err(produce_error(&format!("publishing to {topic}"), e)),
    }
}

/// A record too large for the producer's `message.max.bytes` (checked before sending) or the
/// broker's (`MSG_SIZE_TOO_LARGE` in the delivery report) is [`ErrorKind::Rejected`]: it was
/// not written and never will be; anything else is [`ErrorKind::Unavailable`].
pub(crate) fn produce_error(what: &str, e: KafkaError) -> Error {
    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return Error::new(
            ErrorKind::Rejected,
            format!("{what}: the record is too large for Kafka: {e}"),
        )
        .with_source(e);
    }
    unavailable(what, e)
}

pub(crate) fn unavailable(what: &str, e: KafkaError) -> Error {
    Error::new(ErrorKind::Unavailable, format!("{what}: {e}")).with_source(e)
}
