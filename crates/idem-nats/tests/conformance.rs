//! The shared broker conformance suite against a real JetStream server
//! (`IDEM_TEST_NATS_URL`), once with one message per transaction and once with batches.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::Streams;
use idem_nats::JetStreamSource;
use idem_testkit::{BrokerFixture, DeadLettered};

/// Short, so the redelivery checks are quick.
const ACK_WAIT: Duration = Duration::from_secs(2);

/// A stream and its dead-letter stream per test; every source shares one durable consumer.
struct NatsFixture<const BATCH: usize> {
    streams: Streams,
}

impl<const BATCH: usize> BrokerFixture for NatsFixture<BATCH> {
    type Source = JetStreamSource;

    const URL_VAR: &'static str = idem_testkit::services::NATS;
    const BATCH_SIZE: usize = BATCH;

    async fn setup(url: String, name: String) -> Self {
        Self {
            streams: Streams::create(url, name).await,
        }
    }

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        let s = &self.streams;
        let payload = payload.to_vec();
        match id {
            Some(id) => s.publish_again_later(id, &payload).await,
            None => {
                s.js.publish(s.subject.clone(), payload.into())
                    .await
                    .expect("publish")
                    .await
                    .expect("publish ack");
            }
        }
    }

    async fn source(&self) -> JetStreamSource {
        JetStreamSource::builder(&self.streams.stream, "conformance")
            .ack_wait(ACK_WAIT)
            .connect(&self.streams.url)
            .await
            .expect("source")
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        let s = &self.streams;
        s.read(&s.dlq_stream, n, timeout)
            .await
            .into_iter()
            .map(|m| DeadLettered {
                payload: m.payload.to_vec(),
                headers: m
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .filter_map(|(name, values)| {
                        let name: &str = name.as_ref();
                        values
                            .last()
                            .map(|v| (name.to_owned(), v.as_str().to_owned()))
                    })
                    .collect::<HashMap<_, _>>(),
            })
            .collect()
    }

    fn redelivery_timeout(&self) -> Duration {
        ACK_WAIT + Duration::from_secs(3)
    }

    async fn teardown(self) {
        self.streams.delete().await;
    }
}

mod per_message {
    use super::NatsFixture;

    idem_testkit::broker_conformance_tests!(NatsFixture<1>);
}

mod batched {
    use super::NatsFixture;

    idem_testkit::broker_conformance_tests!(NatsFixture<8>);
}
