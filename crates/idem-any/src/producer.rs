//! URL → a producer that publishes with the message ID where the family's consumers read it.

use idem_core::Error;

use crate::{Broker, BrokerUrl};

/// A producer of whichever family a [`BrokerUrl`] names: every publish carries the message ID
/// in the family's ID slot (`Nats-Msg-Id`, AMQP `message_id`, the Kafka `message-id` header, the
/// Redis Streams `id` field, the MQTT 5 user property) and waits for the broker's confirm.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyProducer {
    /// NATS JetStream.
    #[cfg(feature = "nats")]
    Nats(idem_nats::NatsProducer),
    /// AMQP 0-9-1, through the default exchange (the routing key is the queue).
    #[cfg(feature = "amqp")]
    Amqp(idem_amqp::AmqpProducer),
    /// Kafka, each record keyed by its message ID: a repeat lands on the same partition, as a
    /// producer's retry does.
    #[cfg(feature = "kafka")]
    Kafka(idem_kafka::KafkaProducer),
    /// Redis Streams.
    #[cfg(feature = "redis-streams")]
    RedisStreams(idem_redis_streams::RedisStreamProducer),
    /// MQTT, QoS 1.
    #[cfg(feature = "mqtt")]
    Mqtt(idem_mqtt::MqttProducer),
}

/// What the broker said about one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Published {
    /// The broker itself dropped the message as a repeat: JetStream discards a `Nats-Msg-Id` it
    /// stored within the stream's duplicate window, before any consumer sees it.
    pub duplicate: bool,
}

impl AnyProducer {
    /// Connects to `url`'s broker. `client_id` names the connection where the family needs a
    /// name (MQTT); the others ignore it.
    ///
    /// # Errors
    /// As the family's producer `connect`: [`ErrorKind::Unavailable`](idem_core::ErrorKind)
    /// when the broker cannot be reached.
    pub async fn connect(url: &BrokerUrl, client_id: &str) -> Result<Self, Error> {
        let _ = client_id;
        Ok(match url.broker() {
            #[cfg(feature = "nats")]
            Broker::Nats => Self::Nats(idem_nats::NatsProducer::new(
                crate::nats::connect(url.address()).await?,
            )),
            #[cfg(feature = "amqp")]
            Broker::Amqp => Self::Amqp(idem_amqp::AmqpProducer::connect(url.address()).await?),
            #[cfg(feature = "kafka")]
            Broker::Kafka => Self::Kafka(idem_kafka::KafkaProducer::connect(url.address()).await?),
            #[cfg(feature = "redis-streams")]
            Broker::RedisStreams => Self::RedisStreams(
                idem_redis_streams::RedisStreamProducer::connect(url.address()).await?,
            ),
            #[cfg(feature = "mqtt")]
            Broker::Mqtt => {
                Self::Mqtt(idem_mqtt::MqttProducer::connect(url.address(), client_id).await?)
            }
            #[allow(unreachable_patterns)] // `parse` refuses a family that is not compiled in.
            other => return Err(crate::not_compiled(other)),
        })
    }

    /// MQTT only: refuse a publish that no subscriber receives (the broker would drop it)
    /// instead of counting it as published. The other families keep a message for consumers
    /// that come later.
    pub fn require_subscriber(self, require: bool) -> Self {
        match self {
            #[cfg(feature = "mqtt")]
            Self::Mqtt(p) => Self::Mqtt(p.require_subscriber(require)),
            #[allow(unreachable_patterns)]
            other => {
                let _ = require;
                other
            }
        }
    }

    /// The broker family.
    pub fn broker(&self) -> Broker {
        match self {
            #[cfg(feature = "nats")]
            Self::Nats(_) => Broker::Nats,
            #[cfg(feature = "amqp")]
            Self::Amqp(_) => Broker::Amqp,
            #[cfg(feature = "kafka")]
            Self::Kafka(_) => Broker::Kafka,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(_) => Broker::RedisStreams,
            #[cfg(feature = "mqtt")]
            Self::Mqtt(_) => Broker::Mqtt,
        }
    }

    /// Publishes `payload` with message ID `id` to `destination` (the subject, queue, topic or
    /// stream) and waits for the broker's confirm.
    ///
    /// # Errors
    /// As the family's `publish`: [`ErrorKind::InvalidMessageId`](idem_core::ErrorKind) for an
    /// ID the family cannot carry, [`ErrorKind::Rejected`](idem_core::ErrorKind) for a message
    /// the broker refuses, [`ErrorKind::Unavailable`](idem_core::ErrorKind) otherwise
    /// (publishing again with the same ID is safe).
    pub async fn publish(
        &self,
        destination: &str,
        id: &str,
        payload: &[u8],
    ) -> Result<Published, Error> {
        let mut published = Published::default();
        match self {
            #[cfg(feature = "nats")]
            Self::Nats(p) => {
                let ack = p
                    .publish(destination.to_owned(), id, payload.to_vec())
                    .await?;
                published.duplicate = ack.duplicate;
            }
            #[cfg(feature = "amqp")]
            Self::Amqp(p) => p.publish("", destination, id, payload).await?,
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => {
                p.publish(destination, Some(id.as_bytes()), id, payload)
                    .await?;
            }
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(p) => {
                p.publish(destination, id, payload).await?;
            }
            #[cfg(feature = "mqtt")]
            Self::Mqtt(p) => p.publish(destination, Some(id), payload).await?,
        }
        Ok(published)
    }

    /// Publishes every `(id, payload)` to `destination`, up to `concurrency` in flight (one at
    /// a time on MQTT, whose producer waits for each PUBACK on its connection), each confirmed.
    /// Returns how many the broker dropped as repeats ([`Published::duplicate`]).
    ///
    /// # Errors
    /// The first publish that failed; the ones before it (and some in flight with it) were
    /// published.
    pub async fn publish_all(
        &self,
        destination: &str,
        msgs: &[(String, Vec<u8>)],
        concurrency: usize,
    ) -> Result<u64, Error> {
        let concurrency = if self.broker() == Broker::Mqtt {
            1
        } else {
            concurrency.max(1)
        };
        // Groups joined in turn rather than a buffered stream: a stream combinator's closure
        // here makes the future not provably `Send` for `tokio::spawn`.
        let mut dropped = 0;
        for group in msgs.chunks(concurrency) {
            let pending = group
                .iter()
                .map(|(id, payload)| self.publish(destination, id, payload));
            for published in futures_util::future::join_all(pending).await {
                dropped += u64::from(published?.duplicate);
            }
        }
        Ok(dropped)
    }
}
