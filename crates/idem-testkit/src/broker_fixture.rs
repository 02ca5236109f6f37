//! What a broker adapter provides to run the shared broker conformance suite against its real
//! broker: an isolated destination, a producer, fresh consumers, and its dead letters.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use idem_consumer::Source;

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

    /// Deliveries per transaction the suite's consumers use ([`Consumer::batch_size`
    /// ](idem_consumer::Consumer::batch_size)); brokers that hand out batches (Kafka, JetStream,
    /// Redis Streams) run the suite a second time with a fixture that sets this above 1.
    const BATCH_SIZE: usize = 1;

    /// Creates the destination named `name` (unique per test) on the broker at `url`.
    fn setup(url: String, name: String) -> impl Future<Output = Self> + Send;

    /// Publishes `payload` with the adapter's producer helper, stamping `id` where the
    /// adapter's default ID source reads it; `None` publishes without any ID. Returns once the
    /// broker has accepted the message.
    fn publish(&self, id: Option<&str>, payload: &[u8]) -> impl Future<Output = ()> + Send;

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
