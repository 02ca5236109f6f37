//! What a broker adapter implements: a [`Source`] of [`Delivery`]s.
//!
//! The runner never talks to a broker directly. An adapter turns its client's messages into
//! deliveries that can be read (payload, headers) and settled exactly once: acknowledged,
//! dead-lettered, or abandoned to redelivery. Everything else (IDs, retries, metrics, shutdown)
//! is the runner's, so every broker behaves the same.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;

use idem_core::Error;

use crate::dead_letter::DeadLetter;
use crate::id_source::IdSource;

/// A stream of deliveries from one broker subscription (stream consumer, queue, consumer group,
/// topic filter).
///
/// Errors from [`Source::next`] are broker errors (connection lost, broker down): the runner
/// logs them, backs off and calls `next` again, so an adapter reconnects inside `next` (or lets
/// its client library do it). The database side is unaffected.
pub trait Source: Send + 'static {
    /// One message as handed out by the broker.
    type Delivery: Delivery;

    /// The broker family, for metrics and logs: `"nats"`, `"amqp"`, `"kafka"`, `"redis"`, `"mqtt"`.
    fn broker(&self) -> &'static str;

    /// Where this broker's producers put the message ID unless configured otherwise.
    fn default_id_source(&self) -> IdSource;

    /// Waits for at least one delivery and returns up to `max` (at least one, unless the source
    /// has ended for good, in which case an empty vector).
    ///
    /// Must be cancel-safe: the runner drops this future on shutdown. A delivery the adapter
    /// received but did not return must stay unacknowledged, so the broker redelivers it.
    fn next(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Self::Delivery>, Error>> + Send;

    /// Called once after the runner has settled every in-flight delivery: flush pending
    /// acknowledgements (Kafka offsets) and disconnect cleanly.
    fn close(self) -> impl Future<Output = Result<(), Error>> + Send
    where
        Self: Sized,
    {
        async { Ok(()) }
    }
}

/// One delivery of a message, settled exactly once by the runner.
///
/// The settling methods consume the delivery so that nothing is acknowledged twice. A delivery
/// that is dropped unsettled is simply never acknowledged: the broker redelivers it (after its
/// ack timeout, a reconnect, or a rebalance), which is always safe because the claim makes the
/// redelivery a duplicate.
pub trait Delivery: Send + Sync + 'static {
    /// The message body as published.
    fn payload(&self) -> &[u8];

    /// A producer-set header by name: NATS/Kafka headers, AMQP header table entries, Redis
    /// stream fields, MQTT v5 user properties. `None` when absent.
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>>;

    /// The broker's own message-ID slot, read by [`IdSource::BrokerId`]: the AMQP `message_id`
    /// property; Kafka's `topic/partition/offset` (an explicit opt-in, see the adapter).
    /// `None` where the broker has no such slot.
    fn broker_id(&self) -> Option<Cow<'_, [u8]>> {
        None
    }

    /// How many times the broker says it delivered this message before (0 on the first
    /// delivery, when the broker counts). The runner starts its attempt count there, so a
    /// message that keeps crashing consumers still reaches the dead-letter destination.
    fn previous_deliveries(&self) -> u32 {
        0
    }

    /// Writes where it came from, for logs: `stream ORDERS seq 42`, `orders/3@1207`. Shown
    /// through [`origin`](Self::origin).
    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;

    /// Where it came from, as a value to display (a span field, a log line). Every message's
    /// span records one, so it is written straight into whatever shows it, without a `String`
    /// of its own.
    fn origin(&self) -> Origin<'_, Self> {
        Origin(self)
    }

    /// Acknowledges: the broker forgets the message. Called only after the message's
    /// transaction committed, or after it was found to be a duplicate.
    fn ack(self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Publishes the message, payload and headers intact, to the dead-letter destination with
    /// `reason` attached (see [`DeadLetter::headers`]), then acknowledges the original. The
    /// original must not be acknowledged unless the dead letter was accepted by the broker.
    fn dead_letter(self, reason: &DeadLetter) -> impl Future<Output = Result<(), Error>> + Send;

    /// Gives the message back without acknowledging it (shutdown, or a retry that will not be
    /// attempted here): negative-ack where the broker has one, otherwise nothing; the broker
    /// redelivers it later.
    fn abandon(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }
}

/// Where a delivery came from, displayed by its [`Delivery::fmt_origin`]; see
/// [`Delivery::origin`].
pub struct Origin<'a, D: ?Sized>(&'a D);

impl<D: Delivery + ?Sized> fmt::Display for Origin<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt_origin(f)
    }
}

impl<D: Delivery + ?Sized> fmt::Debug for Origin<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Origin({self})")
    }
}
