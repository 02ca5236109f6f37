//! Kafka-specific: a consumer killed part-way through a record batch leaves the group's committed
//! offset *inside* that batch; the next member must resume there, so every record is processed
//! exactly once. Kafka serves a fetch from inside a batch with the whole batch (the client drops
//! the records below the offset); a broker that skips to the next batch instead (tansu 0.6.0's
//! `memory://` engine) loses the rest of it, and this test says so.
//! Runs on the mock cluster always, and on `IDEM_TEST_KAFKA_BROKERS` when set.

use crate::common;

use std::time::Duration;

use common::{Cluster, Db, MockBroker, RecordEffect, committed, fast_group};
use futures_util::future::join_all;
use idem_consumer::{CancellationToken, Consumer, Handler, Raw};
use idem_core::{BoxError, Message};
use idem_kafka::rdkafka::consumer::{Consumer as _, StreamConsumer};
use idem_kafka::rdkafka::message::Message as _;
use idem_kafka::rdkafka::producer::FutureProducer;
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idem_kafka::{KafkaProducer, KafkaSource};
use idem_sql::Tx;
use idem_testkit::unique_name;

/// Records per produce request, hence per stored record batch.
const BATCH: i64 = 10;
/// Two batches: the second is what a broker that skips ahead serves instead of the first's rest.
const TOTAL: i64 = 2 * BATCH;
/// The first member processes the records below this offset and hangs on this one.
const KILLED_AT: i64 = 4;
const WAIT: Duration = Duration::from_secs(60);

/// [`RecordEffect`] for the records below `KILLED_AT`; hangs on the others, so the member can be
/// killed with a record in flight.
#[derive(Debug, Clone, Copy)]
struct HangAtKill;

impl Handler<Tx<sqlx::Sqlite>, Vec<u8>> for HangAtKill {
    type Output = ();

    async fn handle(
        &self,
        tx: &mut Tx<sqlx::Sqlite>,
        msg: &Message<Vec<u8>>,
    ) -> Result<(), BoxError> {
        let n: i64 = std::str::from_utf8(msg.payload())?.parse()?;
        if n >= KILLED_AT {
            std::future::pending::<()>().await;
        }
        RecordEffect.handle(tx, msg).await
    }
}

/// Publishes record `n` (ID `m-<n>`, payload `<n>`) at offset `n`, `BATCH` per produce request.
async fn publish_in_batches(brokers: &str, topic: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        // Holds records back until the whole batch is queued: one request, one record batch.
        .set("linger.ms", "200")
        .create()
        .expect("producer");
    let producer = KafkaProducer::new(producer);
    for first in (0..TOTAL).step_by(BATCH as usize) {
        let sends = (first..first + BATCH).map(|n| {
            let producer = &producer;
            async move {
                let payload = n.to_string();
                producer
                    .publish(topic, None, &format!("m-{n}"), payload.as_bytes())
                    .await
                    .expect("publish")
                    .offset
            }
        });
        let offsets = join_all(sends).await;
        assert_eq!(offsets, (first..first + BATCH).collect::<Vec<_>>());
    }
}

/// The offset of the first record a plain reader assigned at `offset` receives: `offset` on a
/// broker that serves fetches from inside a batch as Kafka does.
async fn first_offset_read_from(brokers: &str, topic: &str, offset: i64) -> Option<i64> {
    let reader: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique_name("reader", topic))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(offset))
        .expect("offset");
    reader.assign(&tpl).expect("assign");
    match tokio::time::timeout(Duration::from_secs(10), reader.recv()).await {
        Ok(Ok(m)) => Some(m.offset()),
        _ => None,
    }
}

async fn committed_offset(cluster: &Cluster, group: &str, topic: &str) -> Option<i64> {
    committed(cluster.brokers(), group, topic, 1).await[0]
}

async fn killed_inside_a_batch_resumes_at_the_committed_offset(cluster: Cluster, test: &str) {
    common::init_logs();
    let topic = unique_name("idem", test);
    let group = format!("{topic}-group");
    cluster.create_topics(&[&topic], 1).await;
    let db = Db::new(test).await;
    publish_in_batches(cluster.brokers(), &topic).await;

    // One at a time: the member commits 0..KILLED_AT as the settled prefix when it fetches
    // KILLED_AT, then hangs on it.
    let source = fast_group(KafkaSource::builder(&topic, &group))
        .connect(cluster.brokers())
        .await
        .expect("source");
    let consumer = Consumer::new(db.processor("resume-test"), source);
    let first = consumer.observer();
    let run = tokio::spawn(consumer.run(Raw, HangAtKill, CancellationToken::new()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while committed_offset(&cluster, &group, &topic).await != Some(KILLED_AT) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first member never committed offset {KILLED_AT}: {:?}, {:?}",
            committed_offset(&cluster, &group, &topic).await,
            first.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Killed, not stopped: the hanging record's transaction never commits. Dropping the consumer
    // leaves the group; its revoke commits the settled prefix, which is still KILLED_AT.
    run.abort();
    assert!(run.await.is_err_and(|e| e.is_cancelled()));
    let first = first.snapshot();
    assert_eq!(first.processed, KILLED_AT as u64, "{first:?}");
    assert_eq!(
        committed_offset(&cluster, &group, &topic).await,
        Some(KILLED_AT),
        "the committed offset lies inside the first batch"
    );

    let source = fast_group(KafkaSource::builder(&topic, &group))
        .connect(cluster.brokers())
        .await
        .expect("source");
    let consumer = Consumer::new(db.processor("resume-test"), source).concurrency(4);
    let stop = CancellationToken::new();
    let run = tokio::spawn(consumer.run(Raw, RecordEffect, stop.clone()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while db.effects().await.len() < TOTAL as usize && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let stray redeliveries arrive: they must become duplicates, not rows.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let second = tokio::time::timeout(WAIT, run)
        .await
        .expect("stops in time")
        .expect("no panic")
        .expect("no fatal error");
    eprintln!("{test}: first {first:?}; second {second:?}");

    let effects = db.effects().await;
    let doubled: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "IDs with more than one effect: {doubled:?}"
    );
    let missing: Vec<_> = (0..TOTAL)
        .map(|n| format!("m-{n}"))
        .filter(|id| !effects.contains_key(id))
        .collect();
    if !missing.is_empty() {
        let served = first_offset_read_from(cluster.brokers(), &topic, KILLED_AT).await;
        panic!(
            "lost {missing:?} after resuming from offset {KILLED_AT}; a plain reader assigned at \
             offset {KILLED_AT} first gets offset {served:?}. If that is not {KILLED_AT}, the \
             broker skips the rest of a batch when fetching from inside it (tansu's memory:// \
             engine does; run the tests on its sqlite:// engine)."
        );
    }
    assert_eq!(
        first.processed + second.processed,
        TOTAL as u64,
        "{second:?}"
    );
    // Only records the first member processed may come back, as duplicates.
    assert!(second.duplicates <= first.processed, "{second:?}");
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resume_inside_a_batch_on_mock_cluster() {
    killed_inside_a_batch_resumes_at_the_committed_offset(
        Cluster::Mock(MockBroker::start()),
        "resume_mock",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resume_inside_a_batch_on_real_brokers() {
    let Some(brokers) = idem_testkit::service_url(
        idem_testkit::services::KAFKA,
        "resume_inside_a_batch_on_real_brokers",
    ) else {
        return;
    };
    killed_inside_a_batch_resumes_at_the_committed_offset(Cluster::Real(brokers), "resume_real")
        .await;
}
