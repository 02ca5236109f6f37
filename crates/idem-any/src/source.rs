//! URL → a running source: what the source needs on the broker, created idempotently, then the
//! family's source builder with the settings every family shares, handed to the caller's job.

use std::future::Future;
use std::time::Duration;

use idem_consumer::Source;
use idem_core::Error;

use crate::{Broker, BrokerUrl, names};

/// What a consumer of any broker is: the stream, queue or topic it reads, its group, and this
/// process within the group; plus the settings that mean the same on every broker.
#[derive(Debug, Clone)]
pub struct SourceSpec {
    name: String,
    consumer: String,
    instance: String,
    redeliver_after: Option<Duration>,
    in_flight: usize,
    static_membership: bool,
}

impl SourceSpec {
    /// Reads `name` (a NATS subject captured by the stream `name`, an AMQP queue, a Kafka topic,
    /// a Redis stream, an MQTT topic shared by the group) as the consumer group `consumer`;
    /// `instance` names this process in the group (its Redis consumer, its MQTT client ID, its
    /// Kafka static member ID): unique per replica, the same across its restarts.
    pub fn new(
        name: impl Into<String>,
        consumer: impl Into<String>,
        instance: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            consumer: consumer.into(),
            instance: instance.into(),
            redeliver_after: None,
            in_flight: 0,
            static_membership: true,
        }
    }

    /// How long an unacknowledged delivery waits before the broker hands it to another
    /// consumer: JetStream's `ack_wait`, Kafka's session timeout (heartbeats a sixth of it;
    /// for a [static member](Self::static_membership) also how long a restart may take
    /// without a rebalance), Redis Streams' `min_idle`. AMQP and MQTT redeliver when the connection drops, so it does
    /// not apply there. Unset: each adapter's default.
    pub fn redeliver_after(mut self, after: Duration) -> Self {
        self.redeliver_after = Some(after);
        self
    }

    /// Deliveries the consumer holds unacknowledged at once (batch size × concurrency): the
    /// AMQP prefetch is raised to it, so that a batch can fill.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n;
        self
    }

    /// Kafka only: join the group as the static member `instance` (the default) or, with
    /// `false`, as a dynamic member. A static member that restarts within the session timeout
    /// takes its partitions back without rebalancing the group, but one that stops for good
    /// (scaled down, not restarted) leaves its partitions unconsumed until the session times
    /// out ([`redeliver_after`](Self::redeliver_after), else 45 s; see
    /// `idem_kafka::KafkaSourceBuilder::static_member`). Turn it off where
    /// instance names are not unique per replica (two replicas with one name fence each
    /// other out), or where replicas come and go more often than they restart.
    pub fn static_membership(mut self, on: bool) -> Self {
        self.static_membership = on;
        self
    }

    /// The stream, queue or topic.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The consumer group.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// This process within the group.
    pub fn instance(&self) -> &str {
        &self.instance
    }
}

/// Something to do with a source, whatever the broker: [`Source`] is generic, not object-safe,
/// so [`BrokerUrl::with_source`] builds the family's source and calls back into this.
pub trait WithSource {
    /// What the job returns.
    type Output;

    /// Runs the job on `source`.
    fn run<S: Source>(self, source: S) -> impl Future<Output = Self::Output>;
}

impl BrokerUrl {
    /// Creates what publishing to `name` needs, if missing: the JetStream streams `NAME`
    /// (subject `NAME`) and its dead-letter stream; the AMQP queue with its dead-letter
    /// exchange and queue; the Kafka topic and its dead-letter topic (one partition and one
    /// replica each: create your own with more for throughput). Redis Streams and MQTT need
    /// nothing before publishing.
    ///
    /// # Errors
    /// As the family's `ensure_*` function: [`ErrorKind::Unavailable`](idem_core::ErrorKind)
    /// when the broker cannot be reached, [`ErrorKind::InvalidConfig`](idem_core::ErrorKind)
    /// when it refuses the names.
    pub async fn ensure_destination(&self, name: &str) -> Result<(), Error> {
        match self.broker() {
            #[cfg(feature = "nats")]
            Broker::Nats => {
                crate::nats::topology(self.address(), name).await?;
            }
            #[cfg(feature = "amqp")]
            Broker::Amqp => {
                let producer = idem_amqp::AmqpProducer::connect(self.address()).await?;
                idem_amqp::ensure_queue(producer.channel(), name).await?;
                producer.close().await?;
            }
            #[cfg(feature = "kafka")]
            Broker::Kafka => {
                let dead = names::dead_letters(Broker::Kafka, name);
                idem_kafka::ensure_topics(self.address(), &[name, &dead], 1, 1).await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Creates what `spec`'s consumer needs ([`ensure_destination`](Self::ensure_destination),
    /// and on MQTT a persistent session subscribed to the dead-letter topic, client ID
    /// `<consumer>-dead-letters`, that keeps dead letters until an operator collects them),
    /// connects the family's source for `spec` and runs `job` on it.
    ///
    /// Dead letters go where [`dead_letters`](crate::dead_letters) says. On MQTT the source
    /// subscribes to `$share/<consumer>/<name>` with client ID `<instance>`; on Kafka it joins
    /// the group `<consumer>` as the static member `<instance>` unless
    /// [`SourceSpec::static_membership`] is off.
    ///
    /// # Errors
    /// Creating the topology or connecting failed (as the family's builder says: on Kafka an
    /// instance name the broker would refuse as a static member ID is
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind)); the job's own result is its
    /// `Output`.
    pub async fn with_source<J: WithSource>(
        &self,
        spec: &SourceSpec,
        job: J,
    ) -> Result<J::Output, Error> {
        let name = spec.name();
        let dead = names::dead_letters(self.broker(), name);
        match self.broker() {
            #[cfg(feature = "nats")]
            Broker::Nats => {
                let js = crate::nats::topology(self.address(), name).await?;
                let mut builder = idem_nats::JetStreamSource::builder(name, spec.consumer())
                    .dead_letter_subject(dead);
                if let Some(d) = spec.redeliver_after {
                    builder = builder.ack_wait(d);
                }
                Ok(job.run(builder.connect_with(js).await?).await)
            }
            #[cfg(feature = "amqp")]
            Broker::Amqp => {
                self.ensure_destination(name).await?;
                let prefetch = u16::try_from(spec.in_flight)
                    .unwrap_or(u16::MAX)
                    .max(idem_amqp::DEFAULT_PREFETCH);
                let source = idem_amqp::AmqpSource::builder(name)
                    .prefetch(prefetch)
                    .connect(self.address())
                    .await?;
                Ok(job.run(source).await)
            }
            #[cfg(feature = "kafka")]
            Broker::Kafka => {
                self.ensure_destination(name).await?;
                let mut builder =
                    idem_kafka::KafkaSource::builder(name, spec.consumer()).dead_letter_topic(dead);
                if spec.static_membership {
                    builder = builder.static_member(spec.instance());
                }
                if let Some(d) = spec.redeliver_after {
                    // Heartbeats well inside the session, as librdkafka recommends (a third or
                    // less).
                    let session = d.as_millis().max(1);
                    builder = builder
                        .set_consumer("session.timeout.ms", session.to_string())
                        .set_consumer("heartbeat.interval.ms", (session / 6).max(100).to_string());
                }
                Ok(job.run(builder.connect(self.address()).await?).await)
            }
            #[cfg(feature = "redis-streams")]
            Broker::RedisStreams => {
                let mut builder = idem_redis_streams::RedisStreamSource::builder(
                    name,
                    spec.consumer(),
                    spec.instance(),
                )
                .dead_letter_stream(dead);
                if let Some(d) = spec.redeliver_after {
                    builder = builder.min_idle(d);
                }
                Ok(job.run(builder.connect(self.address()).await?).await)
            }
            #[cfg(feature = "mqtt")]
            Broker::Mqtt => {
                let keeper = names::mqtt_dead_letter_keeper(spec.consumer());
                idem_mqtt::ensure_session(self.address(), &keeper, &dead).await?;
                let filter = format!("$share/{}/{name}", spec.consumer());
                let source = idem_mqtt::MqttSource::builder(filter, spec.instance())
                    .dead_letter_topic(dead)
                    .connect(self.address())
                    .await?;
                Ok(job.run(source).await)
            }
            #[allow(unreachable_patterns)] // `parse` refuses a family that is not compiled in.
            other => Err(crate::not_compiled(other)),
        }
    }

    /// Removes what [`with_source`](Self::with_source) created for `spec`: streams, queues,
    /// topics, the consumer's MQTT sessions, and their messages, dead letters included. For
    /// tests and benches on shared brokers, never part of a service's life.
    ///
    /// # Errors
    /// The broker could not be reached or refused a deletion; something already gone is fine.
    pub async fn teardown(&self, spec: &SourceSpec) -> Result<(), Error> {
        let name = spec.name();
        match self.broker() {
            #[cfg(feature = "nats")]
            Broker::Nats => {
                let js = crate::nats::connect(self.address()).await?;
                for stream in [name.to_owned(), names::nats_dead_letter_stream(name)] {
                    // A stream that is already gone is fine.
                    let _ = js.delete_stream(&stream).await;
                }
            }
            #[cfg(feature = "amqp")]
            Broker::Amqp => {
                let producer = idem_amqp::AmqpProducer::connect(self.address()).await?;
                idem_amqp::Topology::new(name)
                    .delete(producer.channel())
                    .await?;
                producer.close().await?;
            }
            #[cfg(feature = "kafka")]
            Broker::Kafka => {
                let dead = names::dead_letters(Broker::Kafka, name);
                idem_kafka::delete_topics(self.address(), &[name, &dead]).await?;
            }
            #[cfg(feature = "redis-streams")]
            Broker::RedisStreams => {
                use idem_redis_streams::redis;
                let system = |what: &str, e: redis::RedisError| {
                    Error::from_system(idem_core::ErrorKind::Unavailable, "Redis", what, e)
                };
                let client = redis::Client::open(self.address())
                    .map_err(|e| system(&format!("parsing {}", self.redacted()), e))?;
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(|e| system(&format!("connecting to {}", self.redacted()), e))?;
                let _: i64 = redis::cmd("DEL")
                    .arg(name)
                    .arg(names::dead_letters(Broker::RedisStreams, name))
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| system("DEL", e))?;
            }
            #[cfg(feature = "mqtt")]
            Broker::Mqtt => {
                for id in [
                    spec.instance().to_owned(),
                    names::mqtt_dead_letter_keeper(spec.consumer()),
                ] {
                    idem_mqtt::end_session(self.address(), &id).await?;
                }
            }
            #[allow(unreachable_patterns)]
            other => return Err(crate::not_compiled(other)),
        }
        Ok(())
    }
}
