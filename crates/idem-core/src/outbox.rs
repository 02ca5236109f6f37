//! The transactional outbox's vocabulary: messages a handler publishes, written in the
//! transaction that records its claim, and what a relay needs from the store to publish them.
//!
//! Publishing after the commit loses the event when the process dies between the two (and the
//! redelivery is a duplicate that publishes nothing); publishing inside the transaction sends
//! an event for an effect a rollback undoes. So the handler *enqueues* [`Outgoing`] messages
//! through [`OutboxStore::enqueue`] on the transaction it already has: they commit with the
//! claim and the effect, or not at all. A relay (`idem-relay`) then publishes each committed row
//! at least once and marks it sent after the broker confirmed.
//!
//! Every outgoing ID is **derived**, never random: an [`Emitter`] hands out the IDs of one
//! execution's messages in order, from (consumer, incoming message ID, position) or from a
//! request's scoped key. A handler re-run after a rollback or a take-over produces the same IDs,
//! so a relay's resend (after a crash between the publish and the mark) is a duplicate the next
//! idem consumer recognises by its claim.

use std::future::Future;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::derived::DerivedKey;
use crate::error::{Error, ErrorKind};
use crate::id::{ConsumerName, MessageId};
use crate::request::RequestKey;
use crate::store::TransactionalStore;

/// The longest destination (subject, queue, topic, stream) name, in bytes.
pub const MAX_DESTINATION_LEN: usize = 255;
/// The longest ordering key, in bytes.
pub const MAX_ORDERING_KEY_LEN: usize = 255;
/// The longest header name, in bytes.
pub const MAX_HEADER_NAME_LEN: usize = 255;

/// One message a handler publishes through the outbox.
#[derive(Clone, PartialEq, Eq)]
pub struct Outgoing {
    id: MessageId,
    destination: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    ordering_key: Option<String>,
}

impl Outgoing {
    /// A message with ID `id` (from an [`Emitter`]) for `destination`: a NATS subject, a
    /// RabbitMQ queue, a Kafka topic, a Redis stream or an MQTT topic, as the relay's broker
    /// names it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for an empty destination, one longer than
    /// [`MAX_DESTINATION_LEN`] bytes or holding a control character.
    pub fn new(
        id: MessageId,
        destination: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Self, Error> {
        let destination = destination.into();
        check_name("destination", &destination, MAX_DESTINATION_LEN)?;
        Ok(Self {
            id,
            destination,
            payload: payload.into(),
            headers: Vec::new(),
            ordering_key: None,
        })
    }

    /// Adds a header (a NATS or Kafka header, an AMQP header, a Redis Streams field, an MQTT 5
    /// user property). The relay sets the ID header itself.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for an empty name, one longer than
    /// [`MAX_HEADER_NAME_LEN`] bytes or holding a control character.
    pub fn header(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, Error> {
        let name = name.into();
        check_name("header name", &name, MAX_HEADER_NAME_LEN)?;
        self.headers.push((name, value.into()));
        Ok(self)
    }

    /// Publishes this message after every earlier message with the same destination and key
    /// (first publishes in commit order; see `idem-relay` for what can reorder). Messages
    /// without a key are published in no promised order.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for an empty key, one longer than
    /// [`MAX_ORDERING_KEY_LEN`] bytes or holding a control character.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        check_name("ordering key", &key, MAX_ORDERING_KEY_LEN)?;
        self.ordering_key = Some(key);
        Ok(self)
    }

    /// The derived message ID the relay publishes it with.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// Where it goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The body.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers, in the order added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The ordering key, if any.
    pub fn key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Rebuilds a message read back from a store's outbox table; the store checked nothing, so
    /// this checks everything [`new`](Self::new) and the setters check.
    ///
    /// # Errors
    /// As [`new`](Self::new), [`header`](Self::header) and
    /// [`ordering_key`](Self::ordering_key).
    pub fn from_parts(
        id: MessageId,
        destination: String,
        payload: Vec<u8>,
        headers: Vec<(String, String)>,
        ordering_key: Option<String>,
    ) -> Result<Self, Error> {
        let mut out = Self::new(id, destination, payload)?;
        for (name, value) in headers {
            out = out.header(name, value)?;
        }
        if let Some(key) = ordering_key {
            out = out.ordering_key(key)?;
        }
        Ok(out)
    }
}

impl std::fmt::Debug for Outgoing {
    // The payload can be large and personal: its length only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("id", &self.id)
            .field("destination", &self.destination)
            .field("payload_len", &self.payload.len())
            .field("headers", &self.headers.len())
            .field("ordering_key", &self.ordering_key)
            .finish()
    }
}

fn check_name(what: &str, value: &str, max: usize) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("an outgoing message's {what} is empty"),
        ));
    }
    if value.len() > max {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "an outgoing message's {what} is {} bytes; at most {max}",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("an outgoing message's {what} {value:?} holds a control character"),
        ));
    }
    Ok(())
}

/// Where an [`Emitter`]'s IDs come from.
#[derive(Debug, Clone)]
enum Origin {
    Message {
        consumer: ConsumerName,
        id: MessageId,
    },
    Request(RequestKey),
}

/// Hands out the derived IDs of one execution's outgoing messages: the first message gets
/// position 0, the next 1, and so on. Make a new emitter each time the handler runs — a re-run
/// must start again at 0 to derive the same IDs — and publish in a deterministic order.
///
/// ```
/// use idem_core::{ConsumerName, MessageId, outbox::Emitter};
///
/// let billing = ConsumerName::new("billing")?;
/// let incoming = MessageId::new("payment-42")?;
/// let mut first_run = Emitter::for_message(&billing, &incoming);
/// let charged = first_run.message("payments.charged", br#"{"payment_id":"payment-42"}"#.to_vec())?;
///
/// // The handler runs again (a rollback, a redelivery after a crash): the same ID.
/// let mut second_run = Emitter::for_message(&billing, &incoming);
/// assert_eq!(second_run.next_id(), *charged.id());
/// // The next message of the run gets the next position's ID.
/// assert_ne!(second_run.next_id(), *charged.id());
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Emitter {
    origin: Origin,
    next: u32,
}

impl Emitter {
    /// The emitter of `consumer`'s handling of the incoming message `id`.
    pub fn for_message(consumer: &ConsumerName, id: &MessageId) -> Self {
        Self {
            origin: Origin::Message {
                consumer: consumer.clone(),
                id: id.clone(),
            },
            next: 0,
        }
    }

    /// The emitter of the idempotent request recorded under `request`: distinct per scope
    /// (principal and route) and client key, the same for every execution of that record.
    pub fn for_request(request: &RequestKey) -> Self {
        Self {
            origin: Origin::Request(request.clone()),
            next: 0,
        }
    }

    /// The ID of the next outgoing message.
    pub fn next_id(&mut self) -> MessageId {
        let step = format!("outbox/{}", self.next);
        self.next += 1;
        match &self.origin {
            Origin::Message { consumer, id } => DerivedKey::new(consumer, id, &step),
            Origin::Request(key) => DerivedKey::for_request(key, &step),
        }
        .to_message_id()
    }

    /// The next outgoing message, for `destination`.
    ///
    /// # Errors
    /// As [`Outgoing::new`].
    pub fn message(
        &mut self,
        destination: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Outgoing, Error> {
        Outgoing::new(self.next_id(), destination, payload)
    }

    /// How many IDs it handed out.
    pub fn emitted(&self) -> u32 {
        self.next
    }
}

/// A store that writes outgoing messages into its outbox table, in the caller's transaction.
pub trait OutboxStore: TransactionalStore {
    /// Inserts `messages` into the outbox in `tx`, in order. A message whose ID is already in
    /// the table (enqueued by an earlier, committed run of the same handler) is left as it is:
    /// a re-run never duplicates a row.
    fn enqueue(
        &self,
        tx: &mut Self::Tx,
        messages: &[Outgoing],
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// One committed outbox row, leased to a relay.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    /// The row's position in commit order (the table's sequence).
    pub seq: i64,
    /// What to publish.
    pub message: Outgoing,
    /// Publishes tried before this lease and failed.
    pub attempts: u32,
    /// When the row was written.
    pub created: Timestamp,
}

/// How far behind a relay is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Rows not yet published.
    pub unsent: u64,
    /// Age of the oldest of them.
    pub oldest_unsent: Option<Duration>,
    /// Rows published and not yet deleted.
    pub sent: u64,
    /// Rows in the outbox's dead-letter table.
    pub dead_lettered: u64,
}

/// What a relay needs from the store that holds the outbox. Several relays may share one
/// table: a row is leased to one of them at a time, and a lease that lapses (its relay died)
/// lets another take the row over.
pub trait RelayStore: Send + Sync {
    /// Leases up to `limit` unsent rows to `relay` for `lease`, oldest first. For each
    /// (destination, ordering key), only rows with no earlier unsent row leased to another
    /// relay are taken, so one key's rows are published by one relay at a time, in order.
    fn lease(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, Error>> + Send;

    /// Marks `seqs` published: only after the broker confirmed them.
    fn mark_sent(
        &self,
        relay: &str,
        seqs: &[i64],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Gives row `seq` back after a failed publish: its attempt count grows, `error` is kept,
    /// and it becomes leasable again after `retry_in`.
    fn release(
        &self,
        relay: &str,
        seq: i64,
        error: &str,
        retry_in: Duration,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Moves row `seq`, refused by the broker for good, to the outbox's dead-letter table with
    /// `reason`.
    fn dead_letter(
        &self,
        relay: &str,
        seq: i64,
        reason: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Deletes up to `limit` published rows; returns how many it deleted.
    fn purge_sent(&self, limit: usize) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Counts what is waiting.
    fn backlog(&self) -> impl Future<Output = Result<Backlog, Error>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{IdempotencyKey, RequestScope};

    fn consumer(name: &str) -> ConsumerName {
        ConsumerName::new(name).unwrap()
    }

    fn id(v: &str) -> MessageId {
        MessageId::new(v).unwrap()
    }

    #[test]
    fn ids_depend_on_consumer_message_and_position_only() {
        let a = consumer("billing");
        let m = id("payment-1");
        let mut e1 = Emitter::for_message(&a, &m);
        let mut e2 = Emitter::for_message(&a, &m);
        let first: Vec<_> = (0..3).map(|_| e1.next_id()).collect();
        let again: Vec<_> = (0..3).map(|_| e2.next_id()).collect();
        assert_eq!(first, again);
        assert_ne!(first[0], first[1]);
        assert_ne!(first[1], first[2]);
        assert_eq!(e1.emitted(), 3);
        assert_ne!(
            Emitter::for_message(&consumer("receipts"), &m).next_id(),
            first[0]
        );
        assert_ne!(
            Emitter::for_message(&a, &id("payment-2")).next_id(),
            first[0]
        );
        // An outgoing ID is a valid incoming ID for the next hop.
        assert!(MessageId::new(first[0].as_bytes()).is_ok());
    }

    #[test]
    fn request_ids_are_distinct_per_scope() {
        let key = IdempotencyKey::new("k-1").unwrap();
        let alice = RequestKey::new(RequestScope::new(["alice", "POST", "/pay"]), key.clone());
        let bob = RequestKey::new(RequestScope::new(["bob", "POST", "/pay"]), key);
        let a = Emitter::for_request(&alice).next_id();
        assert_eq!(Emitter::for_request(&alice).next_id(), a);
        assert_ne!(Emitter::for_request(&bob).next_id(), a);
    }

    #[test]
    fn bad_names_are_refused_with_the_reason() {
        let mut e = Emitter::for_message(&consumer("c"), &id("m"));
        for (dest, why) in [
            ("", "empty"),
            ("a\nb", "control character"),
            (&"d".repeat(MAX_DESTINATION_LEN + 1) as &str, "at most 255"),
        ] {
            let err = e.message(dest, b"x".to_vec()).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidConfig);
            assert!(err.to_string().contains(why), "{err}");
        }
        let ok = e.message("orders", b"x".to_vec()).unwrap();
        assert!(ok.clone().header("", "v").is_err());
        assert!(ok.clone().ordering_key("").is_err());
        let full = ok
            .header("kind", "PaymentCharged")
            .unwrap()
            .ordering_key("account-7")
            .unwrap();
        assert_eq!(full.headers(), &[("kind".into(), "PaymentCharged".into())]);
        assert_eq!(full.key(), Some("account-7"));
        let back = Outgoing::from_parts(
            full.id().clone(),
            full.destination().into(),
            full.payload().to_vec(),
            full.headers().to_vec(),
            full.key().map(str::to_owned),
        )
        .unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn debug_shows_the_payload_length_not_the_payload() {
        let mut e = Emitter::for_message(&consumer("c"), &id("m"));
        let m = e.message("orders", b"card 4242".to_vec()).unwrap();
        let shown = format!("{m:?}");
        assert!(!shown.contains("4242"), "{shown}");
        assert!(shown.contains("payload_len: 9"), "{shown}");
    }
}
