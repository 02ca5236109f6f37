//! The producer side: publishing records with the `message-id` header set.

use std::fmt;
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::{MESSAGE_ID_HEADER, error};

/// How long a publish waits for room in the producer's queue.
const PUBLISH_QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a published record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The partition it was written to.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
}

/// Publishes records with the producer-set message ID in the `message-id` header (where
/// [`KafkaSource`](crate::KafkaSource) reads it by default) and waits for each delivery report.
///
/// Keep the ID stable across the producer's own retries (derive it from the business event,
/// or generate it once and store it with the outbox row); that is what makes a second publish
/// a duplicate for the consumer. Kafka headers are bytes, so the ID is any bytes: a `&str`, a
/// [`MessageId`](idem_core::MessageId), a derived key's
/// [`to_message_id`](idem_core::DerivedKey::to_message_id).
#[derive(Clone)]
pub struct KafkaProducer {
    producer: FutureProducer,
    // Known when `connect` made the producer: what `ensure_topics` needs for its admin client.
    brokers: Option<String>,
}

impl fmt::Debug for KafkaProducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaProducer").finish_non_exhaustive()
    }
}

impl KafkaProducer {
    /// A producer for the cluster at `brokers` (`host:port[,host:port…]`) with librdkafka's
    /// defaults (`acks=all`). librdkafka connects in the background: an unreachable cluster
    /// shows up as a failed publish.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when librdkafka refuses the configuration.
    pub async fn connect(brokers: &str) -> Result<Self, Error> {
        let producer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .map_err(|e| error::invalid_config("creating the producer", e))?;
        Ok(Self {
            producer,
            brokers: Some(brokers.to_owned()),
        })
    }

    /// Publishes through a producer the caller configured (security, `linger.ms`,
    /// compression).
    pub fn new(producer: FutureProducer) -> Self {
        Self {
            producer,
            brokers: None,
        }
    }

    /// Creates each of `topics` that does not exist, as [`ensure_topics`](crate::ensure_topics)
    /// does, on the cluster this producer [connected](Self::connect) to.
    ///
    /// # Errors
    /// As [`ensure_topics`](crate::ensure_topics); [`ErrorKind::InvalidConfig`] for a producer
    /// made with [`new`](Self::new), whose cluster address it does not know (call
    /// `ensure_topics` with the caller's own configuration).
    pub async fn ensure_topics(
        &self,
        topics: &[&str],
        partitions: i32,
        replication: i32,
    ) -> Result<(), Error> {
        let Some(brokers) = &self.brokers else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "this Kafka producer was made from a caller's rdkafka producer, so it does not know the cluster's address to create topics",
            ));
        };
        crate::ensure_topics(brokers, topics, partitions, replication).await
    }

    /// The underlying rdkafka producer (to flush it, or to send records without an ID).
    pub fn client(&self) -> &FutureProducer {
        &self.producer
    }

    /// Publishes `payload` to `topic` with the `message-id` header set to `id` (and the record
    /// key `key`, which picks the partition) and waits for the broker's delivery report.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidMessageId`] when `id` is empty (every consumer would dead-letter the
    /// record as `missing-id`); [`ErrorKind::Rejected`] when the record, key, headers and value
    /// together, is larger than the producer's `message.max.bytes` (1 000 000 by default) or
    /// the broker's limit: it was not written, and publishing it again cannot succeed;
    /// [`ErrorKind::Unavailable`] when the broker did not accept the record otherwise (it may
    /// or may not have been written: publishing again with the same `id` is safe).
    pub async fn publish(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        id: impl AsRef<[u8]>,
        payload: &[u8],
    ) -> Result<Published, Error> {
        self.publish_with_headers(topic, key, id, &[], payload)
            .await
    }

    /// [`publish`](Self::publish) with extra record headers, after the `message-id` header.
    ///
    /// # Errors
    /// As [`publish`](Self::publish); [`ErrorKind::InvalidConfig`] when `headers` holds a
    /// `message-id` header of its own (consumers read the first, so it would hide or shadow
    /// the ID).
    pub async fn publish_with_headers(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        id: impl AsRef<[u8]>,
        headers: &[(&str, &[u8])],
        payload: &[u8],
    ) -> Result<Published, Error> {
        let headers = record_headers(id.as_ref(), headers)?;
        let mut record = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(payload)
            .headers(headers);
        if let Some(k) = key {
            record = record.key(k);
        }
        match self.producer.send(record, PUBLISH_QUEUE_TIMEOUT).await {
            Ok(d) => Ok(Published {
                partition: d.partition,
                offset: d.offset,
            }),
            Err((e, _)) => Err(error::produce(format_args!("publishing to {topic}"), e)),
        }
    }
}

/// The record's headers: the ID first, where [`KafkaSource`](crate::KafkaSource) reads it,
/// then the caller's.
fn record_headers(id: &[u8], extra: &[(&str, &[u8])]) -> Result<OwnedHeaders, Error> {
    if id.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidMessageId,
            "message ID is empty; the producer must set a stable ID",
        ));
    }
    let mut headers = OwnedHeaders::new_with_capacity(1 + extra.len()).insert(Header {
        key: MESSAGE_ID_HEADER,
        value: Some(id),
    });
    for (name, value) in extra {
        if *name == MESSAGE_ID_HEADER {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("a header named {MESSAGE_ID_HEADER:?} would shadow the message ID"),
            ));
        }
        headers = headers.insert(Header {
            key: name,
            value: Some(*value),
        });
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use rdkafka::message::Headers;

    use super::*;

    #[test]
    fn the_id_header_comes_first_then_the_callers() {
        let h = record_headers(b"order-42", &[("kind", b"Created"), ("tenant", b"acme")]).unwrap();
        let got: Vec<_> = h.iter().map(|h| (h.key, h.value)).collect();
        assert_eq!(
            got,
            [
                (MESSAGE_ID_HEADER, Some(&b"order-42"[..])),
                ("kind", Some(&b"Created"[..])),
                ("tenant", Some(&b"acme"[..])),
            ]
        );
    }

    #[test]
    fn an_empty_id_or_a_second_id_header_is_refused() {
        let e = record_headers(b"", &[]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidMessageId);
        let e = record_headers(b"x", &[(MESSAGE_ID_HEADER, b"y")]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
    }
}
