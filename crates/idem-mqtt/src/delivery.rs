//! One MQTT message and how it is settled: a PUBACK on the connection it came on, or a
//! confirmed publish of its dead letter first; and the dead letter's form on each protocol.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use idem_consumer::{DeadLetter, Delivery};
use idem_core::{Error, ErrorKind};
use rumqttc::v5::mqttbytes::v5::PublishProperties;

use crate::ORIGINAL_TOPIC_PROPERTY;
use crate::config::Protocol;
use crate::source::Link;
use crate::wire::Msg;

/// One MQTT message from an [`MqttSource`](crate::MqttSource); settled by the runner.
#[derive(Debug)]
pub struct MqttDelivery {
    msg: Msg,
    /// The connection it arrived on (see [`Link::generation`]).
    generation: u64,
    link: Arc<Link>,
}

impl MqttDelivery {
    pub(crate) fn new(msg: Msg, generation: u64, link: Arc<Link>) -> Self {
        Self {
            msg,
            generation,
            link,
        }
    }

    /// The topic it was published to.
    pub fn topic(&self) -> String {
        self.msg.topic()
    }

    /// The v5 user properties (empty on 3.1.1).
    pub fn user_properties(&self) -> &[(String, String)] {
        self.msg.user_properties()
    }
}

impl Delivery for MqttDelivery {
    fn payload(&self) -> &[u8] {
        self.msg.payload()
    }

    /// The first v5 user property with this name.
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.msg
            .user_properties()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| Cow::Borrowed(v.as_bytes()))
    }

    /// MQTT only says "sent before" (the DUP flag), not how often: 1 or 0.
    fn previous_deliveries(&self) -> u32 {
        u32::from(self.msg.dup())
    }

    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "topic {} pkid {}", self.msg.topic_str(), self.msg.pkid())
    }

    async fn ack(self) -> Result<(), Error> {
        if self.link.generation.load(Ordering::SeqCst) != self.generation {
            // The connection it came on is gone; the broker resends it on the current one,
            // where that copy (a duplicate by then) is acknowledged. Acking the old packet ID
            // here could acknowledge a different message that reuses it.
            tracing::debug!(origin = %self.origin(), "not acknowledging on a newer connection; the broker redelivers and the duplicate is acked");
            return Ok(());
        }
        self.link.client.ack(&self.msg).await
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        let (payload, properties) =
            dead_letter_message(&self.msg, reason, self.link.dead_letters.protocol());
        self.link
            .dead_letters
            .publish(&self.link.dead_letter_topic, payload, properties)
            .await?;
        self.ack().await
    }

    async fn abandon(self) {
        self.link.abandoned.notify_one();
    }
}

/// The dead-lettered copy of `msg`: v5 keeps payload and properties and adds the reason
/// properties; 3.1.1 wraps everything in a [`DeadLetterEnvelope`].
pub(crate) fn dead_letter_message(
    msg: &Msg,
    reason: &DeadLetter,
    protocol: Protocol,
) -> (Bytes, PublishProperties) {
    let topic = msg.topic();
    match protocol {
        Protocol::V5 => {
            let mut props = msg.forwarded_properties();
            // An ID too long for the store is cut short (see `DeadLetter::forward`).
            let mut cut = Vec::new();
            for (name, value) in &mut props.user_properties {
                if reason.cuts(value.len()) {
                    cut.push((name.clone(), value.len()));
                    *value = reason.forward_str(value).into_owned();
                }
            }
            props.user_properties.extend(
                reason
                    .headers()
                    .into_iter()
                    .chain(DeadLetter::truncation_note(&cut))
                    .map(|(k, v)| (k.to_owned(), v)),
            );
            props
                .user_properties
                .push((ORIGINAL_TOPIC_PROPERTY.to_owned(), topic));
            (Bytes::copy_from_slice(msg.payload()), props)
        }
        Protocol::V311 => {
            let mut headers: BTreeMap<String, String> = reason
                .headers()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect();
            headers.insert(ORIGINAL_TOPIC_PROPERTY.to_owned(), topic);
            let envelope = DeadLetterEnvelope {
                headers,
                payload: msg.payload().to_vec(),
            };
            (
                Bytes::from(envelope.to_json()),
                PublishProperties::default(),
            )
        }
    }
}

/// An MQTT 3.1.1 dead letter, which has no properties to carry the reason:
/// `{"headers": {"idem-dead-letter-reason": "conflict", …, "idem-original-topic": "orders"},
/// "payload_base64": "…"}`. The header names are those of a v5 dead letter's user properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterEnvelope {
    /// [`DeadLetter::headers`] plus [`ORIGINAL_TOPIC_PROPERTY`].
    pub headers: BTreeMap<String, String>,
    /// The original payload, byte for byte.
    pub payload: Vec<u8>,
}

impl DeadLetterEnvelope {
    /// The JSON form published to the dead-letter topic.
    pub fn to_json(&self) -> Vec<u8> {
        let value = serde_json::json!({
            "headers": self.headers,
            "payload_base64": BASE64.encode(&self.payload),
        });
        value.to_string().into_bytes()
    }

    /// Reads an envelope back (replay tooling, tests).
    pub fn from_json(bytes: &[u8]) -> Result<Self, Error> {
        let bad = |what: &str| {
            Error::new(
                ErrorKind::Rejected,
                format!("not an idem MQTT dead-letter envelope: {what}"),
            )
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(&e.to_string()))?;
        let headers = value
            .get("headers")
            .and_then(|h| h.as_object())
            .ok_or_else(|| bad("no \"headers\" object"))?
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.as_str().map_or_else(|| v.to_string(), str::to_owned),
                )
            })
            .collect();
        let payload = value
            .get("payload_base64")
            .and_then(|p| p.as_str())
            .ok_or_else(|| bad("no \"payload_base64\" string"))?;
        let payload = BASE64.decode(payload).map_err(|e| bad(&e.to_string()))?;
        Ok(Self { headers, payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips() {
        let e = DeadLetterEnvelope {
            headers: BTreeMap::from([(
                "idem-dead-letter-reason".to_owned(),
                "conflict".to_owned(),
            )]),
            payload: vec![0, 159, 146, 150],
        };
        assert_eq!(DeadLetterEnvelope::from_json(&e.to_json()).unwrap(), e);
        assert!(DeadLetterEnvelope::from_json(b"{}").is_err());
    }
}
