//! The shared broker conformance suite against a real RabbitMQ (`IDEM_TEST_AMQP_URL`).

use crate::common;

use std::time::Duration;

use common::Rabbit;
use idem_amqp::AmqpSource;
use idem_amqp::lapin::BasicProperties;
use idem_core::Error;
use idem_testkit::{BrokerFixture, DeadLettered};

const EMPTY_MESSAGE_ID: &str = "empty message_id property";

struct AmqpFixture(Rabbit);

impl BrokerFixture for AmqpFixture {
    type Source = AmqpSource;

    const URL_VAR: &'static str = idem_testkit::services::AMQP;
    /// `message_id` is an AMQP short string.
    const MAX_ID_BYTES: usize = 255;
    /// RabbitMQ's `max_message_size` (its default, 128 MiB).
    const MAX_MESSAGE_BYTES: usize = 128 * 1024 * 1024;
    const EMPTY_ID_FORMS: &'static [&'static str] = &[EMPTY_MESSAGE_ID];

    async fn setup(url: String, name: String) -> Self {
        Self(Rabbit::setup(url, name).await)
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        self.0
            .producer
            .publish_with("", self.0.queue(), id, payload, BasicProperties::default())
            .await
    }

    /// `AmqpProducer` refuses an empty ID; the property itself may still be set empty.
    async fn publish_empty_id_form(&self, form: &'static str, payload: &[u8]) {
        assert_eq!(form, EMPTY_MESSAGE_ID);
        let properties = BasicProperties::default().with_message_id("".into());
        self.0
            .producer
            .publish_with("", self.0.queue(), None, payload, properties)
            .await
            .expect("publish with an empty message_id");
    }

    /// Every source opens its own connection; dropping one closes that connection, so the
    /// broker requeues its unacknowledged messages like after a crash.
    async fn source(&self) -> AmqpSource {
        self.0
            .source()
            .connect(self.0.url())
            .await
            .expect("connect source")
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
