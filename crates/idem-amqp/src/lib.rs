//! RabbitMQ (AMQP 0-9-1) adapter for idem's consumer runner.
//!
//! [`AmqpSource`] consumes one queue with manual acknowledgements and a prefetch limit; the
//! runner acks a delivery only after its transaction committed (or it was a duplicate). The
//! message ID is read from the AMQP `message_id` property by default
//! ([`IdSource::BrokerId`](idem_consumer::IdSource)). Poison messages are republished, payload
//! and properties intact plus idem's reason headers, to a dead-letter exchange with publisher
//! confirms, and only then acked. [`ensure_queue`] (or [`Topology`], for other names)
//! declares the work queue, its dead-letter exchange and its dead-letter queue;
//! [`AmqpProducer`] publishes with `message_id` set and waits for the broker's confirm.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_amqp::{AmqpProducer, AmqpSource};
//!
//! let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
//! let producer = AmqpProducer::connect(url).await?;
//! // Dead letters: payments.dlx -> payments.dead.
//! idem_amqp::ensure_queue(producer.channel(), "payments").await?;
//!
//! // The producer sets a stable ID; a retried publish is then a duplicate, not a second charge.
//! producer.publish("", "payments", "order-42/payment", br#"{"cents":1250}"#).await?;
//!
//! // Prefetch: what the runner keeps in flight (concurrency × batch size).
//! let source = AmqpSource::builder("payments").prefetch(32).connect(url).await?;
//! // idem_consumer::Consumer::new(processor, source).run(decoder, handler, shutdown).await?;
//! # drop(source); Ok(()) }
//! ```
//!
//! Bad input: `message_id` is an AMQP short string, so [`AmqpProducer`] refuses, as
//! [`ErrorKind::InvalidMessageId`](idem_core::ErrorKind), an ID that is empty, not UTF-8 or
//! over 255 bytes; NUL bytes are text and go through, and are processed like any other ID. A
//! message without `message_id`, or with it set empty by another client, is dead-lettered
//! as `missing-id`; a 255-byte ID over the processor's limit as `invalid-id`. Large payloads
//! are carried and dead-lettered whole, within RabbitMQ's `max_message_size` (128 MiB by
//! default).
//!
//! Redelivery: RabbitMQ requeues unacknowledged messages as soon as the consumer's channel or
//! connection closes, and marks them `redelivered`. Classic queues do not count deliveries, so
//! [`Delivery::previous_deliveries`](idem_consumer::Delivery::previous_deliveries) is 1 for any
//! redelivery there; quorum queues ([`Topology::quorum`]) send `x-delivery-count`, which is used
//! when present.

mod builder;
mod delivery;
mod error;
mod headers;
mod producer;
mod source;
mod topology;

pub use builder::{AmqpSourceBuilder, DEFAULT_PREFETCH};
pub use delivery::AmqpDelivery;
/// The AMQP client this adapter is built on, for naming [`lapin::Channel`] and property types.
pub use lapin;
pub use producer::AmqpProducer;
pub use source::AmqpSource;
pub use topology::{Topology, ensure_queue};
