//! MQTT adapter for idem: consume a topic filter at QoS 1 with manual acknowledgements and a
//! persistent session, so a message is acknowledged only after its transaction committed and
//! an unacknowledged one comes back after a reconnect or a restart.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_mqtt::{MqttProducer, MqttSource};
//!
//! let url = "mqtt://127.0.0.1:1883";
//! // A persistent subscriber keeps the dead letters (the broker drops what nobody reads).
//! idem_mqtt::ensure_session(url, "billing-dead-letters", "payments/dead-letter").await?;
//!
//! // Producer side: the ID travels in the `message-id` user property (MQTT v5).
//! let producer = MqttProducer::connect(url, "billing-producer").await?;
//! producer.publish("payments", Some("pay-42"), br#"{"amount_cents":500}"#).await?;
//!
//! // Consumer side: a stable client ID per instance, a shared subscription per service.
//! let source = MqttSource::builder("$share/billing/payments", "billing-1")
//!     .dead_letter_topic("payments/dead-letter")
//!     .connect(url)
//!     .await?;
//! // hand `source` to idem_consumer::Consumer::new(processor, source)
//! # drop(source);
//! # Ok(()) }
//! ```
//!
//! # How MQTT maps onto the pattern
//!
//! - **Message ID.** MQTT v5: the user property `message-id` ([`MESSAGE_ID_PROPERTY`]).
//!   MQTT 3.1.1 has no headers, so the default is the JSON pointer `/message_id`
//!   ([`MESSAGE_ID_POINTER`]) into a JSON payload; [`MqttProducer`] writes it there.
//! - **Acknowledgement.** The subscription is QoS 1 with rumqttc's manual acks: the PUBACK is
//!   sent by [`Delivery::ack`](idem_consumer::Delivery::ack), after commit. PUBACKs are per packet
//!   ID, so acknowledging out of order (concurrency above 1) is fine.
//! - **Redelivery.** MQTT redelivers an unacknowledged message only when the session
//!   reconnects, never on a timer. The session is persistent (`clean_start = false` with a session
//!   expiry interval for v5, `clean_session = false` for 3.1.1), so it survives a restart **as long
//!   as the restarted consumer uses the same client ID**. Give every consumer instance a stable ID
//!   (`billing-1`, `billing-2`, …): a session whose owner never comes back keeps its messages
//!   until it expires. `abandon` leaves the message unacknowledged and asks the connection to
//!   reconnect shortly after, because nothing else would make the broker send it again.
//! - **Bad input.** User properties are MQTT UTF-8 strings: at most 65 535 bytes (rumqttc
//!   writes a longer one with a wrapped length prefix, and Mosquitto drops the connection),
//!   and the spec makes NUL a malformed packet. [`MqttProducer::publish`] refuses such an ID
//!   as [`ErrorKind::InvalidMessageId`](idem_core::ErrorKind) instead of sending a packet the
//!   broker would refuse or misread. A missing or empty `message-id` is
//!   dead-lettered as `missing-id`; a 65 535-byte ID over the processor's limit as
//!   `invalid-id`, its dead letter carrying the ID's first 1 KiB
//!   ([`DeadLetter::forward`](idem_consumer::DeadLetter::forward)). Payloads are carried whole
//!   up to [`MqttSourceBuilder::max_packet_size`] (16 MiB by default).
//! - **Several consumers.** Use a shared subscription, `$share/<group>/<filter>`, with a different
//!   client ID per consumer. Mosquitto (2.0) keeps handing shared messages to members whose
//!   session is offline, queued in that session: another reason for stable client IDs.
//! - **The broker's queue cap.** Mosquitto queues at most `max_queued_messages` (1 000 by
//!   default) for a disconnected session and drops the rest, QoS 1 included: a consumer down
//!   for long enough loses messages before idem sees them. Raise it (`0`: no cap) on a broker
//!   whose consumers may be down under load.
//! - **Dead letters.** Published at QoS 1 to the dead-letter topic, and the original is acked only
//!   once the broker's PUBACK for that publish arrived. v5: original payload, original user
//!   properties plus [`DeadLetter::headers`](idem_consumer::DeadLetter::headers) and
//!   [`ORIGINAL_TOPIC_PROPERTY`]. 3.1.1 has no properties, so the dead letter is a JSON envelope
//!   `{"topic": …, "headers": {…}, "payload_base64": …}` (see [`DeadLetterEnvelope`]).
//!   MQTT brokers keep nothing for a topic without subscribers: give the dead-letter topic a
//!   persistent subscriber ([`ensure_session`]). On v5 a PUBACK saying "no matching subscribers" fails the dead letter
//!   (the original stays unacknowledged) unless
//!   [`MqttSourceBuilder::require_dead_letter_subscriber`] is turned off; 3.1.1 cannot tell.

mod builder;
mod config;
mod delivery;
mod error;
mod producer;
mod source;
mod topology;
mod wire;

pub use builder::MqttSourceBuilder;
pub use config::Protocol;
pub use delivery::{DeadLetterEnvelope, MqttDelivery};
pub use producer::MqttProducer;
/// The MQTT client this adapter is built on, for naming its types.
pub use rumqttc;
pub use source::MqttSource;
pub use topology::{end_session, ensure_session};

/// The MQTT v5 user property that carries the message ID by default.
pub const MESSAGE_ID_PROPERTY: &str = "message-id";

/// The JSON pointer into the payload that carries the message ID by default on MQTT 3.1.1.
pub const MESSAGE_ID_POINTER: &str = "/message_id";

/// The user property (v5) / envelope header (3.1.1) naming the topic a dead letter came from:
/// the topic often carries meaning (a device, a tenant) that replay needs.
pub const ORIGINAL_TOPIC_PROPERTY: &str = "idem-original-topic";
