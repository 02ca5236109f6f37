//! Publishing with confirmation: the producer, and the connection every dead letter is
//! published on before its original is acknowledged.
//!
//! rumqttc reports a PUBACK as an event of the event loop, not as the result of `publish`. To
//! tie the PUBACK to the publish without guessing, a publisher has its own connection (clean
//! session) and sends one message at a time, polling that connection itself until the packet ID
//! it was given comes back acknowledged. Nothing else publishes there, so no event is ambiguous;
//! after any failure the connection is discarded, so no stale request survives into the next
//! publish.

use std::time::Instant;

use bytes::Bytes;
use idem_core::{Error, ErrorKind};
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use tokio::sync::Mutex;

use crate::MESSAGE_ID_PROPERTY;
use crate::config::{Config, Options, Protocol};
use crate::error::{invalid, unavailable};
use crate::wire::{self, Client, Loop, Polled, PubAckOutcome};

/// A confirmed-publish connection, opened on first use and reopened after failures.
#[derive(Debug)]
pub(crate) struct Publisher {
    config: Config,
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
    pub(crate) fn new(config: Config, client_id: String) -> Self {
        Self {
            require_subscriber: config.options.require_subscriber,
            config,
            client_id,
            conn: Mutex::new(None),
        }
    }

    pub(crate) fn protocol(&self) -> Protocol {
        self.config.options.protocol
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
                .is_some_and(|c| c.last_used.elapsed() >= self.config.options.keep_alive)
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
                self.config.options.publish_timeout,
                c.publish_confirmed(topic, payload.clone(), properties.clone()),
            )
            .await;
            let err = match sent {
                Ok(Ok(PubAckOutcome::Accepted)) => None,
                Ok(Ok(PubAckOutcome::NoSubscribers)) if !self.require_subscriber => None,
                Ok(Ok(PubAckOutcome::NoSubscribers)) => Some(unavailable(
                    format_args!("publishing to {topic:?}"),
                    "no client subscribes to this topic, so the broker dropped the message; give it a persistent subscriber",
                )),
                Ok(Ok(PubAckOutcome::Refused(reason))) => Some(unavailable(
                    format_args!("publishing to {topic:?}"),
                    format!("refused: {reason}"),
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
                        "no MQTT PUBACK for the publish to {topic:?} within {:?}",
                        self.config.options.publish_timeout
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

/// Publishes messages the way [`MqttSource`](crate::MqttSource) expects them: QoS 1, the ID in
/// the `message-id` user property (v5) or the `message_id` field of the JSON payload (3.1.1).
/// Each publish returns once the broker acknowledged it; publishes are sent one at a time.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use idem_mqtt::{MqttProducer, Protocol};
///
/// let producer = MqttProducer::connect("mqtt://127.0.0.1:1883", "billing-producer")
///     .await?
///     .protocol(Protocol::V311);
/// producer.publish("payments", Some("pay-42"), br#"{"amount_cents":500}"#).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct MqttProducer {
    publisher: Publisher,
}

impl MqttProducer {
    /// A producer for the broker at `url` (`mqtt://[user[:password]@]host[:port]`) with its own
    /// clean-session connection as `client_id` (unique among the broker's clients), opened on
    /// the first publish. Speaks MQTT v5 unless told otherwise ([`protocol`](Self::protocol)).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a bad URL or an empty client ID.
    pub async fn connect(url: &str, client_id: impl Into<String>) -> Result<Self, Error> {
        let client_id = client_id.into();
        let options = Options {
            require_subscriber: false,
            ..Options::default()
        };
        let config = Config::new(url, options)?;
        if client_id.is_empty() {
            return Err(invalid("an MQTT producer needs a client ID"));
        }
        Ok(Self {
            publisher: Publisher::new(config, client_id),
        })
    }

    /// The protocol version (default [`Protocol::V5`]); a connection already open is replaced
    /// on the next publish.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.publisher.config.options.protocol = protocol;
        *self.publisher.conn.get_mut() = None;
        self
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
        self.publish_with_properties(topic, id, &[], payload).await
    }

    /// [`publish`](Self::publish) with extra MQTT 5 user properties, after the `message-id`
    /// one (where [`MqttSource`](crate::MqttSource) reads headers).
    ///
    /// # Errors
    /// As [`publish`](Self::publish); [`ErrorKind::InvalidConfig`] for user properties on MQTT
    /// 3.1.1 (which has none), a property named `message-id` next to an ID (it would shadow
    /// it), or a name or value holding NUL.
    pub async fn publish_with_properties(
        &self,
        topic: &str,
        id: Option<&str>,
        user_properties: &[(&str, &str)],
        payload: &[u8],
    ) -> Result<(), Error> {
        check_user_properties(self.publisher.protocol(), id.is_some(), user_properties)?;
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
                let mut value: serde_json::Value =
                    serde_json::from_slice(payload).map_err(|e| {
                        invalid(format!(
                            "an MQTT 3.1.1 payload carries the message ID, so it must be JSON: {e}"
                        ))
                    })?;
                let object = value.as_object_mut().ok_or_else(|| {
                    invalid(
                        "an MQTT 3.1.1 payload carries the message ID, so it must be a JSON object",
                    )
                })?;
                object.insert(
                    "message_id".to_owned(),
                    serde_json::Value::String(id.to_owned()),
                );
                Bytes::from(value.to_string().into_bytes())
            }
        };
        properties.user_properties.extend(
            user_properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        self.publisher.publish(topic, payload, properties).await
    }
}

/// User properties travel only on v5, as MQTT strings, and none may pose as the ID.
fn check_user_properties(
    protocol: Protocol,
    with_id: bool,
    user_properties: &[(&str, &str)],
) -> Result<(), Error> {
    if user_properties.is_empty() {
        return Ok(());
    }
    if protocol == Protocol::V311 {
        return Err(invalid(
            "MQTT 3.1.1 has no user properties, so this message's headers cannot travel; publish with MQTT 5",
        ));
    }
    for (name, value) in user_properties {
        if with_id && *name == MESSAGE_ID_PROPERTY {
            return Err(invalid(format!(
                "a user property named {MESSAGE_ID_PROPERTY:?} would shadow the message ID"
            )));
        }
        if name.contains('\0') || value.contains('\0') {
            return Err(invalid(format!(
                "user property {name:?} holds NUL, which an MQTT string cannot carry"
            )));
        }
        if name.len() > usize::from(u16::MAX) || value.len() > usize::from(u16::MAX) {
            return Err(invalid(format!(
                "user property {name:?} is longer than an MQTT string's 65535 bytes"
            )));
        }
    }
    Ok(())
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
    fn user_properties_that_cannot_travel_are_refused() {
        assert!(check_user_properties(Protocol::V5, true, &[("kind", "Created")]).is_ok());
        assert!(check_user_properties(Protocol::V311, true, &[]).is_ok());
        for (protocol, props) in [
            (Protocol::V311, &[("kind", "Created")][..]),
            (Protocol::V5, &[(MESSAGE_ID_PROPERTY, "other")][..]),
            (Protocol::V5, &[("kind", "a\0b")][..]),
        ] {
            let e = check_user_properties(protocol, true, props)
                .err()
                .map(|e| e.kind());
            assert_eq!(e, Some(ErrorKind::InvalidConfig), "{protocol:?} {props:?}");
        }
    }

    #[test]
    fn ids_that_are_not_mqtt_strings_are_refused() {
        assert!(mqtt_string("order-42").is_ok());
        assert!(mqtt_string(&"i".repeat(65535)).is_ok());
        for bad in ["i".repeat(65536), "a\0b".to_owned()] {
            let e = mqtt_string(&bad).err().map(|e| e.kind());
            assert_eq!(e, Some(ErrorKind::InvalidMessageId));
        }
    }
}
