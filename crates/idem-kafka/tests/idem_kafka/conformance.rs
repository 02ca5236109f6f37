//! The shared broker conformance suite, twice: against librdkafka's in-process mock cluster
//! (always runs) and against the real brokers in `IDEM_TEST_KAFKA_BROKERS` (skipped when unset).

use crate::common;

use std::time::Duration;

use common::{Cluster, MockBroker, fast_group, read_topic};
use idem_core::Error;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::FutureRecord;
use idem_kafka::{KafkaProducer, KafkaSource};
use idem_testkit::{BrokerFixture, DeadLettered};

/// Partitions per test topic: more than one, so two consumers of the group share the work.
const PARTITIONS: i32 = 3;

/// librdkafka's default `message.max.bytes`.
const MESSAGE_MAX_BYTES: usize = 1_000_000;

const NULL_HEADER: &str = "message-id header with a null value";
const KEY_NO_HEADER: &str = "record key but no message-id header";

/// One test topic, its dead-letter topic, and a consumer group shared by every source of the
/// fixture. `REAL` picks the real brokers over the mock cluster.
struct KafkaFixture<const REAL: bool> {
    cluster: Cluster,
    topic: String,
    dead_letter_topic: String,
    group: String,
    producer: KafkaProducer,
}

impl<const REAL: bool> std::fmt::Debug for KafkaFixture<REAL> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaFixture")
            .field("cluster", &self.cluster)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl<const REAL: bool> KafkaFixture<REAL> {
    /// Sends a record the broker must accept, bypassing `KafkaProducer::publish`.
    async fn send(&self, record: FutureRecord<'_, [u8], [u8]>) {
        self.producer
            .client()
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("publish without the helper");
    }
}

impl<const REAL: bool> BrokerFixture for KafkaFixture<REAL> {
    type Source = KafkaSource;

    const URL_VAR: &'static str = if REAL {
        idem_testkit::services::KAFKA
    } else {
        ""
    };
    /// librdkafka's `message.max.bytes` (its default), checked by the producer before
    /// anything is sent; the ID header counts.
    const MAX_ID_BYTES: usize = MESSAGE_MAX_BYTES;
    const MAX_MESSAGE_BYTES: usize = MESSAGE_MAX_BYTES;
    const EMPTY_ID_FORMS: &'static [&'static str] = &[NULL_HEADER, KEY_NO_HEADER];

    async fn setup(url: String, name: String) -> Self {
        let cluster = if REAL {
            Cluster::Real(url)
        } else {
            Cluster::Mock(MockBroker::start())
        };
        let topic = name.clone();
        let dead_letter_topic = format!("{name}.dead-letter");
        cluster
            .create_topics(&[&topic, &dead_letter_topic], PARTITIONS)
            .await;
        let producer = KafkaProducer::connect(cluster.brokers())
            .await
            .expect("producer");
        KafkaFixture {
            cluster,
            topic,
            dead_letter_topic,
            group: format!("{name}-group"),
            producer,
        }
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        match id {
            // No key: copies of one ID may land on different partitions and reach different
            // members of the group, the harder case.
            Some(id) => self
                .producer
                .publish(&self.topic, None, id, payload)
                .await
                .map(drop),
            None => {
                self.send(FutureRecord::to(&self.topic).payload(payload))
                    .await;
                Ok(())
            }
        }
    }

    /// The adapter reads the `message-id` header only: a null-valued one is as empty as an
    /// empty one, and a record key is not an ID.
    async fn publish_empty_id_form(&self, form: &'static str, payload: &[u8]) {
        let record = FutureRecord::to(&self.topic).payload(payload);
        let record = match form {
            NULL_HEADER => record.headers(OwnedHeaders::new().insert(Header::<&[u8]> {
                key: idem_kafka::MESSAGE_ID_HEADER,
                value: None,
            })),
            KEY_NO_HEADER => record.key(b"corpus-key".as_slice()),
            other => panic!("no empty-ID form {other:?}"),
        };
        self.send(record).await;
    }

    async fn source(&self) -> KafkaSource {
        fast_group(KafkaSource::builder(&self.topic, &self.group))
            .connect(self.cluster.brokers())
            .await
            .expect("source")
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        read_topic(
            self.cluster.brokers(),
            &self.dead_letter_topic,
            PARTITIONS,
            n,
            timeout,
        )
        .await
        .into_iter()
        .map(|r| DeadLettered {
            payload: r.payload.clone().unwrap_or_default(),
            headers: r
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        String::from_utf8_lossy(v.as_deref().unwrap_or(&[])).into_owned(),
                    )
                })
                .collect(),
        })
        .collect()
    }

    fn redelivery_timeout(&self) -> Duration {
        // A member that vanished without leaving is evicted after session.timeout.ms (6 s);
        // then the group rebalances.
        Duration::from_secs(15)
    }

    async fn teardown(self) {
        // Topics stay: see `common::Cluster` for why deleting them is unsafe on tansu.
    }
}

mod mock_cluster {
    use super::KafkaFixture;

    idem_testkit::broker_conformance_tests!(KafkaFixture<false>);
}

mod real_brokers {
    use super::KafkaFixture;

    idem_testkit::broker_conformance_tests!(KafkaFixture<true>);
}
