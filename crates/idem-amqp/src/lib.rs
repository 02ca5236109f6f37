//! RabbitMQ (AMQP 0-9-1) adapter for idem's consumer runner.
//!
//! [`AmqpSource`] consumes one queue with manual acknowledgements and a prefetch limit; the
//! runner acks a delivery only after its transaction committed (or it was a duplicate). The
//! message ID is read from the AMQP `message_id` property by default
//! ([`IdSource::BrokerId`](idem_consumer::IdSource)). Poison messages are republished, payload
//! and properties intact plus idem's reason headers, to a dead-letter exchange with publisher
//! confirms, and only then acked. [`Topology`] declares the work queue, its dead-letter
//! exchange and its dead-letter queue; [`AmqpPublisher`] publishes with `message_id` set and
//! waits for the broker's confirm.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_amqp::{AmqpPublisher, AmqpSource, Topology};
//!
//! let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
//! let topology = Topology::new("payments"); // dead letters: payments.dlx -> payments.dead
//! let publisher = AmqpPublisher::connect(url).await?;
//! topology.declare(publisher.channel()).await?;
//!
//! // The producer sets a stable ID; a retried publish is then a duplicate, not a second charge.
//! publisher.publish("", "payments", "order-42/payment", br#"{"cents":1250}"#).await?;
//!
//! let source = topology.source(url).prefetch(32).connect().await?;
//! // idem_consumer::Consumer::new(processor, source).run(decoder, handler, shutdown).await?;
//! # drop(source); Ok(()) }
//! ```
//!
//! Bad input: `message_id` is an AMQP short string, so [`AmqpPublisher`] refuses, as
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

mod delivery;
mod error;
mod headers;
mod publisher;
mod source;
mod topology;

pub use delivery::AmqpDelivery;
pub use publisher::AmqpPublisher;
pub use source::{AmqpSource, AmqpSourceBuilder};
pub use topology::{Topology, declare_queue_with_dead_letters};

/// The lapin version this crate is built on, for naming [`lapin::Channel`] and property types.
pub use lapin;
