//! RabbitMQ-specific behaviour of the adapter, against a real broker (`IDEM_TEST_AMQP_URL`).

use crate::common;

use std::borrow::Cow;
use std::time::Duration;

use common::Rabbit;
use idem_amqp::lapin::BasicProperties;
use idem_amqp::lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_amqp::{AmqpDelivery, AmqpProducer, AmqpSource, Topology};
use idem_consumer::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, DETAIL_HEADER, DeadLetter, DeadLetterReason, Delivery,
    IdSource, REASON_HEADER, Source,
};
use idem_core::{ConsumerName, DerivedKey, ErrorKind, MessageId};
use idem_testkit::{service_url, services, unique_name};

const WAIT: Duration = Duration::from_secs(10);

async fn rabbit(test: &str) -> Option<Rabbit> {
    let url = service_url(services::AMQP, test)?;
    Some(Rabbit::setup(url, unique_name("idem", test)).await)
}

/// Fetches until `n` deliveries arrived (failing the test after [`WAIT`]).
async fn take(source: &mut AmqpSource, n: usize) -> Vec<AmqpDelivery> {
    let mut out = Vec::new();
    while out.len() < n {
        let batch = tokio::time::timeout(WAIT, source.next(n - out.len()))
            .await
            .expect("deliveries arrive in time")
            .expect("next succeeds");
        assert!(!batch.is_empty(), "an AMQP source never ends by itself");
        out.extend(batch);
    }
    out
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

fn id_of(d: &AmqpDelivery) -> Option<String> {
    d.broker_id()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[tokio::test]
async fn round_trip_reads_message_id_headers_and_acks() {
    let Some(rb) = rabbit("round_trip_reads_message_id_headers_and_acks").await else {
        return;
    };
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), text("acme"));
    headers.insert("seq".into(), AMQPValue::LongLongInt(42));
    headers.insert("raw".into(), AMQPValue::ByteArray(vec![1, 2].into()));
    rb.producer
        .publish_with(
            "",
            rb.queue(),
            Some(b"m-1"),
            b"one",
            BasicProperties::default().with_headers(headers),
        )
        .await
        .expect("publish with headers");
    // The helper takes &str, &MessageId and derived keys (as message IDs) alike.
    let id = MessageId::new("m-2").expect("valid id");
    rb.producer
        .publish("", rb.queue(), &id, b"two")
        .await
        .expect("publish MessageId");
    let consumer = ConsumerName::new("billing").expect("valid name");
    let derived = DerivedKey::new(&consumer, &id, "publish:receipt").to_message_id();
    rb.producer
        .publish("", rb.queue(), &derived, b"three")
        .await
        .expect("publish derived key");

    let mut source = rb.source().connect(rb.url()).await.expect("connect");
    assert_eq!(source.broker(), "amqp");
    assert_eq!(source.default_id_source(), IdSource::BrokerId);
    let got = take(&mut source, 3).await;

    let first = &got[0];
    assert_eq!(first.payload(), b"one");
    assert_eq!(id_of(first).as_deref(), Some("m-1"));
    assert_eq!(first.header("tenant"), Some(Cow::Borrowed(&b"acme"[..])));
    assert_eq!(first.header("seq").as_deref(), Some(&b"42"[..]));
    assert_eq!(first.header("raw").as_deref(), Some(&[1u8, 2][..]));
    assert_eq!(first.header("absent"), None);
    assert_eq!(first.previous_deliveries(), 0);
    assert!(!first.redelivered());
    assert_eq!(*first.properties().delivery_mode(), Some(2), "persistent");
    assert_eq!(
        first.origin().to_string(),
        format!("queue {} delivery-tag {}", rb.queue(), first.delivery_tag())
    );
    assert_eq!(id_of(&got[1]).as_deref(), Some("m-2"));
    assert_eq!(id_of(&got[2]), Some(derived.to_string()));
    for d in got {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    assert_eq!(rb.ready().await, 0, "acked messages are gone");
    rb.teardown().await;
}

#[tokio::test]
async fn next_drains_what_is_buffered_up_to_max_without_waiting() {
    let Some(rb) = rabbit("next_drains_what_is_buffered_up_to_max").await else {
        return;
    };
    for i in 0..5 {
        rb.publish(Some(&format!("drain-{i}")), b"x").await;
    }
    let mut source = rb
        .source()
        .prefetch(10)
        .connect(rb.url())
        .await
        .expect("connect");
    // Let the broker push all five into the prefetch buffer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = tokio::time::timeout(WAIT, source.next(3))
        .await
        .expect("in time")
        .expect("next");
    assert_eq!(
        batch.len(),
        3,
        "max is respected and buffered deliveries are drained"
    );
    let rest = tokio::time::timeout(WAIT, source.next(100))
        .await
        .expect("in time")
        .expect("next");
    assert_eq!(
        rest.len(),
        2,
        "returns what is there instead of waiting for 100"
    );
    for d in batch.into_iter().chain(rest) {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn unacked_delivery_comes_back_redelivered_when_its_consumer_vanishes() {
    let Some(rb) = rabbit("unacked_delivery_comes_back_redelivered").await else {
        return;
    };
    rb.publish(Some("again-1"), b"payload").await;
    let mut first = rb.source().connect(rb.url()).await.expect("connect");
    let got = take(&mut first, 1).await;
    assert_eq!(got[0].previous_deliveries(), 0);
    // Like a crashed process: no ack, no close; the delivery even outlives its source.
    drop(first);

    let mut second = rb.source().connect(rb.url()).await.expect("connect");
    let again = take(&mut second, 1).await;
    assert_eq!(id_of(&again[0]).as_deref(), Some("again-1"));
    assert_eq!(again[0].payload(), b"payload");
    assert!(again[0].redelivered());
    assert_eq!(again[0].previous_deliveries(), 1);
    // The stale delivery cannot be settled any more.
    let stale = got.into_iter().next().expect("one");
    let err = stale.ack().await.expect_err("the old channel is gone");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    for d in again {
        d.ack().await.expect("ack");
    }
    second.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn abandon_requeues_at_once() {
    let Some(rb) = rabbit("abandon_requeues_at_once").await else {
        return;
    };
    rb.publish(Some("back-1"), b"x").await;
    let mut source = rb.source().connect(rb.url()).await.expect("connect");
    let got = take(&mut source, 1).await;
    for d in got {
        d.abandon().await;
    }
    let again = take(&mut source, 1).await;
    assert!(again[0].redelivered());
    assert_eq!(again[0].previous_deliveries(), 1);
    for d in again {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn quorum_queues_count_deliveries() {
    let Some(url) = service_url(services::AMQP, "quorum_queues_count_deliveries") else {
        return;
    };
    let topology = Topology::new(unique_name("idem", "quorum_queues")).quorum();
    let producer = AmqpProducer::connect(&url).await.expect("producer");
    topology.declare(producer.channel()).await.expect("declare");
    producer
        .publish("", topology.queue_name(), "q-1", b"x")
        .await
        .expect("publish");
    let mut source = topology.source().connect(&url).await.expect("connect");
    for round in 0..3u32 {
        let got = take(&mut source, 1).await;
        assert!(
            got[0].previous_deliveries() >= round,
            "round {round}: {:?}",
            got[0]
        );
        for d in got {
            d.abandon().await;
        }
    }
    let last = take(&mut source, 1).await;
    assert!(
        last[0].previous_deliveries() >= 3,
        "{:?}",
        last[0].properties()
    );
    for d in last {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    let _ = topology.delete(producer.channel()).await;
    let _ = producer.close().await;
}

#[tokio::test]
async fn dead_letter_keeps_payload_and_properties_and_adds_reason_headers() {
    let Some(rb) = rabbit("dead_letter_keeps_payload_and_properties").await else {
        return;
    };
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), text("acme"));
    rb.producer
        .publish_with(
            "",
            rb.queue(),
            Some(b"dl-1"),
            b"\x00not json",
            BasicProperties::default()
                .with_headers(headers)
                .with_content_type("application/json".into())
                .with_correlation_id("corr-9".into()),
        )
        .await
        .expect("publish");
    let mut source = rb.source().connect(rb.url()).await.expect("connect");
    let got = take(&mut source, 1).await;
    let reason = DeadLetter::new(DeadLetterReason::Undecodable, "expected JSON\nat byte 0")
        .with_context("billing", 2);
    for d in got {
        d.dead_letter(&reason).await.expect("dead letter");
    }

    let letters = rb.dead_letters(1, WAIT).await;
    assert_eq!(letters.len(), 1);
    let dl = &letters[0];
    assert_eq!(dl.payload, b"\x00not json");
    assert_eq!(dl.routing_key, rb.queue());
    let p = &dl.properties;
    assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("dl-1"));
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(
        p.correlation_id().as_ref().map(|s| s.as_str()),
        Some("corr-9")
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    let h = dl.headers();
    assert_eq!(h.get("tenant").map(String::as_str), Some("acme"));
    assert_eq!(
        h.get(REASON_HEADER).map(String::as_str),
        Some("undecodable")
    );
    assert_eq!(
        h.get(DETAIL_HEADER).map(String::as_str),
        Some("expected JSON at byte 0")
    );
    assert_eq!(h.get(CONSUMER_HEADER).map(String::as_str), Some("billing"));
    assert_eq!(h.get(ATTEMPTS_HEADER).map(String::as_str), Some("2"));

    source.close().await.expect("close");
    assert_eq!(
        rb.ready().await,
        0,
        "the original was acked after the dead letter"
    );
    rb.teardown().await;
}

#[tokio::test]
async fn failed_dead_letter_leaves_the_original_for_redelivery() {
    let Some(rb) = rabbit("failed_dead_letter_leaves_the_original").await else {
        return;
    };
    rb.publish(Some("nowhere-1"), b"keep me").await;
    // An exchange that does not exist: the broker closes the channel (404).
    let mut source = rb
        .source()
        .dead_letter_exchange(format!("{}.missing", rb.queue()))
        .connect(rb.url())
        .await
        .expect("connect");
    let got = take(&mut source, 1).await;
    let reason = DeadLetter::new(DeadLetterReason::Rejected, "no");
    for d in got {
        let err = d
            .dead_letter(&reason)
            .await
            .expect_err("dead-lettering fails");
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    }
    // The source notices the dead channel once, then reconnects and gets the message back.
    let err = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("in time")
        .expect_err("the channel is closed");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    let again = take(&mut source, 1).await;
    assert_eq!(again[0].payload(), b"keep me");
    assert!(again[0].redelivered());
    for d in again {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    assert!(rb.dead_letters(1, Duration::ZERO).await.is_empty());
    rb.teardown().await;
}

#[tokio::test]
async fn unroutable_dead_letter_is_an_error_not_a_silent_drop() {
    let Some(rb) = rabbit("unroutable_dead_letter_is_an_error").await else {
        return;
    };
    rb.publish(Some("unroutable-1"), b"x").await;
    // The exchange exists but nothing is bound under this routing key.
    let mut source = rb
        .source()
        .dead_letter_routing_key("no-such-binding")
        .connect(rb.url())
        .await
        .expect("connect");
    let got = take(&mut source, 1).await;
    for d in got {
        let err = d
            .dead_letter(&DeadLetter::new(DeadLetterReason::Rejected, "no"))
            .await
            .expect_err("unroutable");
        assert!(err.to_string().contains("unroutable"), "{err}");
    }
    // The channel was closed on purpose so the runner's backoff paces the redelivery.
    assert!(
        tokio::time::timeout(WAIT, source.next(1))
            .await
            .expect("in time")
            .is_err()
    );
    let again = take(&mut source, 1).await;
    assert!(again[0].redelivered());
    for d in again {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn reconnects_after_its_connection_is_closed() {
    let Some(rb) = rabbit("reconnects_after_its_connection_is_closed").await else {
        return;
    };
    let mut source = rb.source().connect(rb.url()).await.expect("connect");
    source
        .connection()
        .expect("connected")
        .close(320, "test: forced close".into())
        .await
        .expect("close the connection under the source");
    let err = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("in time")
        .expect_err("the loss is reported once");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    rb.publish(Some("after-1"), b"x").await;
    let got = take(&mut source, 1).await;
    assert_eq!(id_of(&got[0]).as_deref(), Some("after-1"));
    for d in got {
        d.ack().await.expect("ack on the new channel");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn reconnects_after_the_broker_cancels_the_consumer() {
    let Some(rb) = rabbit("reconnects_after_the_broker_cancels").await else {
        return;
    };
    let mut source = rb.source().connect(rb.url()).await.expect("connect");
    // Deleting the queue makes the broker cancel the consumer (basic.cancel).
    rb.channel()
        .queue_delete(rb.queue().into(), QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    let err = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("in time")
        .expect_err("cancelled");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    // While the queue is missing, reconnecting fails and says so.
    let err = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("in time")
        .expect_err("no queue");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    rb.topology.declare(rb.channel()).await.expect("redeclare");
    rb.publish(Some("back-1"), b"x").await;
    let got = take(&mut source, 1).await;
    assert_eq!(id_of(&got[0]).as_deref(), Some("back-1"));
    for d in got {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}

#[tokio::test]
async fn a_source_built_while_the_broker_is_unreachable_reports_unavailable() {
    // Nothing listens on port 1: the connect fails fast, as an outage the runner retries.
    let mut source = AmqpSource::builder("q")
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy("amqp://guest:guest@127.0.0.1:1/%2f")
        .expect("valid settings");
    let err = source.next(1).await.expect_err("unreachable");
    assert_eq!(err.kind(), ErrorKind::Unavailable);

    let err = AmqpSource::builder("q")
        .connect_lazy("not a url")
        .expect_err("bad url");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    assert!(!err.to_string().contains("not a url"));
    let err = AmqpSource::builder("q".repeat(300))
        .connect_lazy("amqp://127.0.0.1")
        .expect_err("queue name too long");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
}

#[tokio::test]
async fn producer_refuses_unroutable_messages_and_bad_ids() {
    let Some(rb) = rabbit("producer_refuses_unroutable").await else {
        return;
    };
    let err = rb
        .producer
        .publish("", &format!("{}.nobody", rb.queue()), "id-1", b"x")
        .await
        .expect_err("no queue behind that routing key");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert!(err.to_string().contains("unroutable"), "{err}");
    for bad in [&b""[..], &[0xff][..], "x".repeat(256).as_bytes()] {
        let err = rb
            .producer
            .publish("", rb.queue(), bad, b"x")
            .await
            .expect_err("invalid id");
        assert_eq!(err.kind(), ErrorKind::InvalidMessageId);
    }
    // The channel is still usable after the refusals.
    rb.publish(Some("fine"), b"x").await;
    // And an unconfirmed raw publish path stays available through the channel.
    rb.channel()
        .basic_publish(
            "".into(),
            rb.queue().into(),
            BasicPublishOptions::default(),
            b"raw",
            BasicProperties::default(),
        )
        .await
        .expect("raw publish")
        .await
        .expect("confirm");
    assert!(
        common_wait_ready(&rb, 2).await,
        "both messages are in the queue"
    );
    rb.teardown().await;
}

async fn common_wait_ready(rb: &Rabbit, n: u32) -> bool {
    for _ in 0..100 {
        if rb.ready().await == n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The broker's process id of the connection named `name`, via `rabbitmqctl` (None when the
/// tool is not usable from this test, e.g. the broker runs on another host).
fn broker_connection_pid(name: &str) -> Option<String> {
    // The plain formatter prints pids as `close_connection` wants them (`<rabbit@host.1.2.3>`);
    // the JSON one does not.
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .ok()?;
    let listed = String::from_utf8_lossy(&out.stdout);
    let line = listed.lines().find(|l| l.contains(name))?;
    line.split('\t').next().map(str::to_owned)
}

#[tokio::test]
async fn reconnects_after_the_broker_closes_the_connection() {
    let Some(rb) = rabbit("reconnects_after_the_broker_closes").await else {
        return;
    };
    let name = unique_name("conn", "broker_closes");
    let mut source = rb
        .source()
        .connection_name(name.clone())
        .connect(rb.url())
        .await
        .expect("connect");
    rb.publish(Some("before-1"), b"x").await;
    let unacked = take(&mut source, 1).await;

    let Some(pid) = broker_connection_pid(&name) else {
        eprintln!(
            "SKIPPING reconnects_after_the_broker_closes_the_connection: rabbitmqctl cannot see the broker"
        );
        rb.teardown().await;
        return;
    };
    let closed = std::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pid, "idem test: server-side close"])
        .output()
        .expect("run rabbitmqctl");
    assert!(closed.status.success(), "{closed:?}");

    let err = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("in time")
        .expect_err("the loss is reported once");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    // The broker requeued what the dead connection held; the new connection gets it back.
    let again = take(&mut source, 1).await;
    assert_eq!(id_of(&again[0]).as_deref(), Some("before-1"));
    assert!(again[0].redelivered());
    for d in unacked {
        assert!(d.ack().await.is_err(), "the old delivery cannot be acked");
    }
    for d in again {
        d.ack().await.expect("ack");
    }
    source.close().await.expect("close");
    rb.teardown().await;
}
