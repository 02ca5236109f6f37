//! Publishing with confirmation: dead letters and the producer helper.
//!
//! rumqttc reports a PUBACK as an event of the event loop, not as the result of `publish`. To
//! tie the PUBACK to the publish without guessing, a publisher has its own connection (clean
//! session) and sends one message at a time, polling that connection itself until the packet ID
//! it was given comes back acknowledged. Nothing else publishes there, so no event is ambiguous;
//! after any failure the connection is discarded, so no stale request survives into the next
//! publish.

use std::collections::BTreeMap;
use std::time::Instant;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use idem_consumer::DeadLetter;
use idem_core::{Error, ErrorKind};
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use tokio::sync::Mutex;

use crate::config::{MqttConfig, Protocol, invalid};
use crate::wire::{self, Client, Loop, Msg, Polled, PubAckOutcome};
use crate::{MESSAGE_ID_PROPERTY, ORIGINAL_TOPIC_PROPERTY};

/// A confirmed-publish connection, opened on first use and reopened after failures.
#[derive(Debug)]
pub(crate) struct Publisher {
    config: MqttConfig,
    client_id: String,
    require_subscriber: bool,
    conn: Mutex<Option<Conn>>,
}

#[derive(Debug)]
struct Conn {
    client: Client,
    event_loop: Loop,
    last_used: Instant,
}

impl Publisher {
    pub(crate) fn new(config: MqttConfig, client_id: String) -> Self {
        Self {
            require_subscriber: config.require_dead_letter_subscriber,
            config,
            client_id,
            conn: Mutex::new(None),
        }
    }

    pub(crate) fn protocol(&self) -> Protocol {
        self.config.protocol
    }

    /// Publishes at QoS 1 and returns once the broker acknowledged it.
    pub(crate) async fn publish(
        &self,
        topic: &str,
        payload: Bytes,
        properties: PublishProperties,
    ) -> Result<(), Error> {
        let mut conn = self.conn.lock().await;
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Nobody polls an idle publisher, so no pings: the broker may have dropped it.
            if conn
                .as_ref()
                .is_some_and(|c| c.last_used.elapsed() >= self.config.keep_alive)
            {
                *conn = None;
            }
            let c = conn.get_or_insert_with(|| {
                let (client, event_loop) = wire::open(&self.config, &self.client_id, false);
                Conn {
                    client,
                    event_loop,
                    last_used: Instant::now(),
                }
            });
            let sent = tokio::time::timeout(
                self.config.publish_timeout,
                c.publish_confirmed(topic, payload.clone(), properties.clone()),
            )
            .await;
            let err = match sent {
                Ok(Ok(PubAckOutcome::Accepted)) => None,
                Ok(Ok(PubAckOutcome::NoSubscribers)) if !self.require_subscriber => None,
                Ok(Ok(PubAckOutcome::NoSubscribers)) => Some(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "no client subscribes to {topic:?}, so the broker dropped the message; give it a persistent subscriber"
                    ),
                )),
                Ok(Ok(PubAckOutcome::Refused(reason))) => Some(Error::new(
                    ErrorKind::Unavailable,
                    format!("the broker refused the publish to {topic:?}: {reason}"),
                )),
                // A broken connection is retried once on a fresh one: the common case is a
                // connection the broker closed while idle.
                Ok(Err(e)) if attempt < 2 => {
                    tracing::debug!(error = %e, "MQTT publish connection failed; reconnecting once");
                    *conn = None;
                    continue;
                }
                Ok(Err(e)) => Some(e),
                Err(_) => Some(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "no PUBACK for the publish to {topic:?} within {:?}",
                        self.config.publish_timeout
                    ),
                )),
            };
            match err {
                None => {
                    c.last_used = Instant::now();
                    return Ok(());
                }
                Some(e) => {
                    *conn = None;
                    return Err(e);
                }
            }
        }
    }
}

impl Conn {
    async fn publish_confirmed(
        &mut self,
        topic: &str,
        payload: Bytes,
        properties: PublishProperties,
    ) -> Result<PubAckOutcome, Error> {
        self.client.publish(topic, payload, properties).await?;
        let mut mine = None;
        loop {
            match self.event_loop.poll().await? {
                Polled::Sent(pkid) => mine = Some(pkid),
                Polled::PubAck { pkid, outcome } if Some(pkid) == mine => return Ok(outcome),
                _ => {}
            }
        }
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

/// Publishes messages the way [`MqttSource`](crate::MqttSource) expects them: QoS 1, the ID in
/// the `message-id` user property (v5) or the `message_id` field of the JSON payload (3.1.1).
/// Each publish returns once the broker acknowledged it; publishes are sent one at a time.
#[derive(Debug)]
pub struct MqttProducer {
    publisher: Publisher,
}

impl MqttProducer {
    /// A producer for the broker at `url` (`mqtt://[user[:password]@]host[:port]`) with its own
    /// clean-session connection as `client_id`, opened on the first publish.
    pub async fn connect(
        url: &str,
        client_id: impl Into<String>,
        protocol: Protocol,
    ) -> Result<Self, Error> {
        let client_id = client_id.into();
        let config = MqttConfig::new(url, client_id.clone(), "#")
            .protocol(protocol)
            .require_dead_letter_subscriber(false);
        if let Some(e) = &config.url_error {
            return Err(invalid(e.clone()));
        }
        if client_id.is_empty() {
            return Err(invalid("an MQTT producer needs a client ID"));
        }
        Ok(Self {
            publisher: Publisher::new(config, client_id),
        })
    }

    /// Whether a v5 PUBACK reporting "no matching subscribers" is an error (default `false`:
    /// the broker accepted the message and, with nobody subscribed, dropped it).
    pub fn require_subscriber(mut self, require: bool) -> Self {
        self.publisher.require_subscriber = require;
        self
    }

    /// Publishes `payload` to `topic` at QoS 1 with message ID `id` (none when `None`) and waits
    /// for the PUBACK.
    ///
    /// On 3.1.1 with an ID, the payload must be a JSON object: `message_id` is set in it and the
    /// object re-serialized, so the bytes on the wire may differ from `payload`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidMessageId`] when a v5 `id` cannot travel as an MQTT string: longer
    /// than 65 535 bytes, or holding NUL (U+0000), which the MQTT spec makes a malformed
    /// packet; [`ErrorKind::InvalidConfig`] for a topic that cannot be published to, or a
    /// 3.1.1 payload that is not a JSON object; [`ErrorKind::Unavailable`] when the broker
    /// refused the message or did not acknowledge it.
    pub async fn publish(
        &self,
        topic: &str,
        id: Option<&str>,
        payload: &[u8],
    ) -> Result<(), Error> {
        if !rumqttc::valid_topic(topic) || topic.is_empty() {
            return Err(invalid(format!(
                "{topic:?} is not a valid MQTT topic to publish to"
            )));
        }
        if let (Some(id), Protocol::V5) = (id, self.publisher.protocol()) {
            mqtt_string(id)?;
        }
        let mut properties = PublishProperties::default();
        let payload = match (id, self.publisher.protocol()) {
            (None, _) => Bytes::copy_from_slice(payload),
            (Some(id), Protocol::V5) => {
                properties
                    .user_properties
                    .push((MESSAGE_ID_PROPERTY.to_owned(), id.to_owned()));
                Bytes::copy_from_slice(payload)
            }
            (Some(id), Protocol::V311) => {
                let mut value: serde_json::Value = serde_json::from_slice(payload).map_err(|e| {
                    invalid(format!("MQTT 3.1.1 carries the message ID in a JSON payload, but this one is not JSON: {e}"))
                })?;
                let object = value.as_object_mut().ok_or_else(|| {
                    invalid("MQTT 3.1.1 carries the message ID in the payload, which must be a JSON object")
                })?;
                object.insert(
                    "message_id".to_owned(),
                    serde_json::Value::String(id.to_owned()),
                );
                Bytes::from(value.to_string().into_bytes())
            }
        };
        self.publisher.publish(topic, payload, properties).await
    }
}

/// Checks that `id` survives as an MQTT UTF-8 string: rumqttc writes a longer one with a
/// wrapped length prefix (a malformed packet, or another ID), and NUL is malformed by the spec.
fn mqtt_string(id: &str) -> Result<(), Error> {
    let refuse = |why: String| Err(Error::new(ErrorKind::InvalidMessageId, why));
    if id.len() > usize::from(u16::MAX) {
        return refuse(format!(
            "message ID is {} bytes; an MQTT string holds at most 65535",
            id.len()
        ));
    }
    if id.contains('\0') {
        return refuse("message ID contains NUL, which an MQTT string cannot carry".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_are_not_mqtt_strings_are_refused() {
        assert!(mqtt_string("order-42").is_ok());
        assert!(mqtt_string(&"i".repeat(65535)).is_ok());
        for bad in ["i".repeat(65536), "a\0b".to_owned()] {
            let e = mqtt_string(&bad).err().map(|e| e.kind());
            assert_eq!(e, Some(ErrorKind::InvalidMessageId));
        }
    }

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
