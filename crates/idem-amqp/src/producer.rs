//! Publishing with the broker's confirmation: the producer, and the step every dead letter
//! goes through before its original is acked.

use std::fmt;
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use crate::error::{broker, short_string, unavailable};
use crate::source::{connect_channel, parse_url};

const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes `payload` as mandatory on a channel in confirm mode and waits until the broker
/// has taken responsibility for it: confirmed (not nacked) and routed to at least one queue.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: ShortString,
    routing_key: ShortString,
    payload: &[u8],
    properties: BasicProperties,
    timeout: Duration,
) -> Result<(), Error> {
    let target = format!("exchange {exchange:?} routing key {routing_key:?}");
    let publish = async {
        // `mandatory`: an unroutable message is returned instead of silently dropped; for a
        // dead letter that would be a lost message.
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        channel
            .basic_publish(exchange, routing_key, options, payload, properties)
            .await
            .map_err(|e| unavailable("basic.publish", e))?
            .await
            .map_err(|e| unavailable("publisher confirm", e))
    };
    let confirmation = tokio::time::timeout(timeout, publish).await.map_err(|_| {
        broker(format!(
            "no AMQP publisher confirm for {target} within {timeout:?}"
        ))
    })??;
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(unavailable(
            format_args!("publishing to {target}"),
            format!(
                "unroutable ({} {}); bind a queue to it",
                returned.reply_code, returned.reply_text
            ),
        )),
        Confirmation::Nack(_) => Err(unavailable(
            format_args!("publishing to {target}"),
            "the broker nacked the message",
        )),
        Confirmation::NotRequested => Err(broker(format!(
            "publish to {target} was not confirmed: the channel is not in confirm mode"
        ))),
    }
}

/// Publishes with the `message_id` property set (where [`AmqpSource`](crate::AmqpSource)
/// reads it by default), persistent delivery, and waits for the broker's publisher confirm.
///
/// Any ID that is UTF-8 and at most 255 bytes works (AMQP's `message_id` is a short string):
/// `"order-42"`, a [`MessageId`](idem_core::MessageId), or, for messages a handler publishes,
/// a derived key's [`to_message_id`](idem_core::DerivedKey::to_message_id) so that
/// reprocessing publishes the same ID again and downstream sees a duplicate.
pub struct AmqpProducer {
    channel: Channel,
    // Kept so that the connection closes with the producer when it owns one.
    connection: Option<Connection>,
    confirm_timeout: Duration,
}

impl fmt::Debug for AmqpProducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpProducer")
            .field("channel", &self.channel.id())
            .field("owns_connection", &self.connection.is_some())
            .field("confirm_timeout", &self.confirm_timeout)
            .finish()
    }
}

impl AmqpProducer {
    /// Opens its own connection to the broker at `url` (`amqp://user:password@host:5672/%2f`)
    /// and a channel in confirm mode.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a malformed URL; [`ErrorKind::Unavailable`] when the
    /// broker cannot be reached or refuses the login.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let (connection, channel) = connect_channel(parse_url(url)?, "idem producer").await?;
        let mut producer = Self::new(channel).await?;
        producer.connection = Some(connection);
        Ok(producer)
    }

    /// Publishes on a channel the caller opened; puts it in confirm mode (a channel cannot
    /// leave it, and transactions cannot be used on it afterwards).
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when the broker refuses confirm mode on the channel.
    pub async fn new(channel: Channel) -> Result<Self, Error> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("confirm.select", e))?;
        Ok(Self {
            channel,
            connection: None,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
        })
    }

    /// How long a publish waits for the broker's confirm (default 30 s).
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// The channel, e.g. to declare a [`Topology`](crate::Topology) before publishing.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes `payload` to `exchange` (`""` is the default exchange, where the routing key
    /// is the queue name) with `message_id` = `id`, persistent, and waits for the confirm.
    /// An unroutable message is an error, not a silent drop.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        id: impl AsRef<[u8]>,
        payload: &[u8],
    ) -> Result<(), Error> {
        self.publish_with(
            exchange,
            routing_key,
            Some(id.as_ref()),
            payload,
            BasicProperties::default(),
        )
        .await
    }

    /// Like [`publish`](Self::publish) with caller-chosen properties (headers, content type,
    /// correlation ID); `id` (if any) overrides `message_id`, and delivery is persistent unless
    /// `properties` says otherwise. `None` publishes without an ID: consumers dead-letter such
    /// messages as `missing-id` unless they read the ID elsewhere.
    pub async fn publish_with(
        &self,
        exchange: &str,
        routing_key: &str,
        id: Option<&[u8]>,
        payload: &[u8],
        mut properties: BasicProperties,
    ) -> Result<(), Error> {
        if let Some(id) = id {
            properties = properties.with_message_id(message_id(id)?);
        }
        if properties.delivery_mode().is_none() {
            properties = properties.with_delivery_mode(2);
        }
        publish_confirmed(
            &self.channel,
            short_string("exchange", exchange)?,
            short_string("routing key", routing_key)?,
            payload,
            properties,
            self.confirm_timeout,
        )
        .await
    }

    /// Closes the channel, and the connection if [`connect`](Self::connect) opened it.
    pub async fn close(self) -> Result<(), Error> {
        if self.channel.status().connected() {
            self.channel
                .close(200, "OK".into())
                .await
                .map_err(|e| unavailable("channel.close", e))?;
        }
        if let Some(connection) = self.connection
            && connection.status().connected()
        {
            connection
                .close(200, "OK".into())
                .await
                .map_err(|e| unavailable("connection.close", e))?;
        }
        Ok(())
    }
}

/// AMQP's `message_id` is a short string: UTF-8, 1..=255 bytes.
fn message_id(id: &[u8]) -> Result<ShortString, Error> {
    let invalid = |why: &str| Error::new(ErrorKind::InvalidMessageId, format!("message ID {why}"));
    if id.is_empty() {
        return Err(invalid("is empty"));
    }
    let text = std::str::from_utf8(id)
        .map_err(|_| invalid("is not UTF-8; AMQP's message_id property holds text only"))?;
    ShortString::try_new(text).map_err(|_| {
        invalid(&format!(
            "is {} bytes; AMQP's message_id holds at most 255",
            id.len()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_must_be_short_utf8_text() {
        assert_eq!(
            message_id(b"order-42").map(String::from).ok(),
            Some("order-42".into())
        );
        for bad in [&b""[..], &[0xff, 0xfe][..], "x".repeat(256).as_bytes()] {
            let e = message_id(bad).err().map(|e| e.kind());
            assert_eq!(e, Some(ErrorKind::InvalidMessageId));
        }
    }
}
