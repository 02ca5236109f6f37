//! `--broker` URLs: the one table from URL scheme to broker family, and how a URL is shown.

use std::fmt;
use std::str::FromStr;

use idem_core::{Error, ErrorKind};

/// The URL schemes [`BrokerUrl::parse`] understands.
pub const SCHEMES: &str = "nats://, amqp://, amqps://, kafka://host:port[,host:port…], redis://, rediss://, mqtt://, tcp://";

/// The broker families idem has an adapter for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Broker {
    /// NATS JetStream (`idem-nats`).
    Nats,
    /// RabbitMQ and other AMQP 0-9-1 brokers (`idem-amqp`).
    Amqp,
    /// Kafka and Kafka-compatible brokers (`idem-kafka`).
    Kafka,
    /// Redis Streams (`idem-redis-streams`).
    RedisStreams,
    /// MQTT 5 and 3.1.1 brokers (`idem-mqtt`).
    Mqtt,
}

impl Broker {
    /// The family's name as its source reports it to metrics and logs
    /// ([`Source::broker`](idem_consumer::Source::broker)): `nats`, `amqp`, `kafka`, `redis`,
    /// `mqtt`.
    pub fn name(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::Amqp => "amqp",
            Broker::Kafka => "kafka",
            Broker::RedisStreams => "redis",
            Broker::Mqtt => "mqtt",
        }
    }

    /// The cargo feature of this crate that compiles the family's adapter in.
    pub fn feature(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::Amqp => "amqp",
            Broker::Kafka => "kafka",
            Broker::RedisStreams => "redis-streams",
            Broker::Mqtt => "mqtt",
        }
    }

    /// Whether this build has the family's adapter.
    pub fn is_compiled(self) -> bool {
        match self {
            Broker::Nats => cfg!(feature = "nats"),
            Broker::Amqp => cfg!(feature = "amqp"),
            Broker::Kafka => cfg!(feature = "kafka"),
            Broker::RedisStreams => cfg!(feature = "redis-streams"),
            Broker::Mqtt => cfg!(feature = "mqtt"),
        }
    }

    /// The family a URL scheme names (any case); `None` for a scheme no adapter speaks.
    pub fn from_scheme(scheme: &str) -> Option<Self> {
        Some(match scheme.to_ascii_lowercase().as_str() {
            "nats" => Broker::Nats,
            "amqp" | "amqps" => Broker::Amqp,
            "kafka" => Broker::Kafka,
            "redis" | "rediss" => Broker::RedisStreams,
            "mqtt" | "tcp" => Broker::Mqtt,
            _ => return None,
        })
    }
}

/// A parsed `--broker` URL: which adapter it is for and what that adapter connects to.
///
/// `Debug` shows the URL through [`idem_redact::redact_url`]: it may hold a password or a
/// token.
///
/// ```
/// use idem_any::{Broker, BrokerUrl};
///
/// let url = BrokerUrl::parse("kafka://k1:9092,k2:9092/")?;
/// assert_eq!(url.broker(), Broker::Kafka);
/// assert_eq!(url.address(), "k1:9092,k2:9092");
///
/// let url = BrokerUrl::parse("amqp://app:hunter2@mq:5672/%2f")?;
/// assert_eq!(format!("{url:?}"), "BrokerUrl(\"amqp://app:***@mq:5672/%2f\")");
///
/// let err = BrokerUrl::parse("foo://app:hunter2@x").unwrap_err();
/// assert_eq!(err.kind(), idem_core::ErrorKind::InvalidConfig);
/// assert!(!err.to_string().contains("hunter2"));
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    broker: Broker,
    url: String,
    /// What the adapter's `connect` takes: the URL, or for Kafka the `host:port` list.
    address: String,
}

impl BrokerUrl {
    /// Reads `url`'s scheme: `nats://` (several URLs, comma-separated, for a cluster's seed
    /// servers), `amqp://`/`amqps://`, `kafka://host:port[,host:port…]`, `redis://`/`rediss://`,
    /// `mqtt://`/`tcp://`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a scheme no adapter speaks, a `kafka://` URL without
    /// hosts, or a family this build was compiled without (its cargo feature is off). The
    /// message shows the URL redacted.
    pub fn parse(url: &str) -> Result<Self, Error> {
        let scheme = url.split("://").next().unwrap_or_default();
        let Some(broker) = Broker::from_scheme(scheme).filter(|_| url.contains("://")) else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "unsupported broker URL {:?}: expected one of {SCHEMES}",
                    idem_redact::redact_url(url)
                ),
            ));
        };
        if !broker.is_compiled() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "broker URL {:?}: this build has no {} adapter (idem-any's `{}` feature)",
                    idem_redact::redact_url(url),
                    broker.name(),
                    broker.feature()
                ),
            ));
        }
        let address = match broker {
            Broker::Kafka => {
                let hosts = url
                    .split_once("://")
                    .map(|(_, h)| h.trim_end_matches('/'))
                    .unwrap_or_default();
                if hosts.is_empty() {
                    return Err(Error::new(
                        ErrorKind::InvalidConfig,
                        "kafka URL needs host:port, e.g. kafka://127.0.0.1:9092",
                    ));
                }
                hosts.to_owned()
            }
            _ => url.to_owned(),
        };
        Ok(Self {
            broker,
            url: url.to_owned(),
            address,
        })
    }

    /// The broker family.
    pub fn broker(&self) -> Broker {
        self.broker
    }

    /// The URL as given, secrets included: for handing on (to another process), never for
    /// showing.
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// What the family's adapter connects to: Kafka's `host:port[,…]` list, the URL itself
    /// otherwise.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The URL without its secrets, for logs and messages.
    pub fn redacted(&self) -> String {
        idem_redact::redact_url(&self.url)
    }
}

impl FromStr for BrokerUrl {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self, Error> {
        Self::parse(url)
    }
}

/// The URL may hold a password or a token: shown redacted.
impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BrokerUrl").field(&self.redacted()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_maps_to_its_family() {
        for (url, broker) in [
            ("nats://127.0.0.1:4222", Broker::Nats),
            ("NATS://a:4222,b:4222", Broker::Nats),
            ("amqp://guest:guest@127.0.0.1:5672/%2f", Broker::Amqp),
            ("amqps://mq", Broker::Amqp),
            ("kafka://127.0.0.1:9092", Broker::Kafka),
            ("redis://127.0.0.1:6379", Broker::RedisStreams),
            ("rediss://127.0.0.1:6379", Broker::RedisStreams),
            ("mqtt://127.0.0.1:1883", Broker::Mqtt),
            ("tcp://127.0.0.1:1883", Broker::Mqtt),
        ] {
            let parsed = BrokerUrl::parse(url).expect(url);
            assert_eq!(parsed.broker(), broker, "{url}");
            assert_eq!(parsed.as_str(), url);
        }
    }

    #[test]
    fn kafka_takes_the_host_list() {
        let url = BrokerUrl::parse("kafka://h1:9092,h2:9092/").expect("valid");
        assert_eq!(url.address(), "h1:9092,h2:9092");
        for empty in ["kafka://", "kafka:///"] {
            let err = BrokerUrl::parse(empty).expect_err(empty);
            assert_eq!(err.kind(), ErrorKind::InvalidConfig);
        }
    }

    #[test]
    fn unknown_schemes_are_refused_without_their_secrets() {
        for url in ["foo://app:hunter2@x", "nats", "", "redis:app:hunter2@x"] {
            let err = BrokerUrl::parse(url).expect_err(url);
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
            assert!(err.to_string().contains("kafka://host:port"), "{err}");
        }
    }

    #[test]
    fn debug_hides_passwords_and_tokens() {
        for url in [
            "amqp://app:hunter2@mq:5672/%2f",
            "nats://hunter2@127.0.0.1:4222",
            "redis://:hunter2@127.0.0.1:6379/0",
            "mqtt://app:hunter2@127.0.0.1:1883",
        ] {
            let parsed = BrokerUrl::parse(url).expect(url);
            let shown = format!("{parsed:?}");
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(!parsed.redacted().contains("hunter2"));
        }
    }
}
