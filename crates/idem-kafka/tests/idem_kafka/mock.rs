//! Adapter tests against librdkafka's in-process mock cluster: no server needed, so they run in
//! every plain `cargo test`.

use crate::common;

use std::time::Duration;

use common::{Db, RecordEffect, committed, fast_group, read_topic};
use futures_util::FutureExt;
use idem_consumer::{
    CancellationToken, Consumer, DeadLetter, DeadLetterReason, Delivery, IdSource, Raw, Source,
};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::mocking::MockCluster;
use idem_kafka::rdkafka::producer::FutureRecord;
use idem_kafka::{KafkaDelivery, KafkaProducer, KafkaSource};
use idem_testkit::unique_name;

const WAIT: Duration = Duration::from_secs(60);

async fn source(brokers: &str, group: &str, topic: &str) -> KafkaSource {
    fast_group(KafkaSource::builder(topic, group))
        .connect(brokers)
        .await
        .expect("source")
}

/// Fetches until `n` deliveries arrived, sorted by (partition, offset).
async fn fetch(source: &mut KafkaSource, n: usize) -> Vec<KafkaDelivery> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while got.len() < n {
        let batch = tokio::time::timeout_at(deadline, source.next(n - got.len()))
            .await
            .expect("deliveries in time")
            .expect("fetch");
        got.extend(batch);
    }
    got.sort_by_key(|d| (d.partition(), d.offset()));
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn round_trip_through_the_runner_commits_each_message_once() {
    let mock = MockCluster::new(1).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    let topic = unique_name("orders", "round_trip");
    mock.create_topic(&topic, 2, 1).expect("topic");
    let producer = KafkaProducer::connect(&brokers).await.expect("producer");
    for i in 0..6 {
        let key = format!("k{}", i % 3);
        producer
            .publish(
                &topic,
                Some(key.as_bytes()),
                &format!("id-{i}"),
                format!("p{i}").as_bytes(),
            )
            .await
            .expect("publish");
    }
    // The producer retried: same ID, same payload.
    producer
        .publish(&topic, Some(b"k0"), "id-0", b"p0")
        .await
        .expect("publish duplicate");

    let db = Db::new("round_trip").await;
    let group = unique_name("billing", "round_trip");
    let consumer = Consumer::new(
        db.processor("billing"),
        source(&brokers, &group, &topic).await,
    )
    .concurrency(4);
    let observer = consumer.observer();
    let stop = CancellationToken::new();
    let run = tokio::spawn(consumer.run(Raw, RecordEffect, stop.clone()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while {
        let s = observer.snapshot();
        s.processed + s.duplicates < 7
    } {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out: {:?}",
            observer.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let stats = run.await.expect("runner task").expect("run");
    assert_eq!(
        (stats.processed, stats.duplicates, stats.dead_lettered),
        (6, 1, 0),
        "{stats:?}"
    );

    let effects = db.effects().await;
    assert_eq!(effects.len(), 6, "{effects:?}");
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    // close() committed everything: the two partitions together hold 7 records.
    let offsets = committed(&brokers, &group, &topic, 2).await;
    assert_eq!(
        offsets.iter().map(|o| o.unwrap_or(0)).sum::<i64>(),
        7,
        "{offsets:?}"
    );
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn out_of_order_acks_commit_only_the_contiguous_prefix() {
    let mock = MockCluster::new(1).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    let topic = unique_name("orders", "out_of_order");
    mock.create_topic(&topic, 1, 1).expect("topic");
    let producer = KafkaProducer::connect(&brokers).await.expect("producer");
    for i in 0..5 {
        producer
            .publish(&topic, None, &format!("id-{i}"), b"x")
            .await
            .expect("publish");
    }
    let group = unique_name("g", "out_of_order");
    let mut source = source(&brokers, &group, &topic).await;
    let mut got = fetch(&mut source, 5).await;
    assert_eq!(
        got.iter().map(KafkaDelivery::offset).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert_eq!(got[2].origin().to_string(), format!("{topic}/0@2"));
    assert_eq!(
        got[2].header("message-id").as_deref(),
        Some(b"id-2".as_slice())
    );
    assert_eq!(
        got[2].broker_id().as_deref(),
        Some(format!("{topic}/0/2").as_bytes())
    );
    assert_eq!(source.default_id_source(), IdSource::header("message-id"));

    let held = got.remove(2);
    for d in got.into_iter().rev() {
        d.ack().await.expect("ack");
    }
    source.commit().await.expect("commit");
    assert_eq!(
        committed(&brokers, &group, &topic, 1).await,
        vec![Some(2)],
        "offset 2 is still in flight"
    );

    held.ack().await.expect("ack");
    source.commit().await.expect("commit");
    assert_eq!(committed(&brokers, &group, &topic, 1).await, vec![Some(5)]);
    source.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_message_holds_back_the_commit() {
    let mock = MockCluster::new(1).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    let topic = unique_name("orders", "abandon");
    mock.create_topic(&topic, 1, 1).expect("topic");
    let producer = KafkaProducer::connect(&brokers).await.expect("producer");
    for i in 0..3 {
        producer
            .publish(&topic, None, &format!("id-{i}"), b"x")
            .await
            .expect("publish");
    }
    let group = unique_name("g", "abandon");
    let mut source = source(&brokers, &group, &topic).await;
    let mut got = fetch(&mut source, 3).await.into_iter();
    let (a, b, c) = (
        got.next().expect("0"),
        got.next().expect("1"),
        got.next().expect("2"),
    );
    a.ack().await.expect("ack");
    b.abandon().await;
    c.ack().await.expect("ack");
    source.close().await.expect("close");
    assert_eq!(committed(&brokers, &group, &topic, 1).await, vec![Some(1)]);

    // The next member of the group starts at the abandoned message.
    let mut again = self::source(&brokers, &group, &topic).await;
    let got = fetch(&mut again, 2).await;
    assert_eq!(
        got.iter().map(KafkaDelivery::offset).collect::<Vec<_>>(),
        vec![1, 2]
    );
    again.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letter_keeps_key_payload_and_headers_and_adds_the_reason() {
    let mock = MockCluster::new(1).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    let topic = unique_name("orders", "dead_letter");
    let dlq = format!("{topic}.dead-letter");
    mock.create_topic(&topic, 1, 1).expect("topic");
    mock.create_topic(&dlq, 1, 1).expect("dead-letter topic");
    let producer = KafkaProducer::connect(&brokers).await.expect("producer");
    let payload: &[u8] = b"\x00not json\xff";
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "message-id",
            value: Some("m-1"),
        })
        .insert(Header {
            key: "traceparent",
            value: Some("00-abc-def-01"),
        });
    producer
        .client()
        .send(
            FutureRecord::to(&topic)
                .key(b"acct-7".as_slice())
                .payload(payload)
                .headers(headers),
            Duration::from_secs(5),
        )
        .await
        .expect("publish");

    let group = unique_name("g", "dead_letter");
    let mut source = source(&brokers, &group, &topic).await;
    let d = fetch(&mut source, 1).await.pop().expect("one delivery");
    let reason = DeadLetter::new(DeadLetterReason::Undecodable, "expected JSON\non one line")
        .with_context("billing", 1);
    d.dead_letter(&reason).await.expect("dead letter");
    source.commit().await.expect("commit");
    assert_eq!(
        committed(&brokers, &group, &topic, 1).await,
        vec![Some(1)],
        "dead-lettered counts as settled"
    );
    source.close().await.expect("close");

    let got = read_topic(&brokers, &dlq, 1, 1, WAIT).await;
    let [dead] = got.as_slice() else {
        panic!("expected one dead letter, got {got:?}")
    };
    assert_eq!(dead.payload.as_deref(), Some(payload));
    assert_eq!(dead.key.as_deref(), Some(b"acct-7".as_slice()));
    assert_eq!(dead.header("message-id").as_deref(), Some("m-1"));
    assert_eq!(dead.header("traceparent").as_deref(), Some("00-abc-def-01"));
    assert_eq!(
        dead.header("idem-dead-letter-reason").as_deref(),
        Some("undecodable")
    );
    assert_eq!(
        dead.header("idem-dead-letter-detail").as_deref(),
        Some("expected JSON on one line")
    );
    assert_eq!(dead.header("idem-consumer").as_deref(), Some("billing"));
    assert_eq!(dead.header("idem-attempts").as_deref(), Some("1"));
    assert_eq!(
        dead.header("idem-original-topic").as_deref(),
        Some(topic.as_str())
    );
    assert_eq!(dead.header("idem-original-partition").as_deref(), Some("0"));
    assert_eq!(dead.header("idem-original-offset").as_deref(), Some("0"));
}

#[test]
fn connect_refuses_bad_configuration_with_a_typed_error() {
    use idem_core::ErrorKind;
    // Outside a runtime: polled once by hand, it finishes without waiting on anything.
    let outside = KafkaSource::builder("t", "g")
        .connect("127.0.0.1:1")
        .now_or_never()
        .expect("connect does not wait");
    assert_eq!(
        outside.map(drop).map_err(|e| e.kind()),
        Err(ErrorKind::InvalidConfig),
        "no runtime"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let no_topic = KafkaSource::builder("", "g").connect("127.0.0.1:1").await;
        assert_eq!(
            no_topic.map(drop).map_err(|e| e.kind()),
            Err(ErrorKind::InvalidConfig)
        );
        let bad = KafkaSource::builder("t", "g")
            .set("no.such.property", "1")
            .connect("127.0.0.1:1")
            .await;
        assert_eq!(
            bad.map(drop).map_err(|e| e.kind()),
            Err(ErrorKind::InvalidConfig)
        );
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_brokers_surface_as_unavailable_from_next() {
    // Port 1 on localhost refuses connections.
    let mut source = KafkaSource::builder("t", "g")
        .connect("127.0.0.1:1")
        .await
        .expect("connecting does not wait for the brokers");
    let got = tokio::time::timeout(WAIT, source.next(1))
        .await
        .expect("an error within the timeout");
    assert_eq!(
        got.map(|d| d.len()).map_err(|e| e.kind()),
        Err(idem_core::ErrorKind::Unavailable)
    );
}
