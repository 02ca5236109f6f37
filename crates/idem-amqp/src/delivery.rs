//! One AMQP delivery and how it is settled: `basic.ack`, a confirmed republish to the
//! dead-letter exchange followed by `basic.ack`, or `basic.nack` with requeue.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Weak};

use idem_consumer::{DeadLetter, Delivery};
use idem_core::Error;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{BasicProperties, Channel};

use crate::error::{broker, unavailable};
use crate::headers;
use crate::producer::publish_confirmed;
use crate::source::Settings;

/// Quorum queues count deliveries in this header; classic queues only set `redelivered`.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// A message delivered by an [`AmqpSource`](crate::AmqpSource).
///
/// Dropped without being settled, it stays unacknowledged on its channel (holding one prefetch
/// slot) until that channel or connection closes; only then does RabbitMQ requeue it.
pub struct AmqpDelivery {
    inner: lapin::message::Delivery,
    settings: Arc<Settings>,
    // Weak: a delivery must not keep a dropped source's connection open (see `Session`).
    channel: Weak<Channel>,
}

impl fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpDelivery")
            .field("queue", &self.settings.queue.as_str())
            .field("delivery_tag", &self.inner.delivery_tag)
            .field("redelivered", &self.inner.redelivered)
            .field("message_id", self.inner.properties.message_id())
            .field("len", &self.inner.data.len())
            .finish()
    }
}

impl AmqpDelivery {
    pub(crate) fn new(
        inner: lapin::message::Delivery,
        settings: Arc<Settings>,
        channel: Weak<Channel>,
    ) -> Self {
        Self {
            inner,
            settings,
            channel,
        }
    }

    /// All AMQP basic properties (content type, correlation ID, headers, …).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// The channel-scoped delivery tag.
    pub fn delivery_tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// Whether the broker delivered this message before (to this or another consumer).
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// The exchange it was published to (`""` for the default exchange).
    pub fn exchange(&self) -> &str {
        self.inner.exchange.as_str()
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        self.inner.routing_key.as_str()
    }

    /// Republishes to the dead-letter exchange and waits for the confirm; on any failure the
    /// channel is closed so the original, still unacknowledged, is requeued at once and the
    /// runner's backoff paces the reconnect (a nack would redeliver it in a tight loop while
    /// the dead-letter exchange stays broken).
    async fn publish_dead_letter(&self, reason: &DeadLetter) -> Result<(), Error> {
        let Some(channel) = self.channel.upgrade() else {
            return Err(broker(format!(
                "cannot dead-letter {}: its source was dropped or reconnected; the broker redelivers it",
                self.origin()
            )));
        };
        let (original, note) = headers::forwarded(&self.inner.properties, reason);
        let mut extra = reason.headers();
        extra.extend(note);
        let properties = headers::with_extra_headers(&original, &extra);
        let published = publish_confirmed(
            &channel,
            self.settings.dead_letter_exchange.clone(),
            self.settings.dead_letter_routing_key.clone(),
            &self.inner.data,
            properties,
            self.settings.confirm_timeout,
        )
        .await;
        if published.is_err()
            && channel.status().connected()
            && let Err(e) = channel
                .close(200, "idem: dead-lettering failed".into())
                .await
        {
            tracing::debug!(error = %e, "closing the channel after a failed dead letter");
        }
        published
    }
}

impl Delivery for AmqpDelivery {
    fn payload(&self) -> &[u8] {
        &self.inner.data
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        headers::get(&self.inner.properties, name).and_then(headers::value_bytes)
    }

    fn broker_id(&self) -> Option<Cow<'_, [u8]>> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(|id| Cow::Borrowed(id.as_str().as_bytes()))
    }

    fn previous_deliveries(&self) -> u32 {
        let counted = headers::get(&self.inner.properties, DELIVERY_COUNT_HEADER)
            .and_then(headers::value_u64)
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
        counted.max(u32::from(self.inner.redelivered))
    }

    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "queue {} delivery-tag {}",
            self.settings.queue, self.inner.delivery_tag
        )
    }

    async fn ack(self) -> Result<(), Error> {
        match self.inner.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            // lapin says false when the channel closed (poisoned) or the delivery was already
            // settled; either way the broker did not get an ack and will redeliver.
            Ok(false) => Err(broker(format!(
                "cannot ack {}: its channel is closed; the broker redelivers it",
                self.origin()
            ))),
            Err(e) => Err(unavailable("basic.ack", e)),
        }
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        self.publish_dead_letter(reason).await?;
        // If this ack is lost, the message comes back and is dead-lettered a second time:
        // the dead-letter queue may hold a duplicate, the work queue never loses it.
        self.ack().await
    }

    async fn abandon(self) {
        let requeue = BasicNackOptions {
            requeue: true,
            multiple: false,
        };
        if let Err(e) = self.inner.acker.nack(requeue).await {
            tracing::debug!(error = %e, origin = %self.origin(), "basic.nack failed; the broker requeues on disconnect");
        }
    }
}
