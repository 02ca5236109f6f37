//! URL → a producer that publishes with the message ID where the family's consumers read it.

use idem_core::Error;

use crate::{Broker, BrokerUrl};

/// A producer of whichever family a [`BrokerUrl`] names: every publish carries the message ID
/// in the family's ID slot (`Nats-Msg-Id`, AMQP `message_id`, the Kafka `message-id` header, the
/// Redis Streams `message_id` field, the MQTT 5 `message-id` user property) and waits for the
/// broker's confirm.
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
        self.publish_with_headers(destination, id, &[], payload)
            .await
    }

    /// [`publish`](Self::publish) with `headers`, each where that family's consumers read
    /// headers ([`Delivery::header`](idem_consumer::Delivery::header)): NATS headers, AMQP
    /// header-table entries (long strings), Kafka record headers, Redis Streams fields, MQTT 5
    /// user properties. The message ID stays in its own slot.
    ///
    /// # Errors
    /// As [`publish`](Self::publish), and [`ErrorKind::InvalidConfig`](idem_core::ErrorKind)
    /// for a header the family cannot carry: one named like the family's ID slot
    /// (`Nats-Msg-Id`, Kafka's `message-id`, the Redis `message_id` and `payload` fields, the
    /// MQTT `message-id` property), a NATS name outside printable ASCII or with `:`, a NATS
    /// value with a line break, an AMQP name over 255 bytes, any header on MQTT 3.1.1.
    pub async fn publish_with_headers(
        &self,
        destination: &str,
        id: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<Published, Error> {
        let mut published = Published::default();
        match self {
            #[cfg(feature = "nats")]
            Self::Nats(p) => {
                let map = crate::headers::nats(headers)?;
                let ack = p
                    .publish_with_headers(destination.to_owned(), id, map, payload.to_vec())
                    .await?;
                published.duplicate = ack.duplicate;
            }
            #[cfg(feature = "amqp")]
            Self::Amqp(p) => {
                let properties = crate::headers::amqp(headers)?;
                p.publish_with("", destination, Some(id.as_bytes()), payload, properties)
                    .await?;
            }
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => {
                let extra: Vec<(&str, &[u8])> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_bytes()))
                    .collect();
                p.publish_with_headers(destination, Some(id.as_bytes()), id, &extra, payload)
                    .await?;
            }
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(p) => {
                let fields = crate::headers::redis(headers)?;
                p.publish_with_fields(destination, id, payload, &fields)
                    .await?;
            }
            #[cfg(feature = "mqtt")]
            Self::Mqtt(p) => {
                let props: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                p.publish_with_properties(destination, Some(id), &props, payload)
                    .await?;
            }
        }
        Ok(published)
    }

    /// Creates what publishing to `name` needs, if missing, as
    /// [`BrokerUrl::ensure_destination`] does for a consumer (the same declarations, so a
    /// consumer's own declaration later agrees with it), over this producer's connection: the
    /// JetStream stream `name` capturing subject `name` and its dead-letter stream; the AMQP
    /// queue with its dead-letter exchange and queue; the Kafka topic and its dead-letter
    /// topic. Redis Streams and MQTT need nothing (an MQTT broker drops a message no session
    /// subscribes to: see [`require_subscriber`](Self::require_subscriber)).
    ///
    /// # Errors
    /// As [`BrokerUrl::ensure_destination`]; a NATS stream name cannot hold `.`, so a dotted
    /// subject needs a stream the operator made.
    pub async fn ensure_destination(&self, name: &str) -> Result<(), Error> {
        match self {
            #[cfg(feature = "nats")]
            Self::Nats(p) => crate::nats::ensure_topology(p.context(), name).await,
            #[cfg(feature = "amqp")]
            Self::Amqp(p) => idem_amqp::ensure_queue(p.channel(), name).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => {
                let dead = crate::names::dead_letters(Broker::Kafka, name);
                p.ensure_topics(&[name, &dead], 1, 1).await
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = name;
                Ok(())
            }
        }
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
