//! Where a delivery's message ID comes from. Always the producer's: idem never makes one up.

use std::borrow::Cow;

use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::source::Delivery;

/// Where to read the producer-set message ID.
///
/// Each adapter has a default matching its broker's convention (`Nats-Msg-Id`, the AMQP
/// `message_id` property, the `message-id` Kafka header, the `message_id` stream field, the
/// `message-id` MQTT v5 user property). There is deliberately no "generate one" option: an
/// ID made up by the consumer differs on every redelivery and protects nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdSource {
    /// A header (NATS, Kafka), AMQP header-table entry, Redis stream field or MQTT v5 user
    /// property with this name.
    Header(String),
    /// A JSON pointer (RFC 6901, e.g. `/meta/id`) into a JSON payload; the value must be a
    /// non-empty string or an integer. For brokers without headers (MQTT 3.1.1).
    JsonPointer(String),
    /// The broker's own ID slot (see [`Delivery::broker_id`]).
    BrokerId,
}

impl IdSource {
    /// A header / property / field with this name.
    pub fn header(name: impl Into<String>) -> Self {
        IdSource::Header(name.into())
    }

    /// A JSON pointer into the payload.
    pub fn json_pointer(pointer: impl Into<String>) -> Self {
        IdSource::JsonPointer(pointer.into())
    }

    /// Reads the raw ID bytes from `delivery`, or says why there are none.
    pub fn extract<'a, D: Delivery>(&self, delivery: &'a D) -> Result<Cow<'a, [u8]>, DeadLetter> {
        let found = match self {
            IdSource::Header(name) => delivery.header(name),
            IdSource::BrokerId => delivery.broker_id(),
            IdSource::JsonPointer(pointer) => {
                let value: serde_json::Value = serde_json::from_slice(delivery.payload())
                    .map_err(|e| {
                        DeadLetter::new(
                            DeadLetterReason::MissingId,
                            format!("the ID is read from JSON pointer {pointer} but the payload is not JSON: {e}"),
                        )
                    })?;
                match value.pointer(pointer) {
                    Some(serde_json::Value::String(s)) => Some(Cow::Owned(s.clone().into_bytes())),
                    Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                        Some(Cow::Owned(n.to_string().into_bytes()))
                    }
                    Some(other) => {
                        return Err(DeadLetter::new(
                            DeadLetterReason::MissingId,
                            format!(
                                "JSON pointer {pointer} holds {other}, not a string or integer ID"
                            ),
                        ));
                    }
                    None => None,
                }
            }
        };
        match found {
            Some(bytes) if !bytes.is_empty() => Ok(bytes),
            Some(_) => Err(DeadLetter::new(
                DeadLetterReason::MissingId,
                format!("{self} is empty; the producer must set a stable ID"),
            )),
            None => Err(DeadLetter::new(
                DeadLetterReason::MissingId,
                format!("no message ID: {self} is missing; the producer must set a stable ID"),
            )),
        }
    }
}

impl std::fmt::Display for IdSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdSource::Header(name) => write!(f, "header {name:?}"),
            IdSource::JsonPointer(p) => write!(f, "JSON pointer {p:?}"),
            IdSource::BrokerId => f.write_str("the broker's message-ID property"),
        }
    }
}
