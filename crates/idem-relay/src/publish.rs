//! What the relay publishes through: the [`Publish`] trait, and its implementation for
//! [`AnyProducer`], the broker a URL names.

use std::future::Future;

use idem_any::AnyProducer;
use idem_core::outbox::Outgoing;
use idem_core::{Error, ErrorKind};

/// A broker the relay publishes outbox rows to.
///
/// `publish` returns only once the broker confirmed the message (a JetStream ack, an AMQP
/// publisher confirm, a Kafka delivery report, Redis's reply to `XADD`, an MQTT PUBACK): the
/// relay marks a row sent on `Ok` and never before. Its error's
/// [`ErrorKind`](idem_core::ErrorKind) decides what happens to the row (see the crate docs):
/// `Rejected`, `InvalidMessageId` and `InvalidConfig` dead-letter it, anything else retries it
/// later.
pub trait Publish: Send + Sync + 'static {
    /// Publishes `msg` with its ID where the next consumer reads IDs, its headers where it
    /// reads headers, and waits for the broker's confirm.
    fn publish(&self, msg: &Outgoing) -> impl Future<Output = Result<(), Error>> + Send;

    /// Creates `destination` on the broker if it is missing, the way a consumer creates its
    /// source, so that the first row for a new destination is not refused. Called once per
    /// destination and relay run before its first publish; an error is logged and the
    /// publish goes ahead (it decides). Default: nothing to create.
    fn ensure_destination(
        &self,
        destination: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let _ = destination;
        async { Ok(()) }
    }
}

/// Publishes with the message ID in the family's ID slot and the headers in its header slot
/// ([`AnyProducer::publish_with_headers`]); creates destinations as
/// [`AnyProducer::ensure_destination`] does: NATS JetStream streams (a stream named like the
/// subject, which NATS refuses for dotted subjects: create those streams yourself), AMQP
/// queues with their dead-letter exchange and queue, Kafka topics; nothing on Redis Streams
/// and MQTT. On MQTT a message that no session subscribes to is dropped by the broker unless
/// the producer [requires a subscriber](AnyProducer::require_subscriber), in which case the
/// publish fails as `Unavailable` and the row waits for one.
///
/// An `AnyProducer` is one connection: on AMQP a channel the broker closed (a restart, or a
/// queue declaration it refused because the queue exists with other arguments) stays closed
/// and every later publish fails. A relay that runs for long should publish through
/// [`BrokerPublisher`](crate::BrokerPublisher), which reconnects and declares on a connection
/// of its own.
impl Publish for AnyProducer {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        // Every family carries the ID as text; derived IDs always are.
        let id = std::str::from_utf8(msg.id().as_bytes()).map_err(|_| {
            Error::new(
                ErrorKind::InvalidMessageId,
                "an outgoing message ID must be UTF-8 for a broker header to carry it",
            )
        })?;
        self.publish_with_headers(msg.destination(), id, msg.headers(), msg.payload())
            .await?;
        Ok(())
    }

    async fn ensure_destination(&self, destination: &str) -> Result<(), Error> {
        AnyProducer::ensure_destination(self, destination).await
    }
}
