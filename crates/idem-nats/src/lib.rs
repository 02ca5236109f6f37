//! NATS JetStream adapter for idem.
//!
//! [`JetStreamSource`] is a durable pull consumer that feeds idem's
//! [`Consumer`](idem_consumer::Consumer) runner: each message's `Nats-Msg-Id` is claimed in the
//! same database transaction as the handler's writes, the message is acknowledged (a double
//! ack, confirmed by the server) only after that transaction committed, a redelivery becomes a
//! duplicate, and poison messages are published to a dead-letter subject with the reason in
//! headers before the original is acknowledged.
//!
//! Producers use [`publish`], which stamps `Nats-Msg-Id` and waits for the stream to store the
//! message. JetStream also uses that header to drop re-publishes inside the stream's duplicate
//! window (two minutes by default), but that window is short, covers only publishing, and does
//! nothing about a consumer receiving a message twice; the claim does.
//!
//! Bad input: [`publish`] refuses, as [`ErrorKind::InvalidMessageId`](idem_core::ErrorKind),
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
//! use idem_core::{BoxError, Error, ErrorKind, Message, Processor};
//! use idem_nats::JetStreamSource;
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
//! let client = async_nats::connect("nats://127.0.0.1:4222").await
//!     .map_err(|e| Error::new(ErrorKind::Unavailable, e.to_string()))?;
//! let js = async_nats::jetstream::new(client.clone());
//! idem_nats::ensure_stream(&js, "ORDERS", &["orders.>"]).await?;
//! // Dead letters need a stream of their own, outside what the consumer reads.
//! idem_nats::ensure_stream(&js, "ORDERS_DLQ", &["ORDERS.dead-letter"]).await?;
//!
//! idem_nats::publish(&js, "orders.created", "order-42", r#"{"id":"42"}"#).await?;
//!
//! let source = JetStreamSource::builder("ORDERS", "billing")
//!     .filter_subject("orders.created")
//!     .ack_wait(Duration::from_secs(60))
//!     .build(client)
//!     .await?;
//! let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
//! let processor = Arc::new(Processor::builder(store, "billing").build()?);
//! Consumer::new(processor, source)
//!     .run(Json::<Order>::new(), Record, shutdown::on_signal())
//!     .await?;
//! # Ok(()) }
//! ```

mod delivery;
mod error;
mod publish;
mod source;

pub use async_nats;
pub use delivery::{
    JetStreamDelivery, ORIGINAL_HEADER_PREFIX, ORIGINAL_SEQUENCE_HEADER, ORIGINAL_STREAM_HEADER,
    ORIGINAL_SUBJECT_HEADER,
};
pub use publish::{publish, publish_with_headers};
pub use source::{DEFAULT_ACK_WAIT, DEFAULT_PULL_EXPIRES, JetStreamSource, JetStreamSourceBuilder};

use async_nats::jetstream::{self, Context};
use idem_core::Error;

/// Creates stream `name` capturing `subjects` (file storage, limits retention, the server's
/// defaults otherwise) unless a stream of that name exists; an existing stream is left as it
/// is, whatever its subjects. For full control use async-nats's
/// [`Context::get_or_create_stream`] with a [`jetstream::stream::Config`].
///
/// # Errors
/// [`idem_core::ErrorKind::InvalidConfig`] when the server refuses the stream (bad name,
/// subjects overlapping another stream); [`idem_core::ErrorKind::Unavailable`] when it cannot
/// be reached.
pub async fn ensure_stream(js: &Context, name: &str, subjects: &[&str]) -> Result<(), Error> {
    let config = jetstream::stream::Config {
        name: name.to_owned(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    };
    js.get_or_create_stream(config)
        .await
        .map_err(|e| error::api(&format!("creating stream {name}"), e))?;
    Ok(())
}
