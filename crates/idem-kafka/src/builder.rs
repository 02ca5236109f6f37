//! Configuring a [`KafkaSource`]: topics, consumer group, dead-letter topic and librdkafka
//! settings, and creating the group member from them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::FutureProducer;

use crate::delivery::Shared;
use crate::error;
use crate::membership::{self, Membership, STATIC_SESSION_TIMEOUT};
use crate::offsets::Offsets;
use crate::source::{GroupContext, KafkaSource};

/// How often settled offsets are committed while `next` waits for messages.
const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a dead letter may wait for room in the producer queue.
const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Configures a [`KafkaSource`]; created by [`KafkaSource::builder`], finished by
/// [`connect`](Self::connect).
#[derive(Clone)]
#[must_use]
pub struct KafkaSourceBuilder {
    group_id: String,
    topics: Vec<String>,
    dead_letter_topic: Option<String>,
    common: Vec<(String, String)>,
    consumer_only: Vec<(String, String)>,
    commit_interval: Duration,
    send_timeout: Duration,
    static_member: Option<String>,
}

/// librdkafka settings as `key=value`, secrets masked by the redaction every idem crate shares.
struct Settings<'a>(&'a [(String, String)]);

impl std::fmt::Debug for Settings<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(
                self.0
                    .iter()
                    .map(|(k, v)| (k, idem_redact::redact_setting(k, v))),
            )
            .finish()
    }
}

/// Builders get logged; a `sasl.password` given with [`set`](KafkaSourceBuilder::set) must
/// not be.
impl std::fmt::Debug for KafkaSourceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSourceBuilder")
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("common", &Settings(&self.common))
            .field("consumer_only", &Settings(&self.consumer_only))
            .field("commit_interval", &self.commit_interval)
            .field("send_timeout", &self.send_timeout)
            .field("static_member", &self.static_member)
            .finish()
    }
}

impl KafkaSource {
    /// Configures a member of consumer group `group_id` consuming `topic` (add more with
    /// [`KafkaSourceBuilder::topic`]).
    pub fn builder(topic: impl Into<String>, group_id: impl Into<String>) -> KafkaSourceBuilder {
        KafkaSourceBuilder {
            group_id: group_id.into(),
            topics: vec![topic.into()],
            dead_letter_topic: None,
            common: Vec::new(),
            consumer_only: Vec::new(),
            commit_interval: DEFAULT_COMMIT_INTERVAL,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            static_member: None,
        }
    }
}

impl KafkaSourceBuilder {
    /// Subscribes to `topic` too (call once per topic).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Where dead letters go. Default: `<topic>.dead-letter` for a message from `<topic>`.
    /// The topic must exist unless the brokers auto-create topics (see
    /// [`ensure_topics`](crate::ensure_topics)).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// A librdkafka setting for both the consumer and the dead-letter producer (security,
    /// `client.id`, timeouts). See librdkafka's `CONFIGURATION.md`.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.common.push((key.into(), value.into()));
        self
    }

    /// A librdkafka setting for the consumer only (`session.timeout.ms`,
    /// `heartbeat.interval.ms`, `auto.offset.reset`, `partition.assignment.strategy`, …).
    ///
    /// `enable.auto.commit` and `enable.auto.offset.store` are always `false`: offsets are
    /// committed by this adapter, only after the runner has settled the messages below them.
    pub fn set_consumer(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.consumer_only.push((key.into(), value.into()));
        self
    }

    /// How often settled offsets are committed while waiting for messages (default 1 s).
    /// Offsets are also committed on every fetch, on revoke, and on close; a longer interval
    /// only means more redeliveries (duplicates) after a crash.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How long a dead letter may wait for room in the producer's queue (default 30 s).
    /// Delivery itself is bounded by librdkafka's `delivery.timeout.ms`.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// Joins the group as the static member `instance_id` (KIP-345, librdkafka's
    /// `group.instance.id`): one ID per replica, the same across its restarts (a StatefulSet
    /// pod name, a systemd instance name).
    ///
    /// * **What it buys:** a member that comes back within the session timeout with the same
    ///   ID gets the same partitions back, and the other members are not rebalanced at all: a
    ///   rolling deploy or a crash-and-restart no longer stops the whole group for a
    ///   rebalance, and nobody else consumes the restarted member's partitions meanwhile (no
    ///   redeliveries to another member).
    /// * **What it costs:** a static member does not leave the group when it stops,
    ///   gracefully or not ([`close`](idem_consumer::Source::close) commits its settled offsets
    ///   and goes without a LeaveGroup). Its partitions are consumed by nobody until the session
    ///   timeout has passed, and only then handed to the others. Scaling down, or a replica that
    ///   does not come back, costs each of its partitions that long a pause.
    /// * **Session timeout:** [`STATIC_SESSION_TIMEOUT`](crate::STATIC_SESSION_TIMEOUT) (45 s)
    ///   unless `session.timeout.ms` is set ([`set_consumer`](Self::set_consumer)): long enough
    ///   for a process or pod restart, short enough that a lost member's partitions move on
    ///   within a minute. It must lie within the broker's `group.min.session.timeout.ms` and
    ///   `group.max.session.timeout.ms` (Kafka: 6 s and 30 min).
    /// * **Two processes with one ID:** the broker fences the older one (`FENCED_INSTANCE_ID`,
    ///   fatal in librdkafka); its [`Source::next`](idem_consumer::Source::next) then fails with
    ///   [`ErrorKind::Misconfigured`] for good. IDs must be unique per replica.
    /// * **Brokers without it** (JoinGroup before v5, Kafka before 2.3): librdkafka joins
    ///   without the ID; the source logs a warning, becomes a dynamic member
    ///   ([`Membership::static_member`] turns `None`) and leaves the group on close as one.
    ///
    /// The ID is checked when connecting: 1 to 249 ASCII letters, digits, `.`, `_` or `-`
    /// (the broker's rule), else [`ErrorKind::InvalidConfig`]. A `group.instance.id` given
    /// with [`set_consumer`](Self::set_consumer) is the same as this (and wins over it).
    pub fn static_member(mut self, instance_id: impl Into<String>) -> Self {
        self.static_member = Some(instance_id.into());
        self
    }

    /// Creates the consumer and its dead-letter producer for the cluster at `brokers`
    /// (`host:port[,host:port…]`) and subscribes to the topics.
    ///
    /// librdkafka connects in the background: an unreachable broker shows up as
    /// [`ErrorKind::Unavailable`] from [`Source::next`](idem_consumer::Source::next), not
    /// here, so a consumer started while the cluster is down waits for it like for any
    /// outage.
    ///
    /// Must run inside a tokio runtime: the consumer spawns a wake-up task on it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for an empty topic name, a
    /// [static member ID](Self::static_member) the broker would refuse, a setting librdkafka
    /// refuses, or no tokio runtime.
    pub async fn connect(self, brokers: &str) -> Result<KafkaSource, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "a Kafka source must be connected inside a tokio runtime",
            ));
        }
        if self.topics.iter().any(String::is_empty) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "a Kafka source needs non-empty topic names",
            ));
        }
        // A `group.instance.id` set directly makes a static member too, and must close as one.
        let static_member = self
            .common
            .iter()
            .chain(&self.consumer_only)
            .rev()
            .find(|(k, _)| k == "group.instance.id")
            .map(|(_, v)| v.clone())
            .or(self.static_member);
        if let Some(id) = &static_member {
            membership::validate_instance_id(id)?;
        }
        let mut producer_config = ClientConfig::new();
        producer_config.set("bootstrap.servers", brokers);
        for (k, v) in &self.common {
            producer_config.set(k, v);
        }
        let producer: FutureProducer = producer_config
            .create()
            .map_err(|e| error::invalid_config("creating the dead-letter producer", e))?;

        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set("group.id", &self.group_id)
            // A new group starts at the oldest message: nothing published before the
            // first deployment is skipped. Overridable with `set_consumer`.
            .set("auto.offset.reset", "earliest");
        if let Some(id) = &static_member {
            config.set("group.instance.id", id).set(
                "session.timeout.ms",
                STATIC_SESSION_TIMEOUT.as_millis().to_string(),
            );
        }
        // After the static member's session timeout, so that `set_consumer` overrides it.
        for (k, v) in self.common.iter().chain(&self.consumer_only) {
            config.set(k, v);
        }
        config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        if static_member.is_some() {
            watch_member_id(&mut config);
        }
        let offsets = Arc::new(Mutex::new(Offsets::default()));
        let membership = Membership::new(static_member.clone());
        let context = GroupContext {
            offsets: offsets.clone(),
            membership: membership.clone(),
        };
        let consumer: StreamConsumer<GroupContext> = config
            .create_with_context(context)
            .map_err(|e| error::invalid_config("creating the consumer", e))?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| error::invalid_config("subscribing", e))?;
        tracing::info!(group = %self.group_id, topics = ?self.topics, static_member = static_member.as_deref(), "kafka consumer subscribed");
        Ok(KafkaSource::new(
            consumer,
            Shared {
                offsets,
                producer,
                dead_letter_topic: self.dead_letter_topic,
                send_timeout: self.send_timeout,
            },
            membership,
            self.group_id,
            self.topics,
            self.commit_interval,
        ))
    }
}

/// Turns on librdkafka's `cgrp` debug lines (keeping any other contexts asked for), whose
/// "updating member id" line tells whether the broker kept the static member ID; they reach
/// `tracing` at debug level. A consumer-group context logs a few lines per join and
/// rebalance, not per message.
fn watch_member_id(config: &mut ClientConfig) {
    let debug = match config.get("debug") {
        Some(d) if d.split(',').any(|c| matches!(c.trim(), "cgrp" | "all")) => d.to_owned(),
        Some(d) if !d.trim().is_empty() => format!("{d},cgrp"),
        _ => "cgrp".to_owned(),
    };
    config
        .set("debug", debug)
        .set_log_level(RDKafkaLogLevel::Debug);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_secret_settings() {
        let builder = KafkaSource::builder("orders", "billing")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.username", "app")
            .set("sasl.password", "hunter2-sasl")
            .set("SSL.KEY.PASSWORD", "hunter2-key")
            .set("ssl.key.pem", "-----BEGIN PRIVATE KEY-----hunter2-pem")
            .set("sasl.oauthbearer.config", "principal=x hunter2-oauth")
            .set_consumer("sasl.oauthbearer.client.secret", "hunter2-client")
            .set_consumer("some.token", "hunter2-token");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("\"sasl.password\": \"***\""), "{shown}");
        // What is not secret stays visible for debugging.
        assert!(
            shown.contains("SASL_SSL") && shown.contains("\"app\""),
            "{shown}"
        );
        assert!(
            shown.contains("orders") && shown.contains("billing"),
            "{shown}"
        );
    }
}
