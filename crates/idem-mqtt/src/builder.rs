//! Configuring an [`MqttSource`]: the topic filter, the persistent session, the dead-letter
//! topic and the connection's limits, checked before anything is sent to the broker.

use std::time::Duration;

use idem_core::Error;

use crate::config::{Config, Options, Protocol};
use crate::error::invalid;
use crate::source::MqttSource;

/// Configures an [`MqttSource`]; created by [`MqttSource::builder`], finished by
/// [`connect`](Self::connect).
#[derive(Clone)]
#[must_use]
pub struct MqttSourceBuilder {
    filter: String,
    client_id: String,
    dead_letter_topic: Option<String>,
    credentials: Option<(String, String)>,
    options: Options,
}

/// Builders get logged; the password must not be.
impl std::fmt::Debug for MqttSourceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttSourceBuilder")
            .field("filter", &self.filter)
            .field("client_id", &self.client_id)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("username", &self.credentials.as_ref().map(|(u, _)| u))
            .field("options", &self.options)
            .finish()
    }
}

impl MqttSource {
    /// Configures a source consuming `filter` (a topic filter, `$share/<group>/<filter>` for a
    /// shared subscription) as the persistent session `client_id`.
    ///
    /// `client_id` must be stable across restarts of this consumer instance and unique among
    /// the broker's clients: the session, and the messages waiting in it, belong to it.
    pub fn builder(filter: impl Into<String>, client_id: impl Into<String>) -> MqttSourceBuilder {
        MqttSourceBuilder {
            filter: filter.into(),
            client_id: client_id.into(),
            dead_letter_topic: None,
            credentials: None,
            options: Options::default(),
        }
    }
}

impl MqttSourceBuilder {
    /// The protocol version (default [`Protocol::V5`]).
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.options.protocol = protocol;
        self
    }

    /// Where dead letters go. Default: the filter's leading literal levels plus `/dead-letter`
    /// (`orders` → `orders/dead-letter`, `$share/g/sensors/+/temp` → `sensors/dead-letter`),
    /// refused when that topic would match the filter itself (`orders/#`): configure one then.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// How long the broker keeps the session (subscription and unacknowledged or queued
    /// messages) while this consumer is disconnected (MQTT v5; default 7 days). 3.1.1 sessions
    /// last until the broker's own expiry setting.
    pub fn session_expiry(mut self, expiry: Duration) -> Self {
        self.options.session_expiry = expiry;
        self
    }

    /// How many unacknowledged messages the broker may send at once (the v5 receive maximum;
    /// default 64): MQTT's prefetch. Keep it at least what the runner keeps in flight (its
    /// concurrency, times the batch size with batches). On 3.1.1 the broker's own limit
    /// applies (Mosquitto: `max_inflight_messages`).
    pub fn max_in_flight(mut self, n: u16) -> Self {
        self.options.max_in_flight = n.max(1);
        self
    }

    /// Keep-alive interval (default 30 s, at least 5 s).
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.options.keep_alive = interval.max(Duration::from_secs(5));
        self
    }

    /// Username and password, overriding any in the URL.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((username.into(), password.into()));
        self
    }

    /// How long to wait for the broker to accept a dead letter (default 10 s).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.options.publish_timeout = timeout;
        self
    }

    /// Whether a v5 PUBACK reporting "no matching subscribers" for a dead letter fails it
    /// (default `true`): the broker would drop the dead letter, so the original stays
    /// unacknowledged instead of being lost.
    pub fn require_dead_letter_subscriber(mut self, require: bool) -> Self {
        self.options.require_subscriber = require;
        self
    }

    /// Largest packet accepted (default 16 MiB). A v5 broker discards larger messages for this
    /// client; on 3.1.1 a larger one breaks the connection, so keep this above any payload.
    pub fn max_packet_size(mut self, bytes: usize) -> Self {
        self.options.max_packet_size = bytes;
        self
    }

    /// Connects to the broker at `url` (`mqtt://[user[:password]@]host[:port]`, also
    /// `tcp://`), subscribes at QoS 1 and returns once the broker granted the subscription.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a bad URL,
    /// filter, client ID or dead-letter topic, or a refused subscription;
    /// [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) when the broker cannot be
    /// reached.
    pub async fn connect(self, url: &str) -> Result<MqttSource, Error> {
        let mut config = Config::new(url, self.options.clone())?;
        if let Some(credentials) = self.credentials.clone() {
            config.endpoint.credentials = Some(credentials);
        }
        let dead_letter_topic = self.validate()?;
        MqttSource::start(config, self.client_id, self.filter, dead_letter_topic).await
    }

    /// Checks what rumqttc would panic on or the broker would refuse, and resolves the
    /// dead-letter topic.
    fn validate(&self) -> Result<String, Error> {
        if self.client_id.is_empty() {
            return Err(invalid(
                "an MQTT consumer needs a stable, non-empty client ID: its persistent session is what redelivers unacknowledged messages",
            ));
        }
        if !rumqttc::valid_filter(&self.filter) {
            return Err(invalid(format!(
                "{:?} is not a valid MQTT topic filter",
                self.filter
            )));
        }
        let topic = match &self.dead_letter_topic {
            Some(t) => t.clone(),
            None => default_dead_letter_topic(&self.filter)?,
        };
        if !rumqttc::valid_topic(&topic) || topic.is_empty() {
            return Err(invalid(format!(
                "{topic:?} is not a valid MQTT topic for dead letters"
            )));
        }
        if rumqttc::matches(&topic, subscribed_filter(&self.filter)) {
            return Err(invalid(format!(
                "the dead-letter topic {topic:?} matches the consumed filter {:?}: dead letters would be consumed again",
                self.filter
            )));
        }
        Ok(topic)
    }
}

/// The filter without its `$share/<group>/` prefix: what topics are matched against.
fn subscribed_filter(filter: &str) -> &str {
    filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_, f)| f)
}

fn default_dead_letter_topic(filter: &str) -> Result<String, Error> {
    let base: Vec<&str> = subscribed_filter(filter)
        .split('/')
        .take_while(|level| *level != "+" && *level != "#")
        .collect();
    let topic = format!("{}/dead-letter", base.join("/"));
    if base.is_empty()
        || base.iter().all(|l| l.is_empty())
        || rumqttc::matches(&topic, subscribed_filter(filter))
    {
        return Err(invalid(format!(
            "no default dead-letter topic for filter {filter:?}: configure MqttSourceBuilder::dead_letter_topic with a topic outside the filter"
        )));
    }
    Ok(topic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_dead_letter_topics_stay_outside_the_filter() {
        let dl = |f: &str| MqttSource::builder(f, "c").validate();
        assert_eq!(dl("orders").unwrap(), "orders/dead-letter");
        assert_eq!(
            dl("$share/g/sensors/+/temp").unwrap(),
            "sensors/dead-letter"
        );
        assert!(dl("orders/#").is_err());
        assert!(dl("#").is_err());
        assert!(
            MqttSource::builder("orders/#", "c")
                .dead_letter_topic("orders/x")
                .validate()
                .is_err()
        );
        assert!(MqttSource::builder("orders", "").validate().is_err());
    }

    /// Builders get logged; the password given to `credentials` must not be.
    #[test]
    fn debug_hides_the_password() {
        let builder = MqttSource::builder("orders", "c").credentials("app", "hunter2");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("\"app\""), "{shown}");
    }
}
