//! Configuring an [`AmqpSource`]: the queue, its dead-letter route, prefetch and timeouts.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Error;

use crate::error::short_string;
use crate::source::{AmqpSource, Settings, parse_url};

/// Default [`AmqpSourceBuilder::prefetch`].
pub const DEFAULT_PREFETCH: u16 = 64;
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Configures an [`AmqpSource`]; created by [`AmqpSource::builder`] or
/// [`Topology::source`](crate::Topology::source), finished by [`connect`](Self::connect) or
/// [`connect_lazy`](Self::connect_lazy).
#[derive(Debug, Clone)]
#[must_use]
pub struct AmqpSourceBuilder {
    queue: String,
    prefetch: Option<u16>,
    dead_letter_exchange: Option<String>,
    dead_letter_routing_key: Option<String>,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    connection_name: Option<String>,
}

impl AmqpSource {
    /// Configures a source consuming `queue`.
    pub fn builder(queue: impl Into<String>) -> AmqpSourceBuilder {
        AmqpSourceBuilder {
            queue: queue.into(),
            prefetch: None,
            dead_letter_exchange: None,
            dead_letter_routing_key: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connection_name: None,
        }
    }
}

impl AmqpSourceBuilder {
    /// How many unacknowledged deliveries the broker may push ahead (`basic.qos`, default
    /// [`DEFAULT_PREFETCH`], 64; 0 is raised to 1 because AMQP reads 0 as "unlimited").
    ///
    /// Every delivery the runner holds counts against it until it is settled, so size it to
    /// what the runner keeps in flight: at least its concurrency, and with batches
    /// (`Consumer::batch(n)`) at least `n` × concurrency. Below one batch no batch ever fills;
    /// below `n` × concurrency the batches wait on each other. A source left at the default
    /// logs a warning when the runner asks for more deliveries at once than that.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = Some(n.max(1));
        self
    }

    /// The exchange dead letters are published to (default `<queue>.dlx`, as declared by
    /// [`Topology::new`](crate::Topology::new)).
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// The routing key dead letters are published with (default: the queue's name).
    pub fn dead_letter_routing_key(mut self, key: impl Into<String>) -> Self {
        self.dead_letter_routing_key = Some(key.into());
        self
    }

    /// How long connecting, opening the channel and starting the consumer may take before the
    /// attempt counts as failed (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a dead letter waits for the broker's publisher confirm (default 30 s). A
    /// broker under a memory or disk alarm blocks publishers; the delivery is then handed back.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// The connection name shown in the RabbitMQ management UI (default
    /// `idem consumer: <queue>`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Connects to the broker at `url` (`amqp://user:password@host:5672/%2f`; `amqps://` for
    /// TLS) and starts consuming now, so a wrong URL, wrong credentials or a missing queue
    /// fail at startup.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a malformed URL
    /// or a name AMQP cannot carry; [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable)
    /// when the broker cannot be reached, refuses the login or has no such queue.
    pub async fn connect(self, url: &str) -> Result<AmqpSource, Error> {
        let mut source = self.connect_lazy(url)?;
        source.open().await?;
        Ok(source)
    }

    /// Validates the settings without connecting: the first [`Source::next`
    /// ](idem_consumer::Source::next) connects, so a broker that is down at startup is retried
    /// by the runner like any outage.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a malformed URL
    /// or a name AMQP cannot carry.
    pub fn connect_lazy(self, url: &str) -> Result<AmqpSource, Error> {
        let uri = parse_url(url)?;
        let queue = short_string("queue name", &self.queue)?;
        let dlx = self
            .dead_letter_exchange
            .unwrap_or_else(|| format!("{}.dlx", self.queue));
        let dead_letter_exchange = short_string("dead-letter exchange", &dlx)?;
        let rk = self.dead_letter_routing_key.unwrap_or(self.queue.clone());
        let dead_letter_routing_key = short_string("dead-letter routing key", &rk)?;
        let connection_name = self
            .connection_name
            .unwrap_or_else(|| format!("idem consumer: {}", self.queue));
        Ok(AmqpSource::new(Arc::new(Settings {
            uri,
            broker: idem_redact::redact_url(url),
            queue,
            prefetch: self.prefetch.unwrap_or(DEFAULT_PREFETCH),
            prefetch_chosen: self.prefetch.is_some(),
            dead_letter_exchange,
            dead_letter_routing_key,
            connect_timeout: self.connect_timeout,
            confirm_timeout: self.confirm_timeout,
            connection_name,
        })))
    }
}

#[cfg(test)]
mod tests {
    use crate::AmqpSource;

    /// Sources and their settings get logged; the URL's password must not be.
    #[test]
    fn debug_hides_the_password() {
        let source = AmqpSource::builder("orders")
            .connect_lazy("amqp://app:hunter2@127.0.0.1:5672/%2f?heartbeat=10")
            .expect("valid settings");
        let shown = format!("{source:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("app:***@127.0.0.1"), "{shown}");
    }
}
