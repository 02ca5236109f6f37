//! The broker conformance suite against the in-memory fake broker: checks the suite and the
//! runner themselves, with no server. Real adapters run the same suite against real brokers.

use std::collections::HashMap;
use std::time::Duration;

use idem_consumer::{InMemoryBroker, InMemorySource, Settled};
use idem_core::Error;
use idem_testkit::{BrokerFixture, DeadLettered};

#[derive(Debug)]
struct InMemoryFixture {
    broker: InMemoryBroker,
}

impl BrokerFixture for InMemoryFixture {
    type Source = InMemorySource;
    const URL_VAR: &'static str = "";
    const MAX_ID_BYTES: usize = usize::MAX;
    const MAX_MESSAGE_BYTES: usize = usize::MAX;

    async fn setup(_url: String, _name: String) -> Self {
        Self {
            broker: InMemoryBroker::new(),
        }
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        let _seq = match id {
            Some(id) => self.broker.publish(&[("message-id", id)], payload),
            None => self.broker.publish(&[], payload),
        };
        Ok(())
    }

    async fn source(&self) -> InMemorySource {
        self.broker.source()
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let letters: Vec<DeadLettered> = self
                .broker
                .settled()
                .into_iter()
                .filter_map(|(_, payload, how)| match how {
                    Settled::DeadLettered(headers) => Some(DeadLettered {
                        payload,
                        headers: headers
                            .into_iter()
                            .map(|(k, v)| (k.to_owned(), v))
                            .collect::<HashMap<_, _>>(),
                    }),
                    Settled::Acked => None,
                })
                .collect();
            if letters.len() >= n || tokio::time::Instant::now() >= deadline {
                return letters;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn redelivery_timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn teardown(self) {}
}

idem_testkit::broker_conformance_tests!(InMemoryFixture);
