//! The shared broker conformance suite against the real Mosquitto (MQTT v5).
//!
//! Each fixture consumes `$share/<name>/<name>` through a pool of client IDs. MQTT redelivers an
//! unacknowledged message only to the session it was sent to, when that session reconnects, and
//! Mosquitto keeps routing shared-subscription messages to offline members. So, as in a real
//! deployment where every consumer instance has a stable client ID, `source()` hands out the
//! lowest client ID whose previous source is gone (dropped or closed): a replacement consumer
//! resumes the vanished one's session and gets its unacknowledged and queued messages. Two live
//! sources get two distinct IDs. Slot 0's session is created in `setup`, so messages published
//! before any source exists are queued rather than dropped.

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::{Delivery, IdSource, Source};
use idem_core::{Error, ErrorKind};
use idem_mqtt::{MqttDelivery, MqttProducer, MqttSource};
use idem_testkit::{BrokerFixture, DeadLettered};

#[derive(Debug, Default)]
struct Slots {
    free: BTreeSet<usize>,
    issued: usize,
}

#[derive(Debug)]
struct MqttFixture {
    url: String,
    name: String,
    slots: Arc<Mutex<Slots>>,
    producer: MqttProducer,
    dead_letters: tokio::sync::Mutex<MqttSource>,
}

impl MqttFixture {
    fn filter(&self) -> String {
        format!("$share/{}/{}", self.name, self.name)
    }

    fn slot_id(name: &str, slot: usize) -> String {
        format!("{name}-{slot}")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An [`MqttSource`] holding its pool slot; dropping or closing it frees the slot.
#[derive(Debug)]
struct PooledSource {
    inner: MqttSource,
    _slot: SlotGuard,
}

#[derive(Debug)]
struct SlotGuard {
    slot: usize,
    slots: Arc<Mutex<Slots>>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .free
            .insert(self.slot);
    }
}

impl Source for PooledSource {
    type Delivery = MqttDelivery;

    fn broker(&self) -> &'static str {
        self.inner.broker()
    }

    fn default_id_source(&self) -> IdSource {
        self.inner.default_id_source()
    }

    async fn next(&mut self, max: usize) -> Result<Vec<MqttDelivery>, Error> {
        self.inner.next(max).await
    }

    async fn close(self) -> Result<(), Error> {
        let PooledSource { inner, _slot } = self;
        // The slot is freed only once the session is disconnected.
        let closed = inner.close().await;
        drop(_slot);
        closed
    }
}

impl BrokerFixture for MqttFixture {
    type Source = PooledSource;

    const URL_VAR: &'static str = idem_testkit::services::MQTT;
    /// A user property value is an MQTT string: a 16-bit length.
    const MAX_ID_BYTES: usize = 65_535;
    /// The adapter's default packet limit (`MqttSourceBuilder::max_packet_size`, 16 MiB); Mosquitto
    /// sets none of its own by default.
    const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

    async fn setup(url: String, name: String) -> Self {
        // Slot 0 joins the shared group now, so early publishes queue in its session.
        let first = common::builder(&Self::slot_id(&name, 0), &format!("$share/{name}/{name}"))
            .connect(&url)
            .await
            .expect("create the first consumer session");
        let mut slots = Slots::default();
        slots.free.insert(0);
        slots.issued = 1;
        let dead_letter_topic = format!("{name}/dead-letter");
        let dead_letters = common::builder(&format!("{name}-dlq"), &dead_letter_topic)
            .dead_letter_topic(format!("{name}/dead-letter-of-dead-letters"))
            .connect(&url)
            .await
            .expect("dead-letter reader");
        first.close().await.expect("close the first session");
        let producer = MqttProducer::connect(&url, format!("{name}-producer"))
            .await
            .expect("producer")
            .require_subscriber(true);
        Self {
            url,
            name,
            slots: Arc::new(Mutex::new(slots)),
            producer,
            dead_letters: tokio::sync::Mutex::new(dead_letters),
        }
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        let id = match id.map(std::str::from_utf8).transpose() {
            Ok(id) => id,
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::InvalidMessageId,
                    "MqttProducer::publish takes the ID as &str: MQTT user properties are UTF-8",
                ));
            }
        };
        self.producer.publish(&self.name, id, payload).await
    }

    async fn source(&self) -> PooledSource {
        let slot = {
            let mut s = self.lock();
            match s.free.pop_first() {
                Some(slot) => slot,
                None => {
                    s.issued += 1;
                    s.issued - 1
                }
            }
        };
        let guard = SlotGuard {
            slot,
            slots: self.slots.clone(),
        };
        let inner = common::builder(&Self::slot_id(&self.name, slot), &self.filter())
            .dead_letter_topic(format!("{}/dead-letter", self.name))
            .connect(&self.url)
            .await
            .expect("connect a consumer");
        PooledSource {
            inner,
            _slot: guard,
        }
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        let mut reader = self.dead_letters.lock().await;
        let deliveries = common::take(&mut reader, n, timeout).await;
        let mut out = Vec::new();
        for d in deliveries {
            out.push(DeadLettered {
                payload: d.payload().to_vec(),
                headers: d.user_properties().iter().cloned().collect(),
            });
            d.ack().await.expect("ack dead letter");
        }
        out
    }

    fn redelivery_timeout(&self) -> Duration {
        // MQTT redelivers as soon as the session reconnects.
        Duration::from_secs(5)
    }

    async fn teardown(self) {
        let mut ids: Vec<String> = (0..self.lock().issued)
            .map(|slot| Self::slot_id(&self.name, slot))
            .collect();
        ids.push(format!("{}-dlq", self.name));
        let reader = self.dead_letters.into_inner();
        let _ = reader.close().await;
        common::purge_sessions(&self.url, &ids).await;
    }
}

idem_testkit::broker_conformance_tests!(MqttFixture);
