//! The shared broker conformance suite against a real RabbitMQ (`IDEM_TEST_AMQP_URL`).

mod common;

use std::time::Duration;

use common::Rabbit;
use idem_amqp::AmqpSource;
use idem_testkit::{BrokerFixture, DeadLettered};

struct AmqpFixture(Rabbit);

impl BrokerFixture for AmqpFixture {
    type Source = AmqpSource;

    const URL_VAR: &'static str = idem_testkit::services::AMQP;

    async fn setup(url: String, name: String) -> Self {
        Self(Rabbit::setup(url, name).await)
    }

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        self.0.publish(id, payload).await;
    }

    /// Every source opens its own connection; dropping one closes that connection, so the
    /// broker requeues its unacknowledged messages like after a crash.
    async fn source(&self) -> AmqpSource {
        self.0.source().connect().await.expect("connect source")
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        self.0
            .dead_letters(n, timeout)
            .await
            .into_iter()
            .map(common::DeadLetterMessage::into_dead_lettered)
            .collect()
    }

    /// RabbitMQ requeues as soon as the consumer's connection closes.
    fn redelivery_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn teardown(self) {
        self.0.teardown().await;
    }
}

idem_testkit::broker_conformance_tests!(AmqpFixture);
