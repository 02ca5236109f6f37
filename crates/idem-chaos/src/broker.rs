//! The broker side of a run, seen from outside the consumers: create the topology the way an
//! operator would (partitions, replicas), publish the messages, and read back what is still
//! unconsumed and what was dead-lettered. Written against the brokers' own clients and idem's
//! producers, not against the payments service, so the checker does not trust what it checks.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use idem_any::{AnyProducer, Broker as Kind, BrokerUrl, SourceSpec, dead_letters};
use idem_kafka::rdkafka;
use idem_nats::async_nats;
use rdkafka::consumer::{BaseConsumer, Consumer};

/// Publishes in flight at once.
const PUBLISH_CONCURRENCY: usize = 32;

/// One of the brokers the harness can drive, as idem-any parses it. What the checker asks the
/// broker (backlog, dead letters, partitions) goes through the brokers' own clients, not
/// through idem. MQTT has no consumer group with a backlog to read: the run has a Mosquitto of
/// its own ([`crate::mosquitto`]), whose `$SYS` store count is the backlog of the whole run.
#[derive(Debug, Clone)]
pub(crate) struct Broker(BrokerUrl);

/// What the consumers' group is called on the broker, and what they consume.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) source: String,
    pub(crate) consumer: String,
}

impl Names {
    fn spec(&self) -> SourceSpec {
        SourceSpec::new(
            self.source.as_str(),
            self.consumer.as_str(),
            self.consumer.as_str(),
        )
    }
}

impl Broker {
    pub(crate) fn parse(url: &str) -> Result<Self> {
        Ok(Self(BrokerUrl::parse(url)?))
    }

    pub(crate) fn kind(&self) -> Kind {
        self.0.broker()
    }

    /// What the broker's own clients connect to (Kafka: the `host:port` list).
    pub(crate) fn address(&self) -> &str {
        self.0.address()
    }

    /// The URL as the payments service takes it.
    pub(crate) fn url(&self) -> String {
        self.0.as_str().to_owned()
    }

    pub(crate) fn redacted(&self) -> String {
        self.0.redacted()
    }

    /// Creates the stream, queue or topic before any consumer does, with the shape the run
    /// needs: `partitions` Kafka partitions (so every consumer of the group gets some), and
    /// `replicas` JetStream replicas (3 on the harness's own cluster). The service's own
    /// `ensure_*` then finds them in place. MQTT: the persistent sessions of the consumers
    /// named `instances` (client IDs, as `payments --instance`), subscribed to the group's
    /// shared subscription, so that what is published before a consumer first connects queues
    /// in its session instead of being dropped; the dead-letter keeper's session; and the
    /// harness's own session on the dead letters, which [`dead_letters`](Self::dead_letters)
    /// reads.
    pub(crate) async fn prepare(
        &self,
        names: &Names,
        partitions: i32,
        replicas: usize,
        instances: &[String],
    ) -> Result<()> {
        let source = names.source.as_str();
        let url = self.address();
        match self.kind() {
            Kind::Nats => {
                let js = nats(url).await?;
                for (name, subject) in [
                    (source.to_owned(), source.to_owned()),
                    (
                        idem_any::nats_dead_letter_stream(source),
                        dead_letters(Kind::Nats, source),
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
            Kind::Amqp => {
                let producer = idem_amqp::AmqpProducer::connect(url).await?;
                idem_amqp::ensure_queue(producer.channel(), source).await?;
                producer.close().await?;
            }
            Kind::Kafka => {
                use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
                use rdkafka::client::DefaultClientContext;
                let admin: AdminClient<DefaultClientContext> =
                    kafka_config(url).create().context("Kafka admin client")?;
                let dead = dead_letters(Kind::Kafka, source);
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
            Kind::RedisStreams => {} // The service creates the group from the stream's start.
            Kind::Mqtt => {
                let dead = dead_letters(Kind::Mqtt, source);
                let shared = mqtt_shared_filter(names);
                for instance in instances {
                    idem_mqtt::ensure_session(url, instance, &shared).await?;
                }
                let keeper = idem_any::mqtt_dead_letter_keeper(&names.consumer);
                idem_mqtt::ensure_session(url, &keeper, &dead).await?;
                idem_mqtt::ensure_session(url, &mqtt_dead_letter_watcher(names), &dead).await?;
            }
            other => bail!("idem-chaos does not drive {}", other.name()),
        }
        Ok(())
    }

    /// A connection publishing to the run's source.
    pub(crate) async fn publisher(&self, names: &Names) -> Result<Publisher> {
        Ok(Publisher {
            producer: AnyProducer::connect(&self.0, "idem-chaos-publisher").await?,
            destination: names.source.clone(),
        })
    }

    /// Messages published and not yet acknowledged by the group (NATS pending + ack pending,
    /// RabbitMQ ready + unacknowledged, Kafka lag behind the committed offsets, Redis Streams
    /// lag + pending). `None` while the group does not exist yet.
    pub(crate) async fn backlog(&self, names: &Names) -> Result<Option<u64>> {
        let source = names.source.as_str();
        let url = self.address();
        match self.kind() {
            Kind::Nats => {
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
            Kind::Amqp => {
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
            Kind::Kafka => kafka_lag(url, &names.consumer, source).await,
            Kind::Mqtt => {
                // The broker-wide count: for the run, not this hop (see `backlog_of`).
                let stored = mqtt_stored(url).await?;
                Ok(Some(stored.saturating_sub(self.dead_letters(names).await?)))
            }
            Kind::RedisStreams => {
                let mut conn = redis_conn(url).await?;
                let groups: redis::Value = redis::cmd("XINFO")
                    .arg("GROUPS")
                    .arg(source)
                    .query_async(&mut conn)
                    .await
                    .context("XINFO GROUPS")?;
                Ok(redis_group_backlog(&groups, &names.consumer))
            }
            other => bail!("idem-chaos does not drive {}", other.name()),
        }
    }

    /// The backlog of every hop in `hops`, together: the sum of each one's, except on MQTT,
    /// where the count is the run's private broker's and is taken once (less the dead letters
    /// of every hop). `None` while a hop's group does not exist yet.
    pub(crate) async fn backlog_of(&self, hops: &[&Names]) -> Result<Option<u64>> {
        if self.kind() == Kind::Mqtt {
            let mut left = mqtt_stored(self.address()).await?;
            // Reading the dead letters takes a connection and a quiet wait: only when
            // something is left at all.
            for names in hops {
                if left == 0 {
                    break;
                }
                left = left.saturating_sub(self.dead_letters(names).await?);
            }
            return Ok(Some(left));
        }
        let mut total = Some(0);
        for names in hops {
            let one = self.backlog(names).await?;
            total = total.zip(one).map(|(a, b)| a + b);
        }
        Ok(total)
    }

    /// Messages in the dead-letter destination (MQTT: queued in the harness's own session on
    /// the dead-letter topic, counted up to its 64 in flight).
    pub(crate) async fn dead_letters(&self, names: &Names) -> Result<u64> {
        let source = names.source.as_str();
        let url = self.address();
        match self.kind() {
            Kind::Nats => {
                let js = nats(url).await?;
                let mut stream = js
                    .get_stream(idem_any::nats_dead_letter_stream(source))
                    .await
                    .context("dead-letter stream")?;
                Ok(stream.info().await.context("stream info")?.state.messages)
            }
            Kind::Amqp => {
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
            Kind::Kafka => {
                let consumer: BaseConsumer = kafka_config(url).create()?;
                let topic = dead_letters(Kind::Kafka, source);
                let (low, high) = tokio::task::spawn_blocking(move || {
                    consumer.fetch_watermarks(&topic, 0, Duration::from_secs(10))
                })
                .await?
                .context("dead-letter topic watermarks")?;
                Ok((high - low).max(0) as u64)
            }
            Kind::RedisStreams => {
                let mut conn = redis_conn(url).await?;
                let n: u64 = redis::cmd("XLEN")
                    .arg(dead_letters(Kind::RedisStreams, source))
                    .query_async(&mut conn)
                    .await
                    .context("XLEN")?;
                Ok(n)
            }
            Kind::Mqtt => mqtt_dead_letters(url, names).await,
            other => bail!("idem-chaos does not drive {}", other.name()),
        }
    }

    /// Deletes what the run created on the broker.
    pub(crate) async fn teardown(&self, names: &Names) -> Result<()> {
        if self.kind() == Kind::Kafka {
            // tansu's sqlite engine deletes every topic on a DeleteTopics call; the topics
            // carry the run's unique name and stay.
            return Ok(());
        }
        if self.kind() == Kind::Mqtt {
            // The run's own broker, stopped with the run: its sessions go with it.
            return Ok(());
        }
        Ok(self.0.teardown(&names.spec()).await?)
    }
}

/// A connection that publishes the run's messages.
pub(crate) struct Publisher {
    producer: AnyProducer,
    destination: String,
}

impl Publisher {
    /// Publishes every message, `PUBLISH_CONCURRENCY` at a time, each confirmed. Returns how
    /// many the broker dropped as repeats of an ID it had just stored.
    pub(crate) async fn publish_all(&self, msgs: &[(String, Vec<u8>)]) -> Result<u64> {
        Ok(self
            .producer
            .publish_all(&self.destination, msgs, PUBLISH_CONCURRENCY)
            .await?)
    }
}

pub(crate) async fn nats(url: &str) -> Result<async_nats::jetstream::Context> {
    Ok(idem_any::connect_nats(url).await?)
}

async fn redis_conn(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url)?;
    Ok(client.get_multiplexed_async_connection().await?)
}

/// The consumers' shared subscription on MQTT, as idem-any subscribes it.
pub(crate) fn mqtt_shared_filter(names: &Names) -> String {
    format!("$share/{}/{}", names.consumer, names.source)
}

/// The harness's own persistent session on a hop's dead-letter topic.
fn mqtt_dead_letter_watcher(names: &Names) -> String {
    format!("idem-chaos-{}-dead-letters", names.consumer)
}

/// How long the broker may take to hand over its retained `$SYS` figures, or a session's
/// queued messages.
const MQTT_READ: Duration = Duration::from_secs(5);
/// A session's queued messages have all arrived once none came for this long.
const MQTT_QUIET: Duration = Duration::from_millis(500);

/// Messages Mosquitto holds, less its retained ones (the `$SYS` figures themselves): queued
/// in sessions or in flight to a consumer and not acknowledged. Both counts are retained
/// `$SYS` topics, refreshed every `sys_interval` (1 s on the run's broker), so a count is up
/// to a second old.
async fn mqtt_stored(url: &str) -> Result<u64> {
    use idem_mqtt::rumqttc::{self, Event, Packet, QoS};
    const STORED: &str = "$SYS/broker/store/messages/count";
    const RETAINED: &str = "$SYS/broker/retained messages/count";
    let endpoint = url::Url::parse(url).context("MQTT URL")?;
    let host = endpoint.host_str().unwrap_or("127.0.0.1").to_owned();
    let port = endpoint.port().unwrap_or(1883);
    let client_id = format!("idem-chaos-sys-{}", std::process::id());
    let options = rumqttc::MqttOptions::new(client_id, host, port);
    let (client, mut events) = rumqttc::AsyncClient::new(options, 8);
    let read = tokio::time::timeout(MQTT_READ, async {
        let (mut stored, mut retained) = (None, None);
        loop {
            match events.poll().await.context("reading Mosquitto's $SYS")? {
                Event::Incoming(Packet::ConnAck(_)) => {
                    client.subscribe(STORED, QoS::AtMostOnce).await?;
                    client.subscribe(RETAINED, QoS::AtMostOnce).await?;
                }
                Event::Incoming(Packet::Publish(p)) => {
                    let n = std::str::from_utf8(&p.payload)
                        .ok()
                        .and_then(|t| t.trim().parse::<u64>().ok());
                    match p.topic.as_str() {
                        STORED => stored = n,
                        RETAINED => retained = n,
                        _ => {}
                    }
                    if let (Some(s), Some(r)) = (stored, retained) {
                        return Ok::<u64, anyhow::Error>(s.saturating_sub(r));
                    }
                }
                _ => {}
            }
        }
    })
    .await;
    let _ = client.try_disconnect();
    match read {
        Ok(r) => r,
        Err(_) => bail!(
            "Mosquitto sent no {STORED} and {RETAINED} within {MQTT_READ:?} (needs sys_interval)"
        ),
    }
}

/// Dead letters of a hop on MQTT: the messages queued in the harness's own session on the
/// dead-letter topic, received and left unacknowledged (the broker sends them again on the
/// next read), so each read counts all of them, up to the session's 64 in flight.
async fn mqtt_dead_letters(url: &str, names: &Names) -> Result<u64> {
    use idem_consumer::Source;
    let dead = dead_letters(Kind::Mqtt, &names.source);
    let mut watcher = idem_mqtt::MqttSource::builder(dead.clone(), mqtt_dead_letter_watcher(names))
        .dead_letter_topic(format!("{dead}/unused"))
        .connect(url)
        .await?;
    let mut seen = 0u64;
    let deadline = tokio::time::Instant::now() + MQTT_READ;
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout(MQTT_QUIET, watcher.next(64)).await {
            Ok(Ok(batch)) if !batch.is_empty() => seen += batch.len() as u64,
            _ => break,
        }
    }
    // Dropped without DISCONNECT or acks: the messages stay queued in the session.
    drop(watcher);
    Ok(seen)
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
        if self.kind() != Kind::Kafka {
            return Ok(None);
        }
        let hosts = self.address();
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
        if self.kind() != Kind::Kafka {
            return Ok(());
        }
        let hosts = self.address();
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
