//! Kafka-specific: a member joining and leaving the consumer group while messages flow causes
//! rebalances (partitions revoked with messages in flight, redelivered to the new owner). The
//! effects table must still hold exactly one row per message ID, none missing.
//! Runs on the mock cluster always, and on `IDEM_TEST_KAFKA_BROKERS` when set.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Cluster, Db, Member, MockBroker, fast_group, wait_until};
use idem_consumer::CancellationToken;
use idem_kafka::{KafkaProducer, KafkaSource};
use idem_testkit::unique_name;

async fn member_joining_and_leaving_never_doubles_an_effect(cluster: Cluster, test: &str) {
    common::init_logs();
    let topic = unique_name("idem", test);
    let group = format!("{topic}-group");
    cluster.create_topics(&[&topic], 4).await;
    let db = Db::new(test).await;

    let first = Member::start(
        &db,
        "group-test",
        cluster.brokers(),
        fast_group(KafkaSource::builder(&topic, &group)),
    )
    .await;
    // Publish steadily until told to stop, with keys so every partition gets traffic.
    let published = Arc::new(AtomicUsize::new(0));
    let stop_publishing = CancellationToken::new();
    let publisher = {
        let (topic, published, stop) = (topic.clone(), published.clone(), stop_publishing.clone());
        let producer = KafkaProducer::connect(cluster.brokers())
            .await
            .expect("producer");
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let i = published.load(Ordering::SeqCst);
                let key = format!("account-{}", i % 17);
                producer
                    .publish(
                        &topic,
                        Some(key.as_bytes()),
                        &format!("msg-{i}"),
                        format!("{i}").as_bytes(),
                    )
                    .await
                    .expect("publish");
                published.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    tokio::time::sleep(Duration::from_millis(800)).await;
    let second = Member::start(
        &db,
        "group-test",
        cluster.brokers(),
        fast_group(KafkaSource::builder(&topic, &group)),
    )
    .await;
    // Joining takes a rebalance (tansu holds a follower's JoinGroup for 3 s); let the second
    // member work a while once it has partitions, then leave while messages still flow.
    let took_part = wait_until(Duration::from_secs(45), async || second.settled() >= 30).await;
    let second_stats = second.stop().await;
    assert!(
        took_part,
        "the second member got partitions and processed: {second_stats:?}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop_publishing.cancel();
    publisher.await.expect("publisher");
    let total = published.load(Ordering::SeqCst);

    let all = wait_until(Duration::from_secs(60), async || {
        db.effects().await.len() >= total
    })
    .await;
    // Let stray redeliveries arrive: they must become duplicates, not rows.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let first_stats = first.stop().await;
    eprintln!("{test}: {total} published; first {first_stats:?}; second {second_stats:?}");

    let effects = db.effects().await;
    let doubled: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "IDs with more than one effect: {doubled:?}"
    );
    let missing: Vec<_> = (0..total)
        .map(|i| format!("msg-{i}"))
        .filter(|id| !effects.contains_key(id))
        .collect();
    assert!(all && missing.is_empty(), "lost: {missing:?}");
    assert_eq!(first_stats.processed + second_stats.processed, total as u64);
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_rebalance_on_mock_cluster() {
    member_joining_and_leaving_never_doubles_an_effect(
        Cluster::Mock(MockBroker::start()),
        "rebalance_mock",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_rebalance_on_real_brokers() {
    let Some(brokers) = idem_testkit::service_url(
        idem_testkit::services::KAFKA,
        "group_rebalance_on_real_brokers",
    ) else {
        return;
    };
    member_joining_and_leaving_never_doubles_an_effect(Cluster::Real(brokers), "rebalance_real")
        .await;
}
