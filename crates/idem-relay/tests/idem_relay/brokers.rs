//! The relay against real brokers and a real outbox: rows committed to a SQLite file's outbox
//! table, published through `AnyProducer` and read back with the matching idem source, which
//! must find each message's derived ID in its ID slot, the headers where it reads headers, and
//! one key's rows in order. Each test uses its own stream, queue or topic, and removes it.

use std::time::Duration;

use idem_any::{AnyProducer, BrokerUrl, SourceSpec, WithSource};
use idem_consumer::{Delivery, Source};
use idem_core::outbox::{Emitter, Outgoing};
use idem_core::{ConsumerName, MessageId};
use idem_relay::{BrokerPublisher, CancellationToken, Relay};
use idem_sql::SqliteStore;
use tokio::time::Instant;

use crate::outbox::Outbox;

/// What a consumer read of one message.
#[derive(Debug, PartialEq, Eq)]
struct Read {
    id: Vec<u8>,
    payload: Vec<u8>,
    kind: Option<Vec<u8>>,
    tenant: Option<Vec<u8>>,
}

/// Runs the relay while reading `expect` messages from the source, then stops both.
struct Relayed {
    relay: Relay<SqliteStore, AnyProducer>,
    expect: usize,
}

impl WithSource for Relayed {
    type Output = (Vec<Read>, idem_relay::RelayStats);

    async fn run<S: Source>(self, mut source: S) -> Self::Output {
        let stop = CancellationToken::new();
        let relay = tokio::spawn(self.relay.run(stop.clone()));
        let ids = source.default_id_source();
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < self.expect && Instant::now() < deadline {
            let batch = match tokio::time::timeout_at(deadline, source.next(16)).await {
                Ok(Ok(batch)) => batch,
                Ok(Err(e)) => panic!("reading back: {e}"),
                Err(_) => break,
            };
            for d in batch {
                let id = ids.extract(&d).map(|c| c.into_owned());
                got.push(Read {
                    id: id.unwrap_or_else(|dl| panic!("no ID where the consumer reads it: {dl:?}")),
                    payload: d.payload().to_vec(),
                    kind: d.header("kind").map(|c| c.into_owned()),
                    tenant: d.header("tenant").map(|c| c.into_owned()),
                });
                d.ack().await.expect("ack");
            }
        }
        stop.cancel();
        let stats = relay.await.expect("relay task").expect("relay run");
        let _ = source.close().await;
        (got, stats)
    }
}

/// Three messages of one key and one unkeyed, with headers, their IDs derived as a handler's.
fn messages(destination: &str) -> Vec<Outgoing> {
    let consumer = ConsumerName::new("orders-service").expect("test setup");
    let incoming = MessageId::new("incoming-42").expect("test setup");
    let mut emitter = Emitter::for_message(&consumer, &incoming);
    let mut out = Vec::new();
    for i in 0..3 {
        out.push(
            emitter
                .message(destination, format!(r#"{{"step":{i}}}"#).into_bytes())
                .expect("test setup")
                .header("kind", "Created")
                .expect("test setup")
                .header("tenant", "acme")
                .expect("test setup")
                .ordering_key("account-7")
                .expect("test setup"),
        );
    }
    out.push(
        emitter
            .message(destination, br#"{"step":"unkeyed"}"#.to_vec())
            .expect("test setup")
            .header("kind", "Created")
            .expect("test setup")
            .header("tenant", "acme")
            .expect("test setup"),
    );
    out
}

async fn relays_with_ids_and_headers(var: &str, test: &str) {
    let Some(url) = idem_testkit::service_url(var, test) else {
        return;
    };
    let url = BrokerUrl::parse(&url).expect("test setup");
    let name = idem_testkit::unique_name("relay", test);
    let spec = SourceSpec::new(&name, format!("{name}_c"), format!("{name}_i"));
    let outbox = Outbox::new(test).await;
    let sent = messages(&name);
    outbox.enqueue(&sent).await;
    let producer = AnyProducer::connect(&url, &format!("{name}_relay"))
        .await
        .expect("test setup");
    let relay = Relay::builder(format!("{name}_relay"))
        .poll_interval(Duration::from_millis(50))
        .build(outbox.store.clone(), producer)
        .expect("test setup");
    let (got, stats) = url
        .with_source(
            &spec,
            Relayed {
                relay,
                expect: sent.len(),
            },
        )
        .await
        .expect("test setup");
    url.teardown(&spec).await.expect("test setup");

    assert_eq!(got.len(), sent.len(), "{got:?}");
    let expected = |m: &Outgoing| Read {
        id: m.id().as_bytes().to_vec(),
        payload: m.payload().to_vec(),
        kind: Some(b"Created".to_vec()),
        tenant: Some(b"acme".to_vec()),
    };
    for m in &sent {
        assert!(
            got.contains(&expected(m)),
            "{m:?} not read back as sent: {got:?}"
        );
    }
    // One key's messages arrive in their sequence order.
    let keyed: Vec<&Read> = got
        .iter()
        .filter(|r| sent[..3].iter().any(|m| m.id().as_bytes() == r.id))
        .collect();
    let order: Vec<&Read> = sent[..3]
        .iter()
        .map(|m| {
            got.iter()
                .find(|r| r.id == m.id().as_bytes())
                .expect("test setup")
        })
        .collect();
    assert_eq!(keyed, order);
    let backlog = outbox.backlog().await;
    assert_eq!((backlog.unsent, backlog.sent), (0, 4), "{backlog:?}");
    assert_eq!(stats.published, 4);
    assert_eq!(stats.dead_lettered, 0);
    outbox.remove().await;
}

#[tokio::test]
async fn nats_jetstream() {
    relays_with_ids_and_headers("IDEM_TEST_NATS_URL", "nats_jetstream").await;
}

#[tokio::test]
async fn rabbitmq() {
    relays_with_ids_and_headers("IDEM_TEST_AMQP_URL", "rabbitmq").await;
}

#[tokio::test]
async fn redis_streams() {
    relays_with_ids_and_headers("IDEM_TEST_REDIS_URL", "redis_streams").await;
}

#[tokio::test]
async fn mqtt() {
    relays_with_ids_and_headers("IDEM_TEST_MQTT_URL", "mqtt").await;
}

/// A subject no stream captures (dotted, so the relay cannot create a stream named like it):
/// JetStream refuses the publish for good, and the row is dead-lettered with the reason
/// instead of retried forever.
#[tokio::test]
async fn nats_subject_without_a_stream_is_dead_lettered() {
    let test = "nats_subject_without_a_stream_is_dead_lettered";
    let Some(url) = idem_testkit::service_url("IDEM_TEST_NATS_URL", test) else {
        return;
    };
    let url = BrokerUrl::parse(&url).expect("test setup");
    let subject = format!("nowhere.{}", idem_testkit::unique_name("relay", "nostream"));
    let outbox = Outbox::new(test).await;
    let id = MessageId::new("lost-1").expect("test setup");
    outbox
        .enqueue(&[Outgoing::new(id.clone(), subject, b"{}".to_vec()).expect("test setup")])
        .await;
    let producer = AnyProducer::connect(&url, "relay")
        .await
        .expect("test setup");
    let relay = Relay::builder("nostream-relay")
        .poll_interval(Duration::from_millis(50))
        .build(outbox.store.clone(), producer)
        .expect("test setup");
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while outbox.dead_letter_reason(&id).await.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    let stats = task.await.expect("test setup").expect("test setup");
    let reason = outbox.dead_letter_reason(&id).await;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.starts_with("invalid-destination: ")),
        "{reason:?}"
    );
    let backlog = outbox.backlog().await;
    assert_eq!(
        (backlog.unsent, backlog.dead_lettered),
        (0, 1),
        "{backlog:?}"
    );
    assert_eq!(stats.dead_lettered, 1);
    outbox.remove().await;
}

/// A queue that exists with other arguments than idem declares (no dead-letter exchange):
/// RabbitMQ refuses the relay's declaration and closes that channel. Through a
/// `BrokerPublisher` the refusal happens on a connection of its own, so the rows still
/// publish to the queue as it is.
#[tokio::test]
async fn rabbitmq_queue_declared_otherwise_still_receives() {
    use idem_amqp::lapin::options::QueueDeclareOptions;
    use idem_amqp::lapin::types::FieldTable;

    let test = "rabbitmq_queue_declared_otherwise_still_receives";
    let Some(raw) = idem_testkit::service_url("IDEM_TEST_AMQP_URL", test) else {
        return;
    };
    let name = idem_testkit::unique_name("relay", "amqp_other");
    let admin = idem_amqp::AmqpProducer::connect(&raw)
        .await
        .expect("connect");
    let plain = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    admin
        .channel()
        .queue_declare(name.as_str().into(), plain, FieldTable::default())
        .await
        .expect("declare the plain queue");

    let outbox = Outbox::new(test).await;
    outbox.enqueue(&messages(&name)).await;
    let url = BrokerUrl::parse(&raw).expect("test setup");
    let publisher = BrokerPublisher::new(url, format!("{name}_relay"));
    let relay = Relay::builder(format!("{name}_relay"))
        .poll_interval(Duration::from_millis(50))
        .build(outbox.store.clone(), publisher)
        .expect("test setup");
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while outbox.backlog().await.sent < 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    let stats = task.await.expect("relay task").expect("relay run");
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let queued = admin
        .channel()
        .queue_declare(name.as_str().into(), passive, FieldTable::default())
        .await
        .expect("the queue is still there")
        .message_count();
    let _ = admin
        .channel()
        .queue_delete(name.as_str().into(), Default::default())
        .await;
    let _ = admin.close().await;
    assert_eq!(stats.published, 4, "{stats:?}");
    assert_eq!(queued, 4);
    outbox.remove().await;
}

/// Broker de-duplication only saves redeliveries: a relay that publishes the same row again
/// after JetStream's duplicate window (its confirm was lost, so the row was released and
/// published again later) puts a second copy on the stream, and the next idem consumer's
/// claim makes that copy a duplicate — one effect. The window is 1 s here (two minutes by
/// default); the retry waits 1.5 s.
#[tokio::test]
async fn nats_resend_after_the_duplicate_window_is_one_effect_downstream() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use idem_consumer::{Consumer, Raw};
    use idem_core::{BoxError, Error, ErrorKind, Handler, Identified, Message, Processor};
    use idem_nats::async_nats::jetstream;
    use idem_relay::Publish;

    /// Publishes through the broker, then says the first confirm was lost.
    struct ConfirmLostOnce {
        inner: AnyProducer,
        lost: AtomicBool,
    }
    impl Publish for ConfirmLostOnce {
        async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
            Publish::publish(&self.inner, msg).await?;
            if !self.lost.swap(true, Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Unavailable, "the confirm was lost"));
            }
            Ok(())
        }
        async fn ensure_destination(&self, destination: &str) -> Result<(), Error> {
            Publish::ensure_destination(&self.inner, destination).await
        }
    }

    /// The downstream effect: one row per processed message.
    struct Effect;
    impl Handler<idem_sql::SqliteTx, Vec<u8>> for Effect {
        type Output = ();
        async fn handle(
            &self,
            tx: &mut idem_sql::SqliteTx,
            msg: &Message<Vec<u8>>,
        ) -> Result<(), BoxError> {
            sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
                .bind(msg.message_id().as_bytes())
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    }

    /// Consumes until two deliveries settled, then stops.
    struct Consume {
        store: SqliteStore,
    }
    impl WithSource for Consume {
        type Output = idem_consumer::RunStats;
        async fn run<S: Source>(self, source: S) -> Self::Output {
            let processor = Arc::new(
                Processor::builder(self.store, "downstream")
                    .build()
                    .expect("processor"),
            );
            let consumer = Consumer::new(processor, source);
            let observer = consumer.observer();
            let stop = CancellationToken::new();
            let run = tokio::spawn(consumer.run(Raw, Effect, stop.clone()));
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                let s = observer.snapshot();
                if s.processed + s.duplicates >= 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            stop.cancel();
            run.await.expect("consumer task").expect("consumer run")
        }
    }

    let test = "nats_resend_after_the_duplicate_window_is_one_effect_downstream";
    let Some(raw) = idem_testkit::service_url("IDEM_TEST_NATS_URL", test) else {
        return;
    };
    let name = idem_testkit::unique_name("relay", "window");
    let js = jetstream::new(
        idem_nats::async_nats::connect(raw.as_str())
            .await
            .expect("connect"),
    );
    js.create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![name.clone()],
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .expect("a stream with a 1 s duplicate window");

    let outbox = Outbox::new(test).await;
    let sent = Emitter::for_message(
        &ConsumerName::new("orders-service").expect("name"),
        &MessageId::new("incoming-7").expect("id"),
    )
    .message(name.as_str(), b"once".to_vec())
    .expect("message");
    outbox.enqueue(std::slice::from_ref(&sent)).await;
    let url = BrokerUrl::parse(&raw).expect("url");
    let publisher = ConfirmLostOnce {
        inner: AnyProducer::connect(&url, "relay").await.expect("producer"),
        lost: AtomicBool::new(false),
    };
    let relay = Relay::builder(format!("{name}_relay"))
        .poll_interval(Duration::from_millis(50))
        // The wait is jittered within [base/2, base], and JetStream forgets a message ID on a
        // timer that runs once per window, so an ID can outlive its 1 s window by up to one
        // more. 1.5 s waited 0.75..1.5 s, sometimes still inside (CI failed on it once); 5 s
        // waits 2.5..5 s, past two windows.
        .retry_backoff(Duration::from_secs(5), Duration::from_secs(5))
        .build(outbox.store.clone(), publisher)
        .expect("relay");
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(15);
    while outbox.backlog().await.sent < 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let relayed = task.await.expect("relay task").expect("relay run");
    let stored = js
        .get_stream(name.as_str())
        .await
        .expect("stream")
        .info()
        .await
        .expect("stream info")
        .state
        .messages;

    // Downstream: an idem consumer with its own claims table.
    let downstream = Outbox::new(&format!("{test}_downstream")).await;
    sqlx::query("CREATE TABLE effects (message_id BLOB NOT NULL)")
        .execute(downstream.store.pool())
        .await
        .expect("effects table");
    let spec = SourceSpec::new(&name, format!("{name}_c"), "reader");
    let stats = url
        .with_source(
            &spec,
            Consume {
                store: downstream.store.clone(),
            },
        )
        .await
        .expect("consume");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(downstream.store.pool())
        .await
        .expect("count");
    let _ = url.teardown(&spec).await;
    outbox.remove().await;
    downstream.remove().await;

    assert_eq!(relayed.published, 1, "{relayed:?}");
    assert!(
        relayed.failed >= 1,
        "the first confirm was lost: {relayed:?}"
    );
    assert_eq!(
        stored, 2,
        "past the window JetStream keeps the resend as a second message"
    );
    assert_eq!((stats.processed, stats.duplicates), (1, 1), "{stats:?}");
    assert_eq!(effects, 1, "one effect downstream");
}
