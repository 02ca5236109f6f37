//! Broker URL → adapter: the only place that knows the five brokers apart. `--source NAME`
//! names the stream, queue or topic; everything the service needs on the broker side is
//! created here, idempotently, before consuming or publishing.

use std::future::Future;

use anyhow::{Context, Result, bail};
use futures_util::{TryStreamExt, stream};
use idem_consumer::{RunStats, Source};

use crate::{Database, Settings};

/// How many publishes are in flight at once in `publish_many` (bench backlogs).
const PUBLISH_CONCURRENCY: usize = 64;

/// A parsed `--broker` URL.
#[derive(Clone)]
pub(crate) enum BrokerUrl {
    Nats(String),
    Amqp(String),
    /// `host:port[,host:port…]`, from `kafka://host:port[,…]`.
    Kafka(String),
    Redis(String),
    Mqtt(String),
}

impl BrokerUrl {
    pub(crate) fn parse(url: Option<&str>) -> Result<Self> {
        let Some(url) = url else {
            bail!("--broker is required: nats://, amqp://, kafka://host:port, redis:// or mqtt://");
        };
        let scheme = url
            .split("://")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        Ok(match scheme.as_str() {
            "nats" => BrokerUrl::Nats(url.to_owned()),
            "amqp" | "amqps" => BrokerUrl::Amqp(url.to_owned()),
            "kafka" => {
                let hosts = url
                    .split_once("://")
                    .map(|(_, h)| h.trim_end_matches('/'))
                    .unwrap_or("");
                if hosts.is_empty() {
                    bail!("kafka URL needs host:port, e.g. kafka://127.0.0.1:9092");
                }
                BrokerUrl::Kafka(hosts.to_owned())
            }
            "redis" | "rediss" => BrokerUrl::Redis(url.to_owned()),
            "mqtt" | "tcp" => BrokerUrl::Mqtt(url.to_owned()),
            _ => bail!(
                "unsupported broker URL {:?}: expected nats://, amqp://, kafka://host:port, redis:// or mqtt://",
                idem_core::redact_url(url)
            ),
        })
    }

    /// The URL without its secrets, for logs.
    pub(crate) fn redacted(&self) -> String {
        match self {
            BrokerUrl::Kafka(hosts) => idem_core::redact_url(&format!("kafka://{hosts}")),
            BrokerUrl::Nats(u) | BrokerUrl::Amqp(u) | BrokerUrl::Redis(u) | BrokerUrl::Mqtt(u) => {
                idem_core::redact_url(u)
            }
        }
    }
}

/// The URLs may hold passwords: `Debug` shows them redacted.
impl std::fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BrokerUrl").field(&self.redacted()).finish()
    }
}

/// Something to do with a source, whatever the broker: the service's consume loop, the bench's
/// legs. (`Source` is generic, not object-safe, so the broker match calls back into this.)
pub(crate) trait WithSource {
    type Output;
    fn run<Src: Source>(self, source: Src) -> impl Future<Output = Result<Self::Output>>;
}

/// The service: consume into the database until shutdown.
struct Serve<'a> {
    db: Database,
    settings: &'a Settings,
}

impl WithSource for Serve<'_> {
    type Output = RunStats;
    async fn run<Src: Source>(self, source: Src) -> Result<RunStats> {
        self.db.consume(source, self.settings).await
    }
}

pub(crate) async fn serve(
    broker: &BrokerUrl,
    settings: &Settings,
    db: Database,
) -> Result<RunStats> {
    with_source(broker, settings, Serve { db, settings }).await
}

/// Connects to NATS at `urls`: one URL or several, comma-separated (the seed servers of a
/// cluster, so a replica starting while one node is down still connects; once connected the
/// client also learns the cluster's other servers from the server itself).
async fn nats_connect(urls: &str) -> Result<idem_nats::async_nats::Client> {
    let servers = urls
        .split(',')
        .map(|u| u.trim().parse::<idem_nats::async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("NATS URL {}", idem_core::redact_url(urls)))?;
    Ok(idem_nats::async_nats::connect(servers).await?)
}

fn nats_dead_letter_subject(source: &str) -> String {
    format!("{source}.dead-letter")
}

/// The JetStream streams: `NAME` captures subject `NAME`; `NAME-dead-letter` keeps dead letters.
async fn nats_topology(
    url: &str,
    source: &str,
) -> Result<idem_nats::async_nats::jetstream::Context> {
    let client = nats_connect(url)
        .await
        .with_context(|| format!("connecting to NATS at {}", idem_core::redact_url(url)))?;
    let js = idem_nats::async_nats::jetstream::new(client);
    idem_nats::ensure_stream(&js, source, &[source]).await?;
    let dead = nats_dead_letter_subject(source);
    idem_nats::ensure_stream(&js, &format!("{source}-dead-letter"), &[&dead]).await?;
    Ok(js)
}

/// The queue `NAME`, its dead letters through `NAME.dlx` into `NAME.dead`.
async fn amqp_topology(url: &str, source: &str) -> Result<idem_amqp::AmqpProducer> {
    let producer = idem_amqp::AmqpProducer::connect(url).await?;
    idem_amqp::ensure_queue(producer.channel(), source).await?;
    Ok(producer)
}

fn kafka_dead_letter_topic(source: &str) -> String {
    format!("{source}.dead-letter")
}

/// Creates the topic and its dead-letter topic if missing, one partition and one replica each
/// (create your own with more for throughput; per-partition order then holds only with
/// `--concurrency 1`).
async fn kafka_topology(brokers: &str, source: &str) -> Result<()> {
    let dead = kafka_dead_letter_topic(source);
    idem_kafka::ensure_topics(brokers, &[source, &dead], 1, 1)
        .await
        .with_context(|| format!("on {}", idem_core::redact_url(brokers)))?;
    Ok(())
}

fn mqtt_dead_letter_topic(source: &str) -> String {
    format!("{source}/dead-letter")
}

/// An MQTT broker keeps nothing for a topic nobody subscribes to: a persistent session
/// subscribed to the dead-letter topic holds dead letters until an operator collects them
/// (client ID `<consumer>-dead-letters`).
async fn mqtt_topology(url: &str, settings: &Settings) -> Result<()> {
    let keeper = format!("{}-dead-letters", settings.consumer);
    idem_mqtt::ensure_session(url, &keeper, &mqtt_dead_letter_topic(&settings.source)).await?;
    Ok(())
}

/// Creates what the service needs on `broker` and hands `job` a source for `settings.source`.
pub(crate) async fn with_source<J: WithSource>(
    broker: &BrokerUrl,
    settings: &Settings,
    job: J,
) -> Result<J::Output> {
    let name = settings.source.as_str();
    match broker {
        BrokerUrl::Nats(url) => {
            let js = nats_topology(url, name).await?;
            let mut builder = idem_nats::JetStreamSource::builder(name, settings.consumer.as_str())
                .dead_letter_subject(nats_dead_letter_subject(name));
            if let Some(d) = settings.redeliver_after {
                builder = builder.ack_wait(d);
            }
            let source = builder.connect_with(js).await?;
            job.run(source).await
        }
        BrokerUrl::Amqp(url) => {
            amqp_topology(url, name).await?.close().await?;
            // Room for every batch in flight: with the default prefetch (64) a `--batch 100`
            // consumer would never see a full batch.
            let in_flight = settings
                .batch
                .max(1)
                .saturating_mul(settings.concurrency.max(1));
            let prefetch = u16::try_from(in_flight).unwrap_or(u16::MAX).max(64);
            let source = idem_amqp::AmqpSource::builder(name)
                .prefetch(prefetch)
                .connect(url)
                .await?;
            job.run(source).await
        }
        BrokerUrl::Kafka(brokers) => {
            kafka_topology(brokers, name).await?;
            let mut builder = idem_kafka::KafkaSource::builder(name, settings.consumer.as_str())
                .dead_letter_topic(kafka_dead_letter_topic(name));
            if let Some(d) = settings.redeliver_after {
                // Heartbeats well inside the session, as librdkafka recommends (a third or less).
                let session = d.as_millis().max(1);
                builder = builder
                    .set_consumer("session.timeout.ms", session.to_string())
                    .set_consumer("heartbeat.interval.ms", (session / 6).max(100).to_string());
            }
            let source = builder.connect(brokers).await?;
            job.run(source).await
        }
        BrokerUrl::Redis(url) => {
            let mut builder = idem_redis_streams::RedisStreamSource::builder(
                name,
                settings.consumer.as_str(),
                settings.instance.as_str(),
            );
            if let Some(d) = settings.redeliver_after {
                builder = builder.min_idle(d);
            }
            let source = builder.connect(url).await?;
            job.run(source).await
        }
        BrokerUrl::Mqtt(url) => {
            mqtt_topology(url, settings).await?;
            let filter = format!("$share/{}/{name}", settings.consumer);
            let source = idem_mqtt::MqttSource::builder(filter, settings.instance.as_str())
                .dead_letter_topic(mqtt_dead_letter_topic(name))
                .connect(url)
                .await?;
            job.run(source).await
        }
    }
}

/// Publishes one message with `id` in the broker's ID slot. Returns a note when the broker
/// itself dropped it: JetStream discards a repeated `Nats-Msg-Id` inside the stream's
/// duplicate window (two minutes by default), before any consumer sees it.
pub(crate) async fn publish(
    broker: &BrokerUrl,
    source: &str,
    id: &str,
    payload: &[u8],
) -> Result<Option<&'static str>> {
    if let BrokerUrl::Nats(url) = broker {
        let producer = idem_nats::NatsProducer::new(nats_topology(url, source).await?);
        let ack = producer
            .publish(source.to_owned(), id.as_bytes(), payload.to_vec())
            .await?;
        return Ok(ack.duplicate.then_some(
            "JetStream dropped it: the same Nats-Msg-Id was published within the stream's duplicate window",
        ));
    }
    publish_many(broker, source, &[(id.to_owned(), payload.to_vec())]).await?;
    Ok(None)
}

/// Publishes many messages over one connection, each confirmed by the broker.
pub(crate) async fn publish_many(
    broker: &BrokerUrl,
    source: &str,
    msgs: &[(String, Vec<u8>)],
) -> Result<()> {
    let all = stream::iter(msgs.iter().map(Ok::<_, anyhow::Error>));
    match broker {
        BrokerUrl::Nats(url) => {
            let producer = idem_nats::NatsProducer::new(nats_topology(url, source).await?);
            let producer = &producer;
            all.try_for_each_concurrent(PUBLISH_CONCURRENCY, |(id, payload)| async move {
                producer
                    .publish(source.to_owned(), id.as_bytes(), payload.clone())
                    .await?;
                Ok(())
            })
            .await
        }
        BrokerUrl::Amqp(url) => {
            let producer = amqp_topology(url, source).await?;
            let producer = &producer;
            all.try_for_each_concurrent(PUBLISH_CONCURRENCY, |(id, payload)| async move {
                producer.publish("", source, id.as_bytes(), payload).await?;
                Ok(())
            })
            .await?;
            Ok(())
        }
        BrokerUrl::Kafka(brokers) => {
            kafka_topology(brokers, source).await?;
            let producer = idem_kafka::KafkaProducer::connect(brokers).await?;
            let producer = &producer;
            all.try_for_each_concurrent(PUBLISH_CONCURRENCY, |(id, payload)| async move {
                producer
                    .publish(source, Some(id.as_bytes()), id, payload)
                    .await?;
                Ok(())
            })
            .await
        }
        BrokerUrl::Redis(url) => {
            let producer = idem_redis_streams::RedisStreamProducer::connect(url).await?;
            let producer = &producer;
            all.try_for_each_concurrent(PUBLISH_CONCURRENCY, |(id, payload)| async move {
                producer.publish(source, id.as_str(), payload).await?;
                Ok(())
            })
            .await
        }
        BrokerUrl::Mqtt(url) => {
            let client_id = format!("payments-publisher-{}", std::process::id());
            let producer = idem_mqtt::MqttProducer::connect(url, client_id).await?;
            // Refuse to publish into the void: with no subscriber (the service has not started
            // yet, so its session does not exist) the broker would drop the message.
            let producer = producer.require_subscriber(true);
            // One at a time: the producer waits for each PUBACK on its connection.
            for (id, payload) in msgs {
                producer.publish(source, Some(id), payload).await?;
            }
            Ok(())
        }
    }
}

/// Removes what `with_source` created for `settings.source`: streams, queues, topics, the
/// consumer's sessions and their messages, dead letters included. For tests and benches on
/// shared brokers (`payments teardown`), never part of a service's life.
pub(crate) async fn teardown(broker: &BrokerUrl, settings: &Settings) -> Result<()> {
    let name = settings.source.as_str();
    match broker {
        BrokerUrl::Nats(url) => {
            let client = nats_connect(url).await?;
            let js = idem_nats::async_nats::jetstream::new(client);
            for stream in [name.to_owned(), format!("{name}-dead-letter")] {
                // A stream that is already gone is fine.
                let _ = js.delete_stream(&stream).await;
            }
        }
        BrokerUrl::Amqp(url) => {
            let producer = idem_amqp::AmqpProducer::connect(url).await?;
            idem_amqp::Topology::new(name)
                .delete(producer.channel())
                .await?;
            producer.close().await?;
        }
        BrokerUrl::Kafka(brokers) => {
            let dead = kafka_dead_letter_topic(name);
            idem_kafka::delete_topics(brokers, &[name, &dead]).await?;
        }
        BrokerUrl::Redis(url) => {
            use idem_redis_streams::redis;
            let client = redis::Client::open(url.as_str())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            let _: i64 = redis::cmd("DEL")
                .arg(name)
                .arg(format!("{name}:dead-letter"))
                .query_async(&mut conn)
                .await?;
        }
        BrokerUrl::Mqtt(url) => {
            for id in [
                settings.instance.clone(),
                format!("{}-dead-letters", settings.consumer),
            ] {
                idem_mqtt::end_session(url, &id).await?;
            }
        }
    }
    Ok(())
}
