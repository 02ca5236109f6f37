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
use crate::error::{broker, config, unavailable};

/// What a source and its deliveries share: validated names and timeouts.
pub(crate) struct Settings {
    pub(crate) uri: AMQPUri,
    /// The URL as logs and errors show it, without its secrets.
    pub(crate) broker: String,
    pub(crate) queue: ShortString,
    pub(crate) prefetch: u16,
    /// Whether the user set the prefetch: the default one warns when batches outgrow it.
    pub(crate) prefetch_chosen: bool,
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
                .map_err(|e| unavailable(format_args!("basic.consume on {}", settings.queue), e))?;
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
                    "connecting to the AMQP broker at {} timed out after {:?}",
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
    /// Whether the default prefetch was found too small for the runner's batches (said once).
    warned_prefetch: bool,
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
    /// A source with validated settings that connects on [`open`](Self::open) or on its first
    /// fetch.
    pub(crate) fn new(settings: Arc<Settings>) -> Self {
        Self {
            settings,
            session: None,
            warned_prefetch: false,
        }
    }

    /// Connects and starts consuming now.
    pub(crate) async fn open(&mut self) -> Result<(), Error> {
        self.session = Some(Session::open(&self.settings).await?);
        Ok(())
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
        if max > usize::from(self.settings.prefetch)
            && !self.settings.prefetch_chosen
            && !self.warned_prefetch
        {
            self.warned_prefetch = true;
            tracing::warn!(queue = %self.settings.queue, prefetch = self.settings.prefetch, wanted = max, "the runner asks for more deliveries at once than the default prefetch lets the broker send; set AmqpSourceBuilder::prefetch to what the runner keeps in flight (its concurrency, times the batch size with batches)");
        }
        let Some(session) = self.session.as_mut() else {
            return Err(broker(
                "the AMQP session is missing after connecting".to_owned(),
            ));
        };
        let first = match session.consumer.next().await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                self.session = None;
                return Err(unavailable(
                    format_args!("consuming from {}", self.queue()),
                    e,
                ));
            }
            None => {
                self.session = None;
                return Err(broker(format!(
                    "the AMQP consumer on {} was cancelled (channel closed, or queue deleted)",
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
        .map_err(|e| unavailable("connecting", e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| unavailable("channel.open", e))?;
    Ok((connection, channel))
}
