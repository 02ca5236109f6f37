//! NATS JetStream adapter for idem.
//!
//! [`JetStreamSource`] is a durable pull consumer that feeds idem's
//! [`Consumer`](idem_consumer::Consumer) runner: each message's `Nats-Msg-Id` is claimed in the
//! same database transaction as the handler's writes, the message is acknowledged (a double
//! ack, confirmed by the server) only after that transaction committed, a redelivery becomes a
//! duplicate, and poison messages are published to a dead-letter subject with the reason in
//! headers before the original is acknowledged.
//!
//! Producers use [`NatsProducer`], which stamps `Nats-Msg-Id` and waits for the stream to
//! store the message. JetStream also uses that header to drop re-publishes inside the stream's duplicate
//! window (two minutes by default), but that window is short, covers only publishing, and does
//! nothing about a consumer receiving a message twice; the claim does.
//!
//! Bad input: [`NatsProducer::publish`] refuses, as [`ErrorKind::InvalidMessageId`](idem_core::ErrorKind),
//! an ID that a NATS header cannot carry unchanged (empty, not UTF-8, NUL or other control
//! characters), and, as [`ErrorKind::Rejected`](idem_core::ErrorKind), a message too large
//! for the server: JetStream takes a header block of at most 65 535 bytes (so an ID of about
//! 65 500 bytes at most) and headers plus payload within `max_payload` (1 MiB by default). On
//! the consumer side, an absent `Nats-Msg-Id` and one present but empty (sent by another
//! client) are both dead-lettered as `missing-id`, and an ID over the processor's limit as
//! `invalid-id`, with the ID cut to its first 1 KiB on the dead letter so that the dead
//! letter itself fits the server's limits (see [`DeadLetter::forward`
//! ](idem_consumer::DeadLetter::forward)).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem_consumer::{Consumer, Handler, Json, shutdown};
//! use idem_core::{BoxError, Message, Processor};
//! use idem_nats::{JetStreamSource, NatsProducer};
//! use idem_sql::{SqliteOptions, SqliteStore, Tx};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { id: String }
//!
//! struct Record;
//! impl Handler<Tx<sqlx::Sqlite>, Order> for Record {
//!     type Output = ();
//!     async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Order>) -> Result<(), BoxError> {
//!         sqlx::query("INSERT INTO orders (id) VALUES (?)")
//!             .bind(&msg.payload().id)
//!             .execute(&mut **tx).await?;
//!         Ok(())
//!     }
//! }
//!
//! let producer = NatsProducer::connect("nats://127.0.0.1:4222").await?;
//! idem_nats::ensure_stream(producer.context(), "ORDERS", &["orders.>"]).await?;
//! // Dead letters need a stream of their own, outside what the consumer reads.
//! idem_nats::ensure_stream(producer.context(), "ORDERS_DLQ", &["ORDERS.dead-letter"]).await?;
//!
//! producer.publish("orders.created", "order-42", r#"{"id":"42"}"#).await?;
//!
//! let source = JetStreamSource::builder("ORDERS", "billing")
//!     .filter_subject("orders.created")
//!     .ack_wait(Duration::from_secs(60))
//!     .connect("nats://127.0.0.1:4222")
//!     .await?;
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! let processor = Arc::new(Processor::builder(store, "billing").build()?);
//! Consumer::new(processor, source)
//!     .run(Json::<Order>::new(), Record, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```

mod builder;
mod delivery;
mod error;
mod producer;
mod source;
mod topology;

/// The NATS client this adapter is built on, for naming its types (clients, contexts,
/// headers).
pub use async_nats;
pub use builder::{DEFAULT_ACK_WAIT, DEFAULT_PULL_EXPIRES, JetStreamSourceBuilder};
pub use delivery::{
    JetStreamDelivery, ORIGINAL_HEADER_PREFIX, ORIGINAL_SEQUENCE_HEADER, ORIGINAL_STREAM_HEADER,
    ORIGINAL_SUBJECT_HEADER,
};
pub use producer::NatsProducer;
pub use source::JetStreamSource;
pub use topology::ensure_stream;
