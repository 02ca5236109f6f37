//! Helpers shared by the Kafka tests: an SQLite store with an effects table, a handler that
//! records one effect row per message, and read-back helpers for committed offsets and dead
//! letters.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idem_consumer::Handler;
use idem_core::{BoxError, Identified, Message, Migrate, Processor};
use idem_kafka::KafkaSourceBuilder;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use idem_kafka::rdkafka::message::{Headers, Message as _};
use idem_kafka::rdkafka::producer::DefaultProducerContext;
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idem_sql::{SqliteOptions, SqliteStore, Tx};
use idem_testkit::unique_name;

mod member;
pub use member::{Member, wait_until};

/// Short group timeouts so joins, leaves and takeovers happen within seconds.
/// `IDEM_TEST_KAFKA_DEBUG=cgrp,fetch` turns on librdkafka debug contexts (seen with
/// `RUST_LOG=librdkafka=debug`).
pub fn fast_group(builder: KafkaSourceBuilder) -> KafkaSourceBuilder {
    let builder = builder
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500")
        .commit_interval(Duration::from_millis(200));
    match std::env::var("IDEM_TEST_KAFKA_DEBUG") {
        Ok(contexts) if !contexts.is_empty() => builder.set_consumer("debug", contexts),
        _ => builder,
    }
}

/// An SQLite claim store plus an `effects` table in the same database file.
pub struct Db {
    pub store: SqliteStore,
    dir: PathBuf,
}

impl Db {
    pub async fn new(test: &str) -> Db {
        let dir = std::env::temp_dir().join(unique_name("idem_kafka", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("app.db"), SqliteOptions::default())
            .await
            .expect("open sqlite");
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL, payload BLOB NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Db { store, dir }
    }

    pub fn processor(&self, consumer: &str) -> Arc<Processor<SqliteStore>> {
        Arc::new(
            Processor::builder(self.store.clone(), consumer)
                .build()
                .expect("processor"),
        )
    }

    /// Effect rows per message ID.
    pub async fn effects(&self) -> HashMap<String, i64> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, count(*) FROM effects GROUP BY message_id")
                .fetch_all(self.store.pool())
                .await
                .expect("count effects");
        rows.into_iter().collect()
    }

    pub async fn close(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes one `effects` row per processed message, in the claim's transaction.
#[derive(Debug, Clone, Copy)]
pub struct RecordEffect;

impl Handler<Tx<sqlx::Sqlite>, Vec<u8>> for RecordEffect {
    type Output = ();

    async fn handle(
        &self,
        tx: &mut Tx<sqlx::Sqlite>,
        msg: &Message<Vec<u8>>,
    ) -> Result<(), BoxError> {
        let id = String::from_utf8_lossy(msg.message_id().as_bytes()).into_owned();
        sqlx::query("INSERT INTO effects (message_id, payload) VALUES (?, ?)")
            .bind(id)
            .bind(msg.payload().as_slice())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// The group's committed offset of each partition (`None` when nothing is committed).
pub async fn committed(
    brokers: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Vec<Option<i64>> {
    let (brokers, group, topic) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("offset checker");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let got = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .expect("committed offsets");
        (0..partitions)
            .map(
                |p| match got.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => Some(o),
                    _ => None,
                },
            )
            .collect()
    })
    .await
    .expect("checker task")
}

/// A record read back from a topic.
#[derive(Debug, Clone)]
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v.as_deref().unwrap_or(&[])).into_owned())
    }
}

/// Reads up to `n` records of `topic` from the beginning (all partitions), waiting at most
/// `timeout` in total. Uses manual assignment, so no group is involved.
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
    n: usize,
    timeout: Duration,
) -> Vec<Record> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique_name("reader", topic))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("offset");
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < n {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => out.push(Record {
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().map(<[u8]>::to_vec),
                headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            Ok(Err(e)) => eprintln!("reader error on {topic}: {e}"),
            Err(_) => break,
        }
    }
    out
}

/// A librdkafka mock cluster kept on its own thread (the handle is neither `Send` nor `Sync`),
/// so fixtures that must be `Send + Sync` can own one. Dropping it shuts the cluster down.
#[derive(Debug)]
pub struct MockBroker {
    brokers: String,
    commands: std::sync::mpsc::Sender<MockCommand>,
}

enum MockCommand {
    CreateTopic(String, i32, std::sync::mpsc::Sender<Result<(), String>>),
}

impl std::fmt::Debug for MockCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MockCommand")
    }
}

impl MockBroker {
    pub fn start() -> MockBroker {
        Self::start_with(|_| {})
    }

    /// A mock cluster that `setup` configures before anyone connects (API versions, errors).
    pub fn start_with(
        setup: impl FnOnce(&idem_kafka::rdkafka::mocking::MockCluster<'static, DefaultProducerContext>)
        + Send
        + 'static,
    ) -> MockBroker {
        let (tx, rx) = std::sync::mpsc::channel::<MockCommand>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mock = idem_kafka::rdkafka::mocking::MockCluster::new(1).expect("mock cluster");
            setup(&mock);
            ready_tx
                .send(mock.bootstrap_servers())
                .expect("report servers");
            // Ends when the last sender (the MockBroker) is dropped.
            for cmd in rx {
                match cmd {
                    MockCommand::CreateTopic(name, partitions, reply) => {
                        let _ = reply.send(
                            mock.create_topic(&name, partitions, 1)
                                .map_err(|e| e.to_string()),
                        );
                    }
                }
            }
        });
        let brokers = ready_rx.recv().expect("mock cluster started");
        MockBroker {
            brokers,
            commands: tx,
        }
    }

    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    pub fn create_topic(&self, name: &str, partitions: i32) {
        let (reply, done) = std::sync::mpsc::channel();
        self.commands
            .send(MockCommand::CreateTopic(name.to_owned(), partitions, reply))
            .expect("mock thread alive");
        done.recv().expect("mock reply").expect("create mock topic");
    }
}

/// Where a test's topics live: an in-process mock cluster, or the real brokers of
/// `IDEM_TEST_KAFKA_BROKERS` (topics created with the admin API).
///
/// Tests never delete their topics. On tansu 0.6.0's sqlite:// engine, deleting one topic
/// deletes every topic of the cluster (its `topic_delete_by.sql` matches on the cluster alone),
/// which pulled the topics from under the tests running alongside; a fetch for a vanished topic
/// then gets an answer that crashes librdkafka 2.12 (a leader-change hint with neither topic
/// name nor ID). The names are unique per test and process, and CI restarts the broker on a
/// fresh database each run, so leftovers cost nothing there.
#[derive(Debug)]
pub enum Cluster {
    Mock(MockBroker),
    Real(String),
}

impl Cluster {
    pub fn brokers(&self) -> &str {
        match self {
            Cluster::Mock(m) => m.brokers(),
            Cluster::Real(b) => b,
        }
    }

    pub async fn create_topics(&self, names: &[&str], partitions: i32) {
        match self {
            Cluster::Mock(m) => names.iter().for_each(|n| m.create_topic(n, partitions)),
            Cluster::Real(brokers) => idem_kafka::ensure_topics(brokers, names, partitions, 1)
                .await
                .expect("create topics"),
        }
    }
}

/// Logs to the test output when `RUST_LOG` is set (e.g. `RUST_LOG=idem_kafka=debug`).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
