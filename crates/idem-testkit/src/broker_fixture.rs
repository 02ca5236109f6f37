//! What a broker adapter provides to run the shared broker conformance suite against its real
//! broker: an isolated destination, a producer, fresh consumers, and its dead letters.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use idem_consumer::Source;
use idem_core::Error;

/// A dead letter as read back from the broker's dead-letter destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLettered {
    /// The payload, which must be the original bytes.
    pub payload: Vec<u8>,
    /// Every header / property / field of the dead letter, as UTF-8 (lossy), including
    /// `idem-dead-letter-reason`, `idem-dead-letter-detail` and the original ID header if any.
    pub headers: HashMap<String, String>,
}

/// One isolated broker destination (stream, queue, topic, key, topic filter) with its own
/// dead-letter destination, created for one test and removed after it.
pub trait BrokerFixture: Sized + Send + Sync + 'static {
    /// The adapter's source type.
    type Source: Source;

    /// The `IDEM_TEST_*` variable holding this broker's URL (see [`crate::services`]); empty
    /// for brokers that need no server (in-process fakes, librdkafka's mock cluster), whose
    /// `setup` then receives an empty URL.
    const URL_VAR: &'static str;

    /// The longest message ID, in bytes, that the adapter's producer helper and the broker
    /// carry (AMQP's `message_id` short string: 255; an MQTT string: 65 535); IDs are also
    /// bounded by [`MAX_MESSAGE_BYTES`](Self::MAX_MESSAGE_BYTES).
    const MAX_ID_BYTES: usize;

    /// The largest message, ID, headers and payload together, that the broker accepts as the
    /// fixture sets it up (NATS `max_payload`, librdkafka's `message.max.bytes`, RabbitMQ's
    /// `max_message_size`, Redis's `proto-max-bulk-len`, the MQTT client's packet limit).
    const MAX_MESSAGE_BYTES: usize;

    /// The broker's own forms of a present but empty ID, besides what
    /// [`try_publish`](Self::try_publish) with `Some(b"")` writes, when the adapter reads them
    /// (an empty `Nats-Msg-Id` header, a null-valued Kafka header): each is published by
    /// [`publish_empty_id_form`](Self::publish_empty_id_form) and must be dead-lettered as
    /// `missing-id`.
    const EMPTY_ID_FORMS: &'static [&'static str] = &[];

    /// Creates the destination named `name` (unique per test) on the broker at `url`.
    fn setup(url: String, name: String) -> impl Future<Output = Self> + Send;

    /// Publishes `payload` with the adapter's producer helper, stamping `id` where the
    /// adapter's default ID source reads it; `None` publishes without any ID. Returns once the
    /// broker has accepted the message, or the error the helper or the broker refused it with
    /// (an ID the helper's signature cannot even take, such as non-UTF-8 bytes for a `&str`
    /// parameter, is refused by the fixture with [`ErrorKind::InvalidMessageId`
    /// ](idem_core::ErrorKind::InvalidMessageId)).
    fn try_publish(
        &self,
        id: Option<&[u8]>,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// [`try_publish`](Self::try_publish) for a message the broker must accept.
    fn publish(&self, id: Option<&str>, payload: &[u8]) -> impl Future<Output = ()> + Send {
        async move {
            if let Err(e) = self.try_publish(id.map(str::as_bytes), payload).await {
                panic!("publishing {id:?}: {e}");
            }
        }
    }

    /// Publishes `payload` with the empty-ID form `form` (one of
    /// [`EMPTY_ID_FORMS`](Self::EMPTY_ID_FORMS)), bypassing the producer helper as a foreign
    /// producer would.
    fn publish_empty_id_form(
        &self,
        form: &'static str,
        payload: &[u8],
    ) -> impl Future<Output = ()> + Send {
        let _ = payload;
        async move { panic!("this fixture has no empty-ID form {form:?}") }
    }

    /// A new consumer on its own connection, sharing the destination (and consumer group /
    /// durable consumer / shared subscription) with every other source of this fixture, so two
    /// sources split the messages and a second one takes over what a vanished first one left.
    fn source(&self) -> impl Future<Output = Self::Source> + Send;

    /// Waits up to `timeout` for `n` dead letters and returns those that arrived (maybe fewer).
    fn dead_letters(
        &self,
        n: usize,
        timeout: Duration,
    ) -> impl Future<Output = Vec<DeadLettered>> + Send;

    /// How long the broker may take to redeliver an unacknowledged message after its consumer
    /// vanished without closing (ack wait, session timeout, reclaim idle time), plus margin.
    fn redelivery_timeout(&self) -> Duration;

    /// Removes what `setup` created.
    fn teardown(self) -> impl Future<Output = ()> + Send;
}
