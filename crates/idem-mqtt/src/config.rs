//! Consumer configuration, the broker URL, and how they become rumqttc options.

use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rumqttc::v5;

/// The MQTT protocol version spoken to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// MQTT 5: user properties carry the message ID and the dead-letter reason.
    #[default]
    V5,
    /// MQTT 3.1.1: no properties, so the ID is read from the JSON payload and dead letters are
    /// JSON envelopes.
    V311,
}

/// How to consume one topic filter; see [`MqttSource::connect`](crate::MqttSource::connect).
#[derive(Debug, Clone)]
pub struct MqttConfig {
    pub(crate) endpoint: Endpoint,
    pub(crate) client_id: String,
    pub(crate) filter: String,
    pub(crate) protocol: Protocol,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) session_expiry: Duration,
    pub(crate) max_in_flight: u16,
    pub(crate) keep_alive: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) require_dead_letter_subscriber: bool,
    pub(crate) max_packet_size: usize,
    pub(crate) url_error: Option<String>,
}

impl MqttConfig {
    /// Consume `filter` (a topic filter, `$share/<group>/<filter>` for a shared subscription) from
    /// the broker at `url` (`mqtt://[user[:password]@]host[:port]`, also `tcp://`) as the
    /// persistent session `client_id`.
    ///
    /// `client_id` must be stable across restarts of this consumer instance and unique among the
    /// broker's clients: the session, and the messages waiting in it, belong to it.
    pub fn new(url: &str, client_id: impl Into<String>, filter: impl Into<String>) -> Self {
        let (endpoint, url_error) = match Endpoint::parse(url) {
            Ok(e) => (e, None),
            Err(e) => (Endpoint::default(), Some(e)),
        };
        Self {
            endpoint,
            client_id: client_id.into(),
            filter: filter.into(),
            protocol: Protocol::V5,
            dead_letter_topic: None,
            session_expiry: Duration::from_secs(7 * 24 * 3600),
            max_in_flight: 64,
            keep_alive: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            require_dead_letter_subscriber: true,
            max_packet_size: 16 * 1024 * 1024,
            url_error,
        }
    }

    /// The protocol version (default [`Protocol::V5`]).
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
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
        self.session_expiry = expiry;
        self
    }

    /// How many unacknowledged messages the broker may send at once (the v5 receive maximum;
    /// default 64). On 3.1.1 the broker's own limit applies (Mosquitto: `max_inflight_messages`).
    pub fn max_in_flight(mut self, n: u16) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Keep-alive interval (default 30 s, at least 5 s).
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = interval.max(Duration::from_secs(5));
        self
    }

    /// Username and password, overriding any in the URL.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.endpoint.credentials = Some((username.into(), password.into()));
        self
    }

    /// How long to wait for the broker to accept a dead letter (default 10 s).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// Whether a v5 PUBACK reporting "no matching subscribers" for a dead letter fails it
    /// (default `true`): the broker would drop the dead letter, so the original stays
    /// unacknowledged instead of being lost.
    pub fn require_dead_letter_subscriber(mut self, require: bool) -> Self {
        self.require_dead_letter_subscriber = require;
        self
    }

    /// Largest packet accepted (default 16 MiB). A v5 broker discards larger messages for this
    /// client; on 3.1.1 a larger one breaks the connection, so keep this above any payload.
    pub fn max_packet_size(mut self, bytes: usize) -> Self {
        self.max_packet_size = bytes;
        self
    }

    /// Checks what rumqttc would panic on or the broker would refuse, and resolves defaults.
    pub(crate) fn validate(&self) -> Result<String, Error> {
        if let Some(e) = &self.url_error {
            return Err(invalid(e.clone()));
        }
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

    pub(crate) fn v5_options(&self, client_id: &str, persistent: bool) -> v5::MqttOptions {
        let mut o = v5::MqttOptions::new(client_id, &self.endpoint.host, self.endpoint.port);
        o.set_keep_alive(self.keep_alive)
            .set_manual_acks(true)
            .set_clean_start(!persistent)
            .set_max_packet_size(Some(
                u32::try_from(self.max_packet_size).unwrap_or(u32::MAX),
            ))
            // rumqttc preallocates one slot per possible outgoing packet ID; a consumer publishes
            // nothing and the publisher one message at a time.
            .set_outgoing_inflight_upper_limit(16)
            .set_request_channel_capacity(usize::from(self.max_in_flight) + 16);
        if persistent {
            let secs = u32::try_from(self.session_expiry.as_secs()).unwrap_or(u32::MAX);
            o.set_session_expiry_interval(Some(secs.max(1)))
                .set_receive_maximum(Some(self.max_in_flight));
        }
        if let Some((u, p)) = &self.endpoint.credentials {
            o.set_credentials(u, p);
        }
        o
    }

    pub(crate) fn v311_options(&self, client_id: &str, persistent: bool) -> rumqttc::MqttOptions {
        let mut o = rumqttc::MqttOptions::new(client_id, &self.endpoint.host, self.endpoint.port);
        o.set_keep_alive(self.keep_alive)
            .set_manual_acks(true)
            .set_clean_session(!persistent)
            .set_max_packet_size(self.max_packet_size, self.max_packet_size)
            .set_inflight(16)
            .set_request_channel_capacity(usize::from(self.max_in_flight) + 16);
        if let Some((u, p)) = &self.endpoint.credentials {
            o.set_credentials(u, p);
        }
        o
    }
}

/// Host, port and credentials from an `mqtt://` URL.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) credentials: Option<(String, String)>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Configs get logged; the password must not be.
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("username", &self.credentials.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl Default for Endpoint {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 1883,
            credentials: None,
        }
    }
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        // Errors quote the URL, which may hold the password.
        let shown = || idem_core::redact_url(url);
        let rest = url
            .strip_prefix("mqtt://")
            .or_else(|| url.strip_prefix("tcp://"))
            .ok_or_else(|| {
                format!("unsupported MQTT URL {:?}: expected mqtt://[user[:password]@]host[:port] (TLS, mqtts://, is not supported yet)", shown())
            })?;
        let rest = rest.trim_end_matches('/');
        let (credentials, hostport) = match rest.rsplit_once('@') {
            Some((cred, hp)) => {
                let (u, p) = cred.split_once(':').unwrap_or((cred, ""));
                (Some((u.to_owned(), p.to_owned())), hp)
            }
            None => (None, rest),
        };
        let (host, port) = match hostport.strip_prefix('[') {
            // [IPv6]:port
            Some(v6) => {
                let (h, after) = v6
                    .split_once(']')
                    .ok_or_else(|| format!("unclosed [ in MQTT URL {:?}", shown()))?;
                (h, after.strip_prefix(':'))
            }
            None => match hostport.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            },
        };
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| format!("invalid port in MQTT URL {:?}", shown()))?,
            None => 1883,
        };
        if host.is_empty() {
            return Err(format!("no host in MQTT URL {:?}", shown()));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            credentials,
        })
    }
}

/// The filter without its `$share/<group>/` prefix: what topics are matched against.
pub(crate) fn subscribed_filter(filter: &str) -> &str {
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
            "no default dead-letter topic for filter {filter:?}: configure MqttConfig::dead_letter_topic with a topic outside the filter"
        )));
    }
    Ok(topic)
}

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidConfig, msg.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let e = Endpoint::parse("mqtt://u:p@broker:1884").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("broker", 1884));
        assert_eq!(e.credentials, Some(("u".to_owned(), "p".to_owned())));
        let e = Endpoint::parse("tcp://127.0.0.1").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 1883));
        let e = Endpoint::parse("mqtt://[::1]:1884").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 1884));
        assert!(!format!("{:?}", Endpoint::parse("mqtt://u:secret@h").unwrap()).contains("secret"));
        assert!(Endpoint::parse("http://x").is_err());
        assert!(Endpoint::parse("mqtt://x:notaport").is_err());
    }

    #[test]
    fn default_dead_letter_topics_stay_outside_the_filter() {
        let dl = |f: &str| MqttConfig::new("mqtt://h", "c", f).validate();
        assert_eq!(dl("orders").unwrap(), "orders/dead-letter");
        assert_eq!(
            dl("$share/g/sensors/+/temp").unwrap(),
            "sensors/dead-letter"
        );
        assert!(dl("orders/#").is_err());
        assert!(dl("#").is_err());
        assert!(
            MqttConfig::new("mqtt://h", "c", "orders/#")
                .dead_letter_topic("orders/x")
                .validate()
                .is_err()
        );
        assert!(
            MqttConfig::new("mqtt://h", "", "orders")
                .validate()
                .is_err()
        );
    }
}
