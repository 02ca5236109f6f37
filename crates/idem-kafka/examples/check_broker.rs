//! Checks that a Kafka-protocol broker serves a fetch from inside a record batch as Kafka does,
//! so that idem's Kafka tests can trust it (`.ci/run` runs this against tansu before them).
//!
//! Kafka answers a fetch at offset N with the batch that contains N, and the client drops the
//! records below N. tansu 0.6.0's `memory://` storage engine answers with the *next* batch, so a
//! consumer whose committed offset lies inside a batch never sees the rest of it, and tests on
//! such a broker lose messages that the adapter handled correctly.
//!
//! Two batches of ten records are produced (one produce request each: `linger.ms` holds the
//! records back until all ten are queued), then read from offsets 0, 5 and 15 by manual
//! assignment, and from a group whose committed offset is 5.
//!
//! ```sh
//! cargo run -p idem-kafka --example check_broker -- 127.0.0.1:9092
//! ```
//!
//! Exits 0 when the broker behaves as Kafka does, 1 when it skips records, 2 when the check could
//! not run (broker unreachable, topic not created).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idem_kafka::KafkaProducer;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use idem_kafka::rdkafka::message::Message;
use idem_kafka::rdkafka::producer::FutureProducer;
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};

const BATCHES: i64 = 2;
const PER_BATCH: i64 = 10;
/// How many records each read collects: enough to show where it started.
const READ: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(15);

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let brokers = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9092".to_owned());
    match check(&brokers).await {
        Ok(true) => {
            println!("check_broker: {brokers} serves mid-batch fetches as Kafka does");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            eprintln!(
                "check_broker: BROKER SKIPS RECORDS: {brokers} answers a fetch from inside a \
                 record batch with a later batch. Kafka returns the batch containing the offset; \
                 tests on this broker would lose messages. (tansu: use --storage-engine \
                 sqlite://…, built with --features libsql; see scripts/install-tansu)"
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("check_broker: could not check {brokers}: {e}");
            ExitCode::from(2)
        }
    }
}

async fn check(brokers: &str) -> Result<bool, String> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let topic = format!("idem_check_broker_{}_{stamp}", std::process::id());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| format!("admin client: {e}"))?;
    let opts = AdminOptions::new().operation_timeout(Some(TIMEOUT));
    let created = tokio::time::timeout(
        TIMEOUT,
        admin.create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &opts,
        ),
    )
    .await
    .map_err(|_| format!("creating topic {topic}: timed out"))?
    .map_err(|e| format!("creating topic {topic}: {e}"))?;
    for r in created {
        r.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
    }

    // The topic is left behind: tansu 0.6.0's sqlite:// engine deletes every topic of the
    // cluster when asked to delete one.
    produce_and_read(brokers, &topic).await
}

async fn produce_and_read(brokers: &str, topic: &str) -> Result<bool, String> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "200")
        .create()
        .map_err(|e| format!("producer: {e}"))?;
    let producer = KafkaProducer::new(producer);
    for batch in 0..BATCHES {
        // All sends are queued before the first delivery report, within one linger window.
        let sends = (0..PER_BATCH).map(|i| {
            let id = format!("b{batch}-r{i}");
            let producer = &producer;
            async move { producer.publish(topic, None, &id, id.as_bytes()).await }
        });
        let mut offsets = Vec::new();
        for sent in join_all(sends).await {
            offsets.push(sent.map_err(|e| format!("producing: {e}"))?.offset);
        }
        let first = batch * PER_BATCH;
        if offsets != (first..first + PER_BATCH).collect::<Vec<_>>() {
            return Err(format!("batch {batch} landed at offsets {offsets:?}"));
        }
    }

    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || read_back(&brokers, &topic))
        .await
        .map_err(|e| format!("reader task: {e}"))?
}

fn read_back(brokers: &str, topic: &str) -> Result<bool, String> {
    let mut ok = true;
    for start in [0, 5, 15] {
        let consumer = consumer(brokers, &format!("{topic}-assign-{start}"))?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, Offset::Offset(start))
            .map_err(|e| e.to_string())?;
        consumer.assign(&tpl).map_err(|e| format!("assign: {e}"))?;
        let got = first_offsets(&consumer);
        println!("assign at {start:>2}          -> {got:?}");
        ok &= got == (start..start + READ as i64).collect::<Vec<_>>();
    }

    // A new member of a group resumes from the group's committed offset: what idem relies on
    // after a restart or rebalance.
    let group = format!("{topic}-group");
    let mut at5 = TopicPartitionList::new();
    at5.add_partition_offset(topic, 0, Offset::Offset(5))
        .map_err(|e| e.to_string())?;
    consumer(brokers, &group)?
        .commit(&at5, CommitMode::Sync)
        .map_err(|e| format!("committing offset 5: {e}"))?;
    let member = consumer(brokers, &group)?;
    member
        .subscribe(&[topic])
        .map_err(|e| format!("subscribe: {e}"))?;
    let got = first_offsets(&member);
    println!("group member (committed 5) -> {got:?}");
    ok &= got == vec![5, 6, 7];
    if !ok {
        println!("expected [0, 1, 2], [5, 6, 7], [15, 16, 17] and [5, 6, 7]");
    }
    Ok(ok)
}

fn consumer(brokers: &str, group: &str) -> Result<BaseConsumer, String> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|e| format!("consumer: {e}"))
}

/// The offsets of the first few records the consumer receives (fewer after the timeout).
fn first_offsets(consumer: &BaseConsumer) -> Vec<i64> {
    let deadline = Instant::now() + TIMEOUT;
    let mut got = Vec::new();
    while got.len() < READ && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            got.push(m.offset());
        }
    }
    got
}
