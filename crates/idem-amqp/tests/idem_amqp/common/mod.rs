//! Shared by the AMQP tests: an isolated topology per test, a producer, and a reader for the
//! dead-letter queue.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_amqp::lapin::options::BasicGetOptions;
use idem_amqp::lapin::types::AMQPValue;
use idem_amqp::lapin::{BasicProperties, Channel};
use idem_amqp::{AmqpProducer, AmqpSourceBuilder, Topology};
use idem_testkit::DeadLettered;

/// One test's queue, dead-letter exchange and dead-letter queue, removed by `teardown`.
pub(crate) struct Rabbit {
    pub(crate) url: String,
    pub(crate) topology: Topology,
    pub(crate) producer: AmqpProducer,
}

impl Rabbit {
    pub(crate) async fn setup(url: String, name: String) -> Self {
        let producer = AmqpProducer::connect(&url).await.expect("connect producer");
        let topology = Topology::new(name);
        topology
            .declare(producer.channel())
            .await
            .expect("declare topology");
        Self {
            url,
            topology,
            producer,
        }
    }

    pub(crate) fn queue(&self) -> &str {
        self.topology.queue_name()
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn source(&self) -> AmqpSourceBuilder {
        self.topology.source()
    }

    pub(crate) fn channel(&self) -> &Channel {
        self.producer.channel()
    }

    pub(crate) async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        self.producer
            .publish_with(
                "",
                self.queue(),
                id.map(str::as_bytes),
                payload,
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }

    /// Takes up to `n` messages off the dead-letter queue, waiting at most `timeout`.
    pub(crate) async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLetterMessage> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < n {
            let got = self
                .channel()
                .basic_get(
                    self.topology.dead_letter_queue_name().into(),
                    BasicGetOptions { no_ack: true },
                )
                .await
                .expect("basic.get on the dead-letter queue");
            match got {
                Some(m) => out.push(DeadLetterMessage {
                    payload: m.delivery.data.clone(),
                    properties: m.delivery.properties.clone(),
                    routing_key: m.delivery.routing_key.to_string(),
                }),
                None if Instant::now() >= deadline => break,
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        out
    }

    /// Messages ready in the work queue (not counting unacknowledged ones).
    pub(crate) async fn ready(&self) -> u32 {
        self.channel()
            .queue_declare(
                self.queue().into(),
                idem_amqp::lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .expect("passive declare")
            .message_count()
    }

    pub(crate) async fn teardown(self) {
        let _ = self.topology.delete(self.producer.channel()).await;
        let _ = self.producer.close().await;
    }
}

/// A message read back from the dead-letter queue.
#[derive(Debug)]
pub(crate) struct DeadLetterMessage {
    pub(crate) payload: Vec<u8>,
    pub(crate) properties: BasicProperties,
    pub(crate) routing_key: String,
}

impl DeadLetterMessage {
    /// Every header table entry as lossy text, plus the `message_id` property under that name.
    pub(crate) fn headers(&self) -> HashMap<String, String> {
        let mut out = HashMap::new();
        if let Some(table) = self.properties.headers() {
            for (k, v) in table.inner() {
                let text = match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    AMQPValue::ShortString(s) => s.to_string(),
                    AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
                    other => format!("{other:?}"),
                };
                out.insert(k.to_string(), text);
            }
        }
        if let Some(id) = self.properties.message_id() {
            out.insert("message_id".to_owned(), id.to_string());
        }
        out
    }

    pub(crate) fn into_dead_lettered(self) -> DeadLettered {
        DeadLettered {
            headers: self.headers(),
            payload: self.payload,
        }
    }
}
