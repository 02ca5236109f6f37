//! The shared broker conformance suite against a real JetStream server
//! (`IDEM_TEST_NATS_URL`), in every consumer mode.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::Streams;
use idem_core::Error;
use idem_nats::JetStreamSource;
use idem_testkit::{BrokerFixture, DeadLettered};

/// The server's `max_payload` (its default, 1 MiB): headers plus payload.
const MAX_PAYLOAD: usize = 1024 * 1024;

const EMPTY_NATS_MSG_ID: &str = "empty Nats-Msg-Id header";

/// Short, so the redelivery checks are quick.
const ACK_WAIT: Duration = Duration::from_secs(2);

/// A stream and its dead-letter stream per test; every source shares one durable consumer.
struct NatsFixture {
    streams: Streams,
}

impl BrokerFixture for NatsFixture {
    type Source = JetStreamSource;

    const URL_VAR: &'static str = idem_testkit::services::NATS;
    /// The ID is a header, and JetStream refuses a header block over 65 535 bytes: that is
    /// `NATS/1.0\r\nNats-Msg-Id: <id>\r\n\r\n` with an ID of 65 508 bytes.
    const MAX_ID_BYTES: usize = u16::MAX as usize - 27;
    const MAX_MESSAGE_BYTES: usize = MAX_PAYLOAD;
    const EMPTY_ID_FORMS: &'static [&'static str] = &[EMPTY_NATS_MSG_ID];

    async fn setup(url: String, name: String) -> Self {
        let client = async_nats::connect(&url).await.expect("connect to NATS");
        assert_eq!(
            client.server_info().max_payload,
            MAX_PAYLOAD,
            "MAX_MESSAGE_BYTES states the server's max_payload"
        );
        drop(client);
        Self {
            streams: Streams::create(url, name).await,
        }
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        let s = &self.streams;
        match id {
            Some(id) => s.try_publish_again_later(id, payload).await,
            None => {
                s.js.publish(s.subject.clone(), payload.to_vec().into())
                    .await
                    .expect("publish")
                    .await
                    .expect("publish ack");
                Ok(())
            }
        }
    }

    /// `NatsProducer::publish` refuses an empty ID; another client may still send the header
    /// empty.
    async fn publish_empty_id_form(&self, form: &'static str, payload: &[u8]) {
        assert_eq!(form, EMPTY_NATS_MSG_ID);
        let s = &self.streams;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, "");
        s.js.publish_with_headers(s.subject.clone(), headers, payload.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("publish ack");
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

idem_testkit::broker_conformance_tests!(NatsFixture);
