//! The consuming side: one connection, one channel (prefetch, publisher confirms for dead
//! letters), one manual-ack consumer on one queue, rebuilt from scratch after any failure.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use idem_consumer::{IdSource, Source};
use idem_core::Error;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::delivery::AmqpDelivery;
use crate::error::{broker, config, short_string, unavailable};

const DEFAULT_PREFETCH: u16 = 64;
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// What a source and its deliveries share: validated names and timeouts.
pub(crate) struct Settings {
    pub(crate) uri: AMQPUri,
    /// The URL as logs and errors show it, without its secrets.
    pub(crate) broker: String,
    pub(crate) queue: ShortString,
    pub(crate) prefetch: u16,
    pub(crate) dead_letter_exchange: ShortString,
    pub(crate) dead_letter_routing_key: ShortString,
    pub(crate) connect_timeout: Duration,
    pub(crate) confirm_timeout: Duration,
    pub(crate) connection_name: String,
}

/// The URI holds the password; logs get the redacted URL.
impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("broker", &self.broker)
            .field("queue", &self.queue.as_str())
            .field("prefetch", &self.prefetch)
            .field("dead_letter_exchange", &self.dead_letter_exchange.as_str())
            .field(
                "dead_letter_routing_key",
                &self.dead_letter_routing_key.as_str(),
            )
            .field("connect_timeout", &self.connect_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish()
    }
}

pub(crate) fn parse_url(url: &str) -> Result<AMQPUri, Error> {
    // The parse error may quote the URL, password included; say what is wrong without it.
    url.parse::<AMQPUri>().map_err(|_| {
        config("invalid AMQP URL; expected amqp://user:password@host:port/vhost".to_owned())
    })
}

/// Configures an [`AmqpSource`]. Start from [`AmqpSource::builder`] or
/// [`Topology::source`](crate::Topology::source).
#[derive(Clone)]
pub struct AmqpSourceBuilder {
    url: String,
    queue: String,
    prefetch: u16,
    dead_letter_exchange: Option<String>,
    dead_letter_routing_key: Option<String>,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    connection_name: Option<String>,
}

impl fmt::Debug for AmqpSourceBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSourceBuilder")
            .field("broker", &idem_core::redact_url(&self.url))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("dead_letter_routing_key", &self.dead_letter_routing_key)
            .finish_non_exhaustive()
    }
}

impl AmqpSourceBuilder {
    /// How many unacknowledged deliveries the broker may push ahead (`basic.qos`, default 64;
    /// 0 is raised to 1 because AMQP reads 0 as "unlimited"). Keep it at least the runner's
    /// concurrency (or batch size), or the runner waits on the broker.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
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

    /// Validates the settings without connecting: the first [`Source::next`] connects, and a
    /// broker that is down at startup is retried by the runner like any outage.
    pub fn build(self) -> Result<AmqpSource, Error> {
        let uri = parse_url(&self.url)?;
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
        Ok(AmqpSource {
            settings: Arc::new(Settings {
                uri,
                broker: idem_core::redact_url(&self.url),
                queue,
                prefetch: self.prefetch,
                dead_letter_exchange,
                dead_letter_routing_key,
                connect_timeout: self.connect_timeout,
                confirm_timeout: self.confirm_timeout,
                connection_name,
            }),
            session: None,
        })
    }

    /// Validates the settings and connects now, so a wrong URL, wrong credentials or a
    /// missing queue fail at startup.
    pub async fn connect(self) -> Result<AmqpSource, Error> {
        let mut source = self.build()?;
        source.session = Some(Session::open(&source.settings).await?);
        Ok(source)
    }
}

/// One live consumer. Deliveries get only a weak handle to the channel so that dropping the
/// source closes the connection even while deliveries are alive: a dropped source behaves
/// like a crashed process and the broker requeues everything unacknowledged.
struct Session {
    consumer: lapin::Consumer,
    channel: Arc<Channel>,
    connection: Connection,
}

impl Session {
    async fn open(settings: &Settings) -> Result<Session, Error> {
        let open = async {
            let (connection, channel) =
                connect_channel(settings.uri.clone(), &settings.connection_name).await?;
            channel
                .basic_qos(settings.prefetch, BasicQosOptions::default())
                .await
                .map_err(|e| unavailable("basic.qos", e))?;
            // Dead letters are published on this channel and must be confirmed before the
            // original is acked.
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| unavailable("confirm.select", e))?;
            let consumer = channel
                .basic_consume(
                    settings.queue.clone(),
                    ShortString::default(),
                    BasicConsumeOptions {
                        no_ack: false,
                        ..BasicConsumeOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| unavailable(&format!("basic.consume on {}", settings.queue), e))?;
            Ok(Session {
                consumer,
                channel: Arc::new(channel),
                connection,
            })
        };
        let session = tokio::time::timeout(settings.connect_timeout, open)
            .await
            .map_err(|_| {
                broker(format!(
                    "AMQP connect to {} timed out after {:?}",
                    settings.broker, settings.connect_timeout
                ))
            })??;
        tracing::info!(broker = %settings.broker, queue = %settings.queue, prefetch = settings.prefetch, "AMQP consumer started");
        Ok(session)
    }
}

/// Consumes one RabbitMQ queue with manual acknowledgements; see the crate docs.
///
/// Reconnects by itself: when the connection or channel fails, [`Source::next`] returns one
/// `Unavailable` error (the runner backs off) and the following call opens a new connection,
/// channel and consumer. Everything unacknowledged on the old connection is requeued by the
/// broker and comes back marked redelivered.
pub struct AmqpSource {
    settings: Arc<Settings>,
    session: Option<Session>,
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSource")
            .field("settings", &self.settings)
            .field("connected", &self.session.is_some())
            .finish()
    }
}

impl AmqpSource {
    /// A source consuming `queue` on the broker at `url`
    /// (`amqp://user:password@host:5672/%2f`; `amqps://` for TLS).
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> AmqpSourceBuilder {
        AmqpSourceBuilder {
            url: url.into(),
            queue: queue.into(),
            prefetch: DEFAULT_PREFETCH,
            dead_letter_exchange: None,
            dead_letter_routing_key: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connection_name: None,
        }
    }

    /// The queue being consumed.
    pub fn queue(&self) -> &str {
        self.settings.queue.as_str()
    }

    /// The current connection, if one is open: for health checks (`status()`), or to close
    /// it deliberately.
    pub fn connection(&self) -> Option<&Connection> {
        self.session.as_ref().map(|s| &s.connection)
    }

    fn wrap(&self, d: lapin::message::Delivery, channel: &Arc<Channel>) -> AmqpDelivery {
        AmqpDelivery::new(d, self.settings.clone(), Arc::downgrade(channel))
    }
}

impl Source for AmqpSource {
    type Delivery = AmqpDelivery;

    fn broker(&self) -> &'static str {
        "amqp"
    }

    fn default_id_source(&self) -> IdSource {
        IdSource::BrokerId
    }

    async fn next(&mut self, max: usize) -> Result<Vec<AmqpDelivery>, Error> {
        // Cancel safety: an interrupted connect drops its half-open connection, and lapin's
        // consumer stream hands a delivery out only when polled to completion.
        if self.session.is_none() {
            self.session = Some(Session::open(&self.settings).await?);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(broker("AMQP session missing after connect".to_owned()));
        };
        let first = match session.consumer.next().await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                self.session = None;
                return Err(unavailable(&format!("consume from {}", self.queue()), e));
            }
            None => {
                self.session = None;
                return Err(broker(format!(
                    "AMQP consumer on {} was cancelled (channel closed, or queue deleted)",
                    self.queue()
                )));
            }
        };
        let channel = session.channel.clone();
        let mut ready = vec![first];
        // Drain what the broker already pushed (up to the prefetch) without waiting for more.
        while ready.len() < max {
            match session.consumer.next().now_or_never() {
                Some(Some(Ok(d))) => ready.push(d),
                // The stream ends after an error, so the next call notices and reconnects;
                // what was already received goes out now.
                Some(Some(Err(e))) => {
                    tracing::warn!(queue = %self.settings.queue, error = %e, "AMQP consumer failed");
                    break;
                }
                Some(None) | None => break,
            }
        }
        Ok(ready.into_iter().map(|d| self.wrap(d, &channel)).collect())
    }

    async fn close(mut self) -> Result<(), Error> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        if !session.connection.status().connected() {
            return Ok(());
        }
        // Closing the connection requeues whatever was prefetched but never handed out.
        session
            .connection
            .close(200, "idem consumer shutting down".into())
            .await
            .map_err(|e| unavailable("connection.close", e))
    }
}

/// Opens a connection named `name` (shown in the management UI) and one channel on it.
pub(crate) async fn connect_channel(
    uri: AMQPUri,
    name: &str,
) -> Result<(Connection, Channel), Error> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let connection = Connection::connect_uri(uri, props)
        .await
        .map_err(|e| unavailable("connect", e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| unavailable("channel.open", e))?;
    Ok((connection, channel))
}
