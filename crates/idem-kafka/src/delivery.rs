//! One consumed Kafka record and how it is settled: mark its offset done, or copy it to the
//! dead-letter topic first.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::{DeadLetter, Delivery};
use idem_core::Error;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::error;
use crate::offsets::{Offsets, Ticket};
use crate::source::lock;

/// Header on a dead letter naming the topic the message was consumed from.
pub const ORIGINAL_TOPIC_HEADER: &str = "idem-original-topic";
/// Header on a dead letter naming the partition the message was consumed from.
pub const ORIGINAL_PARTITION_HEADER: &str = "idem-original-partition";
/// Header on a dead letter naming the offset the message had in its partition.
pub const ORIGINAL_OFFSET_HEADER: &str = "idem-original-offset";

/// State every delivery of one source shares with it.
pub(crate) struct Shared {
    pub(crate) offsets: Arc<Mutex<Offsets>>,
    pub(crate) producer: FutureProducer,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) send_timeout: Duration,
}

/// One record from a [`KafkaSource`](crate::KafkaSource), owned (detached from the consumer's
/// buffers), settled exactly once by the runner.
pub struct KafkaDelivery {
    msg: OwnedMessage,
    ticket: Ticket,
    shared: Arc<Shared>,
}

impl fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("topic", &self.msg.topic())
            .field("partition", &self.msg.partition())
            .field("offset", &self.msg.offset())
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    pub(crate) fn new(msg: OwnedMessage, ticket: Ticket, shared: Arc<Shared>) -> Self {
        Self {
            msg,
            ticket,
            shared,
        }
    }

    /// The record's topic.
    pub fn topic(&self) -> &str {
        self.msg.topic()
    }

    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.msg.partition()
    }

    /// The record's offset in its partition.
    pub fn offset(&self) -> i64 {
        self.msg.offset()
    }

    /// The record's key, if it has one.
    pub fn key(&self) -> Option<&[u8]> {
        self.msg.key()
    }

    fn settle(&self) {
        if !lock(&self.shared.offsets).settle(&self.ticket) {
            tracing::debug!(origin = %self.origin(), "settled after its partition was revoked; the new owner will see it again");
        }
    }

    fn dead_letter_topic(&self) -> Cow<'_, str> {
        match &self.shared.dead_letter_topic {
            Some(t) => Cow::Borrowed(t),
            None => Cow::Owned(format!("{}.dead-letter", self.msg.topic())),
        }
    }
}

impl Delivery for KafkaDelivery {
    /// The record's value; a null value (tombstone) reads as empty.
    fn payload(&self) -> &[u8] {
        self.msg.payload().unwrap_or(&[])
    }

    /// The last header named `name` (Kafka allows repeats; the last one wins, as in the Java
    /// client's `lastHeader`). A header with a null value reads as empty.
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.msg
            .headers()?
            .iter()
            .filter(|h| h.key == name)
            .last()
            .map(|h| Cow::Borrowed(h.value.unwrap_or(&[])))
    }

    /// `topic/partition/offset`. Only for [`IdSource::BrokerId`](idem_consumer::IdSource),
    /// an explicit opt-in: it makes a *redelivery* of the same record a duplicate (rebalance,
    /// crash before commit), but a producer that publishes the same message twice creates two
    /// records with two offsets, and both are processed. Prefer the `message-id` header.
    fn broker_id(&self) -> Option<Cow<'_, [u8]>> {
        Some(Cow::Owned(
            format!(
                "{}/{}/{}",
                self.msg.topic(),
                self.msg.partition(),
                self.msg.offset()
            )
            .into_bytes(),
        ))
    }

    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}@{}",
            self.msg.topic(),
            self.msg.partition(),
            self.msg.offset()
        )
    }

    /// Marks the offset settled; it is committed once every lower offset of the partition is.
    async fn ack(self) -> Result<(), Error> {
        self.settle();
        Ok(())
    }

    /// Produces a copy (same key, value and headers, plus the reason headers and
    /// `idem-original-topic` / `-partition` / `-offset`; on an `invalid-id` dead letter a header
    /// value over 1 KiB is cut short, see [`DeadLetter::forward`]) to the dead-letter topic, waits for
    /// the broker's delivery report, then marks the offset settled. On failure the offset stays
    /// unsettled, which holds back the partition's commit until a restart or rebalance
    /// redelivers it.
    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        // The original headers, an ID too long for the store cut short (see `DeadLetter::forward`).
        let mut headers = OwnedHeaders::new_with_capacity(8);
        let mut cut = Vec::new();
        for h in self.msg.headers().iter().flat_map(|hs| hs.iter()) {
            if let Some(v) = h.value
                && reason.cuts(v.len())
            {
                cut.push((h.key, v.len()));
            }
            headers = headers.insert(Header {
                key: h.key,
                value: h.value.map(|v| reason.forward(v)).as_deref(),
            });
        }
        let note = DeadLetter::truncation_note(&cut);
        let partition = self.msg.partition().to_string();
        let offset = self.msg.offset().to_string();
        let reason_headers = reason.headers();
        let extra = reason_headers
            .iter()
            .chain(note.iter())
            .map(|(k, v)| (*k, v.as_str()))
            .chain([
                (ORIGINAL_TOPIC_HEADER, self.msg.topic()),
                (ORIGINAL_PARTITION_HEADER, partition.as_str()),
                (ORIGINAL_OFFSET_HEADER, offset.as_str()),
            ]);
        for (key, value) in extra {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let topic = self.dead_letter_topic();
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
        // A null value stays null and an absent key stays absent: the copy is byte-identical.
        if let Some(p) = self.msg.payload() {
            record = record.payload(p);
        }
        if let Some(k) = self.msg.key() {
            record = record.key(k);
        }
        match self
            .shared
            .producer
            .send(record, self.shared.send_timeout)
            .await
        {
            Ok(_) => {
                self.settle();
                Ok(())
            }
            Err((e, _)) => Err(error::produce(
                format_args!("publishing the dead letter of {} to {topic}", self.origin()),
                e,
            )),
        }
    }

    /// Leaves the offset unsettled: Kafka cannot redeliver one record, so the partition's
    /// committed offset stays below it for the rest of this consumer's life and the record is
    /// consumed again after a restart or rebalance.
    async fn abandon(self) {
        tracing::debug!(origin = %self.origin(), "abandoned; the partition's commit stays below it until a restart or rebalance");
    }
}
