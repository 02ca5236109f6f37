//! The broker side of a run, seen from outside the consumers: create the topology the way an
//! operator would (partitions, replicas), publish the messages, and read back what is still
//! unconsumed and what was dead-lettered. Written against the brokers' own clients and idem's
//! producers, not against the payments service, so the checker does not trust what it checks.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use idem_kafka::rdkafka;
use idem_nats::async_nats;
use rdkafka::consumer::{BaseConsumer, Consumer};

/// Publishes in flight at once.
const PUBLISH_CONCURRENCY: usize = 32;

/// One of the brokers the harness can drive (MQTT has no consumer groups with a backlog a
/// checker can read, and Mosquitto caps what it keeps for a disconnected session).
#[derive(Clone)]
pub(crate) enum Broker {
    Nats(String),
    Amqp(String),
    /// `host:port[,…]`
    Kafka(String),
    Redis(String),
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// What the consumers' group is called on the broker, and what they consume.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) source: String,
    pub(crate) consumer: String,
}

impl Broker {
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let (scheme, rest) = url.split_once("://").unwrap_or((url, ""));
        Ok(match scheme.to_ascii_lowercase().as_str() {
            "nats" => Broker::Nats(url.to_owned()),
            "amqp" | "amqps" => Broker::Amqp(url.to_owned()),
            "kafka" if !rest.trim_end_matches('/').is_empty() => {
                Broker::Kafka(rest.trim_end_matches('/').to_owned())
            }
            "redis" | "rediss" => Broker::Redis(url.to_owned()),
            _ => bail!(
                "unsupported --broker {:?}: expected nats://, amqp://, kafka://host:port or redis://",
                idem_core::redact_url(url)
            ),
        })
    }

    /// The URL as the payments service takes it.
    pub(crate) fn url(&self) -> String {
        match self {
            Broker::Kafka(hosts) => format!("kafka://{hosts}"),
            Broker::Nats(u) | Broker::Amqp(u) | Broker::Redis(u) => u.clone(),
        }
    }

    pub(crate) fn redacted(&self) -> String {
        idem_core::redact_url(&self.url())
    }

    /// Creates the stream, queue or topic before any consumer does, with the shape the run
    /// needs: `partitions` Kafka partitions (so every consumer of the group gets some), and
    /// `replicas` JetStream replicas (3 on the harness's own cluster). The service's own
    /// `ensure_*` then finds them in place.
    pub(crate) async fn prepare(
        &self,
        names: &Names,
        partitions: i32,
        replicas: usize,
    ) -> Result<()> {
        let source = names.source.as_str();
        match self {
            Broker::Nats(url) => {
                let js = nats(url).await?;
                for (name, subject) in [
                    (source.to_owned(), source.to_owned()),
                    (
                        format!("{source}-dead-letter"),
                        format!("{source}.dead-letter"),
                    ),
                ] {
                    let config = async_nats::jetstream::stream::Config {
                        name: name.clone(),
                        subjects: vec![subject],
                        num_replicas: replicas,
                        // JetStream drops a re-published Nats-Msg-Id inside this window, before
                        // any consumer sees it; the run's duplicates are meant for idem (100 ms is
                        // the least JetStream accepts).
                        duplicate_window: Duration::from_millis(100),
                        ..Default::default()
                    };
                    js.create_stream(config)
                        .await
                        .with_context(|| format!("creating JetStream stream {name}"))?;
                }
            }
            Broker::Amqp(url) => {
                let producer = idem_amqp::AmqpProducer::connect(url).await?;
                idem_amqp::ensure_queue(producer.channel(), source).await?;
                producer.close().await?;
            }
            Broker::Kafka(hosts) => {
                use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
                use rdkafka::client::DefaultClientContext;
                let admin: AdminClient<DefaultClientContext> =
                    kafka_config(hosts).create().context("Kafka admin client")?;
                let dead = format!("{source}.dead-letter");
                let topics = [
                    NewTopic::new(source, partitions, TopicReplication::Fixed(1)),
                    NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
                ];
                let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
                for r in admin
                    .create_topics(&topics, &opts)
                    .await
                    .context("creating Kafka topics")?
                {
                    if let Err((topic, code)) = r {
                        bail!("creating Kafka topic {topic}: {code}");
                    }
                }
            }
            Broker::Redis(_) => {} // The service creates the group from the stream's start.
        }
        Ok(())
    }

    /// A connection publishing to the run's source.
    pub(crate) async fn publisher(&self, names: &Names) -> Result<Publisher> {
        let source = names.source.clone();
        Ok(match self {
            Broker::Nats(url) => {
                Publisher::Nats(idem_nats::NatsProducer::new(nats(url).await?), source)
            }
            Broker::Amqp(url) => {
                Publisher::Amqp(idem_amqp::AmqpProducer::connect(url).await?, source)
            }
            Broker::Kafka(hosts) => {
                Publisher::Kafka(idem_kafka::KafkaProducer::connect(hosts).await?, source)
            }
            Broker::Redis(url) => Publisher::Redis(
                idem_redis_streams::RedisStreamProducer::connect(url).await?,
                source,
            ),
        })
    }

    /// Messages published and not yet acknowledged by the group (NATS pending + ack pending,
    /// RabbitMQ ready + unacknowledged, Kafka lag behind the committed offsets, Redis Streams
    /// lag + pending). `None` while the group does not exist yet.
    pub(crate) async fn backlog(&self, names: &Names) -> Result<Option<u64>> {
        let source = names.source.as_str();
        match self {
            Broker::Nats(url) => {
                let js = nats(url).await?;
                let stream = js.get_stream(source).await.context("JetStream stream")?;
                let Ok(mut consumer) = stream
                    .get_consumer::<async_nats::jetstream::consumer::pull::Config>(&names.consumer)
                    .await
                else {
                    return Ok(None);
                };
                let info = consumer.info().await.context("JetStream consumer info")?;
                Ok(Some(info.num_pending + info.num_ack_pending as u64))
            }
            Broker::Amqp(url) => {
                // Unacknowledged messages are not counted by a passive declare; they return to
                // ready when their consumer's connection closes, so read this with the
                // consumers stopped.
                let producer = idem_amqp::AmqpProducer::connect(url).await?;
                let q = producer
                    .channel()
                    .queue_declare(source.into(), lapin_passive(), Default::default())
                    .await
                    .context("queue.declare passive")?;
                let n = q.message_count();
                producer.close().await?;
                Ok(Some(u64::from(n)))
            }
            Broker::Kafka(hosts) => kafka_lag(hosts, &names.consumer, source).await,
            Broker::Redis(url) => {
                let mut conn = redis_conn(url).await?;
                let groups: redis::Value = redis::cmd("XINFO")
                    .arg("GROUPS")
                    .arg(source)
                    .query_async(&mut conn)
                    .await
                    .context("XINFO GROUPS")?;
                Ok(redis_group_backlog(&groups, &names.consumer))
            }
        }
    }

    /// Messages in the dead-letter destination.
    pub(crate) async fn dead_letters(&self, names: &Names) -> Result<u64> {
        let source = names.source.as_str();
        match self {
            Broker::Nats(url) => {
                let js = nats(url).await?;
                let mut stream = js
                    .get_stream(format!("{source}-dead-letter"))
                    .await
                    .context("dead-letter stream")?;
                Ok(stream.info().await.context("stream info")?.state.messages)
            }
            Broker::Amqp(url) => {
                let producer = idem_amqp::AmqpProducer::connect(url).await?;
                let topology = idem_amqp::Topology::new(source);
                let q = producer
                    .channel()
                    .queue_declare(
                        topology.dead_letter_queue_name().into(),
                        lapin_passive(),
                        Default::default(),
                    )
                    .await
                    .context("queue.declare passive (dead letters)")?;
                let n = q.message_count();
                producer.close().await?;
                Ok(u64::from(n))
            }
            Broker::Kafka(hosts) => {
                let consumer: BaseConsumer = kafka_config(hosts).create()?;
                let topic = format!("{source}.dead-letter");
                let (low, high) = tokio::task::spawn_blocking(move || {
                    consumer.fetch_watermarks(&topic, 0, Duration::from_secs(10))
                })
                .await?
                .context("dead-letter topic watermarks")?;
                Ok((high - low).max(0) as u64)
            }
            Broker::Redis(url) => {
                let mut conn = redis_conn(url).await?;
                let n: u64 = redis::cmd("XLEN")
                    .arg(format!("{source}:dead-letter"))
                    .query_async(&mut conn)
                    .await
                    .context("XLEN")?;
                Ok(n)
            }
        }
    }

    /// Deletes what the run created on the broker.
    pub(crate) async fn teardown(&self, names: &Names) -> Result<()> {
        let source = names.source.as_str();
        match self {
            Broker::Nats(url) => {
                let js = nats(url).await?;
                for s in [source.to_owned(), format!("{source}-dead-letter")] {
                    let _ = js.delete_stream(&s).await;
                }
            }
            Broker::Amqp(url) => {
                let producer = idem_amqp::AmqpProducer::connect(url).await?;
                idem_amqp::Topology::new(source)
                    .delete(producer.channel())
                    .await?;
                producer.close().await?;
            }
            Broker::Kafka(_) => {
                // tansu's sqlite engine deletes every topic on a DeleteTopics call; the topics
                // carry the run's unique name and stay.
            }
            Broker::Redis(url) => {
                let mut conn = redis_conn(url).await?;
                let _: i64 = redis::cmd("DEL")
                    .arg(source)
                    .arg(format!("{source}:dead-letter"))
                    .query_async(&mut conn)
                    .await?;
            }
        }
        Ok(())
    }
}

/// A connection that publishes the run's messages.
pub(crate) enum Publisher {
    Nats(idem_nats::NatsProducer, String),
    Amqp(idem_amqp::AmqpProducer, String),
    Kafka(idem_kafka::KafkaProducer, String),
    Redis(idem_redis_streams::RedisStreamProducer, String),
}

impl Publisher {
    /// Publishes every message, `PUBLISH_CONCURRENCY` at a time, each confirmed. Returns how
    /// many the broker dropped as repeats of an ID it had just stored.
    pub(crate) async fn publish_all(&self, msgs: &[(String, Vec<u8>)]) -> Result<u64> {
        // Groups joined in turn rather than a buffered stream: a stream combinator's closure
        // here makes the future not provably `Send` for `tokio::spawn`.
        let mut dropped = 0;
        for group in msgs.chunks(PUBLISH_CONCURRENCY) {
            let mut pending = Vec::with_capacity(group.len());
            for (id, payload) in group {
                pending.push(self.publish(id, payload));
            }
            for r in futures_util::future::join_all(pending).await {
                dropped += u64::from(r?);
            }
        }
        Ok(dropped)
    }

    async fn publish(&self, id: &str, payload: &[u8]) -> Result<bool> {
        match self {
            Publisher::Nats(p, subject) => {
                let ack = p.publish(subject.clone(), id, payload.to_vec()).await?;
                Ok(ack.duplicate)
            }
            Publisher::Amqp(p, queue) => {
                p.publish("", queue, id, payload).await?;
                Ok(false)
            }
            Publisher::Kafka(p, topic) => {
                // Keyed by ID: a repeat lands on the same partition, as a producer retry does.
                p.publish(topic, Some(id.as_bytes()), id, payload).await?;
                Ok(false)
            }
            Publisher::Redis(p, stream) => {
                p.publish(stream, id, payload).await?;
                Ok(false)
            }
        }
    }
}

pub(crate) async fn nats(url: &str) -> Result<async_nats::jetstream::Context> {
    // The cluster's URL lists every node; async-nats takes them as a list.
    let servers = url
        .split(',')
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("NATS URL {}", idem_core::redact_url(url)))?;
    let client = async_nats::connect(servers)
        .await
        .with_context(|| format!("connecting to NATS at {}", idem_core::redact_url(url)))?;
    Ok(async_nats::jetstream::new(client))
}

async fn redis_conn(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url)?;
    Ok(client.get_multiplexed_async_connection().await?)
}

fn kafka_config(hosts: &str) -> rdkafka::ClientConfig {
    let mut c = rdkafka::ClientConfig::new();
    c.set("bootstrap.servers", hosts);
    c
}

fn lapin_passive() -> idem_amqp::lapin::options::QueueDeclareOptions {
    idem_amqp::lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

/// The group's lag: for each partition, the high watermark minus the group's committed offset
/// (the low watermark where it has committed none).
async fn kafka_lag(hosts: &str, group: &str, topic: &str) -> Result<Option<u64>> {
    let consumer: BaseConsumer = kafka_config(hosts)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || -> Result<Option<u64>> {
        let timeout = Duration::from_secs(10);
        let meta = consumer
            .fetch_metadata(Some(&topic), timeout)
            .context("topic metadata")?;
        let Some(t) = meta.topics().first() else {
            return Ok(None);
        };
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in t.partitions() {
            tpl.add_partition(&topic, p.id());
        }
        let committed = consumer
            .committed_offsets(tpl, timeout)
            .context("committed offsets")?;
        let mut lag = 0u64;
        for e in committed.elements() {
            let (low, high) = consumer
                .fetch_watermarks(&topic, e.partition(), timeout)
                .context("watermarks")?;
            let at = match e.offset() {
                rdkafka::Offset::Offset(o) => o,
                _ => low,
            };
            lag += (high - at).max(0) as u64;
        }
        Ok(Some(lag))
    })
    .await?
}

/// `lag + pending` of `group` in an `XINFO GROUPS` reply (Redis 7: a list of field/value maps).
fn redis_group_backlog(reply: &redis::Value, group: &str) -> Option<u64> {
    let redis::Value::Array(groups) = reply else {
        return None;
    };
    for g in groups {
        let fields: Vec<&redis::Value> = match g {
            redis::Value::Array(v) => v.iter().collect(),
            redis::Value::Map(m) => m.iter().flat_map(|(k, v)| [k, v]).collect(),
            _ => continue,
        };
        let get = |name: &str| {
            fields.chunks(2).find_map(|kv| match kv {
                [redis::Value::BulkString(k), v] if k.as_slice() == name.as_bytes() => Some(*v),
                [redis::Value::SimpleString(k), v] if k == name => Some(*v),
                _ => None,
            })
        };
        let is_group = match get("name") {
            Some(redis::Value::BulkString(n)) => n.as_slice() == group.as_bytes(),
            Some(redis::Value::SimpleString(n)) => n == group,
            _ => false,
        };
        if !is_group {
            continue;
        }
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(n)) => Some((*n).max(0) as u64),
            _ => None,
        };
        // A nil lag means Redis cannot tell (entries deleted); count it as not drained.
        let lag = int(get("lag")).unwrap_or(u64::MAX / 2);
        return Some(lag + int(get("pending")).unwrap_or(0));
    }
    None
}

impl Broker {
    /// Kafka only: how many partitions the run's topic has.
    pub(crate) async fn partitions(&self, names: &Names) -> Result<Option<usize>> {
        let Broker::Kafka(hosts) = self else {
            return Ok(None);
        };
        let consumer: BaseConsumer = kafka_config(hosts).create()?;
        let topic = names.source.clone();
        tokio::task::spawn_blocking(move || -> Result<Option<usize>> {
            let meta = consumer
                .fetch_metadata(Some(&topic), Duration::from_secs(10))
                .context("topic metadata")?;
            Ok(meta.topics().first().map(|t| t.partitions().len()))
        })
        .await?
    }

    /// Kafka only: makes the group rebalance, by a member that joins and leaves at once.
    pub(crate) async fn nudge_group(&self, names: &Names) -> Result<()> {
        let Broker::Kafka(hosts) = self else {
            return Ok(());
        };
        let consumer: BaseConsumer = kafka_config(hosts)
            .set("group.id", &names.consumer)
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "6000")
            .create()?;
        let topic = names.source.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            consumer.subscribe(&[&topic])?;
            // Joining is what triggers the rebalance; polling drives the join.
            let until = std::time::Instant::now() + Duration::from_secs(15);
            while std::time::Instant::now() < until
                && consumer.assignment().map(|a| a.count()).unwrap_or(0) == 0
            {
                let _ = consumer.poll(Duration::from_millis(200));
            }
            consumer.unsubscribe();
            Ok(())
        })
        .await?
    }
}
