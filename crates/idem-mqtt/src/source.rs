//! The consumer: a task that keeps polling rumqttc's event loop (it only makes progress, pings
//! and reconnects while polled) and hands received messages to [`MqttSource::next`].

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_consumer::{DeadLetter, Delivery, IdSource, Source};
use idem_core::{Error, ErrorKind};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::{MqttConfig, Protocol};
use crate::publisher::{Publisher, dead_letter_message};
use crate::wire::{self, Client, Loop, Msg, Polled};
use crate::{MESSAGE_ID_POINTER, MESSAGE_ID_PROPERTY};

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Abandoned messages come back only with a reconnect; waiting a little gathers several
/// abandons into one reconnect instead of one each.
const REDELIVERY_DELAY: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// What the connection driver hands to `next`.
enum Item {
    Delivery {
        msg: Msg,
        generation: u64,
    },
    /// The connection broke; sent once per outage so the runner counts and logs it.
    Lost(Error),
}

/// State shared by the source, its deliveries and the driver task.
#[derive(Debug)]
struct Link {
    client: Client,
    /// Bumped on every disconnect and reconnect. A PUBACK is only meaningful on the connection
    /// the message arrived on: after a reconnect the broker resends it, and an old packet ID may
    /// already name a different message.
    generation: AtomicU64,
    /// Signalled by `abandon`: reconnect so the broker redelivers.
    abandoned: Notify,
    dead_letters: Publisher,
    dead_letter_topic: String,
    client_id: String,
}

/// A QoS 1 subscription in a persistent MQTT session; implements [`Source`].
///
/// Dropping it without [`Source::close`] cuts the connection without a DISCONNECT: the session
/// and its unacknowledged messages stay with the broker for the next connection with the same
/// client ID.
#[derive(Debug)]
pub struct MqttSource {
    link: Arc<Link>,
    rx: mpsc::UnboundedReceiver<Item>,
    driver: JoinHandle<()>,
    protocol: Protocol,
}

impl MqttSource {
    /// Connects, subscribes at QoS 1 and returns once the broker granted the subscription.
    ///
    /// Fails with [`ErrorKind::InvalidConfig`] for a bad URL, filter, client ID or a refused
    /// subscription, and [`ErrorKind::Unavailable`] when the broker cannot be reached.
    pub async fn connect(config: MqttConfig) -> Result<Self, Error> {
        let dead_letter_topic = config.validate()?;
        let (client, event_loop) = wire::open(&config, &config.client_id, true);
        let link = Arc::new(Link {
            client,
            generation: AtomicU64::new(0),
            abandoned: Notify::new(),
            dead_letters: Publisher::new(
                config.clone(),
                format!("{}-dead-letters", config.client_id),
            ),
            dead_letter_topic,
            client_id: config.client_id.clone(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let driver = tokio::spawn(drive(
            event_loop,
            link.clone(),
            config.filter.clone(),
            tx,
            ready_tx,
        ));
        let ready = tokio::time::timeout(CONNECT_TIMEOUT, ready_rx).await;
        match ready {
            Ok(Ok(Ok(()))) => Ok(Self {
                link,
                rx,
                driver,
                protocol: config.protocol,
            }),
            Ok(Ok(Err(e))) => {
                driver.abort();
                Err(e)
            }
            Ok(Err(_)) | Err(_) => {
                driver.abort();
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "MQTT: no subscription acknowledgement for {:?} within {CONNECT_TIMEOUT:?}",
                        config.filter
                    ),
                ))
            }
        }
    }

    /// The client ID, which is also the name of the persistent session.
    pub fn client_id(&self) -> &str {
        &self.link.client_id
    }

    /// Where dead letters are published.
    pub fn dead_letter_topic(&self) -> &str {
        &self.link.dead_letter_topic
    }
}

impl Drop for MqttSource {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Source for MqttSource {
    type Delivery = MqttDelivery;

    fn broker(&self) -> &'static str {
        "mqtt"
    }

    /// v5: the user property `message-id`; 3.1.1: the JSON pointer `/message_id`.
    fn default_id_source(&self) -> IdSource {
        match self.protocol {
            Protocol::V5 => IdSource::header(MESSAGE_ID_PROPERTY),
            Protocol::V311 => IdSource::json_pointer(MESSAGE_ID_POINTER),
        }
    }

    async fn next(&mut self, max: usize) -> Result<Vec<MqttDelivery>, Error> {
        let mut out = Vec::new();
        // `recv` is cancel-safe: a message not yet taken stays in the channel.
        let Some(first) = self.rx.recv().await else {
            return Ok(out);
        };
        match first {
            Item::Delivery { msg, generation } => out.push(self.delivery(msg, generation)),
            Item::Lost(e) => return Err(e),
        }
        while out.len() < max.max(1) {
            match self.rx.try_recv() {
                Ok(Item::Delivery { msg, generation }) => out.push(self.delivery(msg, generation)),
                // Already logged by the driver; the deliveries in hand matter more.
                Ok(Item::Lost(_)) => {}
                Err(_) => break,
            }
        }
        Ok(out)
    }

    async fn close(mut self) -> Result<(), Error> {
        // Acks queued before the DISCONNECT go out before it: one request channel, in order.
        let sent = self.link.client.disconnect().await;
        if sent.is_ok()
            && tokio::time::timeout(Duration::from_secs(5), &mut self.driver)
                .await
                .is_ok()
        {
            return Ok(());
        }
        tracing::warn!(client_id = %self.link.client_id, "MQTT disconnect did not complete; dropping the connection");
        sent
    }
}

impl MqttSource {
    fn delivery(&self, msg: Msg, generation: u64) -> MqttDelivery {
        MqttDelivery {
            msg,
            generation,
            link: self.link.clone(),
        }
    }
}

/// Keeps the connection alive: polls, forwards messages, subscribes when the session is new,
/// reconnects with backoff, and reconnects on purpose after an abandon.
async fn drive(
    mut event_loop: Loop,
    link: Arc<Link>,
    filter: String,
    tx: mpsc::UnboundedSender<Item>,
    ready: oneshot::Sender<Result<(), Error>>,
) {
    let mut ready = Some(ready);
    let mut backoff = MIN_BACKOFF;
    let mut failing = false;
    let mut reconnect_at: Option<Instant> = None;
    loop {
        let polled = tokio::select! {
            r = event_loop.poll() => r,
            // Dropping a poll future midway at worst loses a PUBACK or ping, which a reconnect
            // repairs (redelivery, duplicate); abandons are rare.
            _ = link.abandoned.notified(), if reconnect_at.is_none() => {
                reconnect_at = Some(Instant::now() + REDELIVERY_DELAY);
                continue;
            }
            _ = tokio::time::sleep_until(reconnect_at.unwrap_or_else(Instant::now)), if reconnect_at.is_some() => {
                reconnect_at = None;
                link.generation.fetch_add(1, Ordering::SeqCst);
                event_loop.drop_connection();
                tracing::info!(client_id = %link.client_id, "reconnecting so the broker redelivers abandoned messages");
                continue;
            }
        };
        match polled {
            Ok(Polled::ConnAck { session_present }) => {
                link.generation.fetch_add(1, Ordering::SeqCst);
                backoff = MIN_BACKOFF;
                if failing {
                    tracing::info!(client_id = %link.client_id, session_present, "MQTT connection restored");
                    failing = false;
                }
                // A resumed session still holds the subscription; a fresh one (first start,
                // expired session) needs it again. The first connect always subscribes, in case
                // the filter changed since the session was created.
                if ready.is_some() || !session_present {
                    let client = link.client.clone();
                    let filter = filter.clone();
                    // Not awaited here: the request channel is drained by this very loop.
                    tokio::spawn(async move {
                        if let Err(e) = client.subscribe(&filter).await {
                            tracing::warn!(error = %e, "MQTT subscribe request failed");
                        }
                    });
                }
            }
            Ok(Polled::SubAck(result)) => {
                let result = result.map_err(|reason| {
                    Error::new(
                        ErrorKind::InvalidConfig,
                        format!(
                            "the broker refused the QoS 1 subscription to {filter:?}: {reason}"
                        ),
                    )
                });
                match (ready.take(), result) {
                    (Some(r), Ok(())) => {
                        let _ = r.send(Ok(()));
                    }
                    (Some(r), Err(e)) => {
                        let _ = r.send(Err(e));
                        return;
                    }
                    (None, Ok(())) => {}
                    (None, Err(e)) => {
                        tracing::error!(client_id = %link.client_id, error = %e, "re-subscribing failed");
                        let _ = tx.send(Item::Lost(e));
                    }
                }
            }
            Ok(Polled::Publish(msg)) => {
                let generation = link.generation.load(Ordering::SeqCst);
                if tx.send(Item::Delivery { msg, generation }).is_err() {
                    return; // the source is gone
                }
            }
            Ok(Polled::Disconnected) => return,
            Ok(_) => {}
            Err(e) => {
                link.generation.fetch_add(1, Ordering::SeqCst);
                if let Some(r) = ready.take() {
                    let _ = r.send(Err(e));
                    return;
                }
                if !failing {
                    tracing::warn!(client_id = %link.client_id, error = %e, "MQTT connection lost; reconnecting");
                    failing = true;
                    if tx.send(Item::Lost(e)).is_err() {
                        return;
                    }
                } else {
                    tracing::debug!(client_id = %link.client_id, error = %e, retry_in = ?backoff, "MQTT reconnect failed");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// One MQTT message; settled by the runner.
#[derive(Debug)]
pub struct MqttDelivery {
    msg: Msg,
    generation: u64,
    link: Arc<Link>,
}

impl MqttDelivery {
    /// The topic it was published to.
    pub fn topic(&self) -> String {
        self.msg.topic()
    }

    /// The v5 user properties (empty on 3.1.1).
    pub fn user_properties(&self) -> &[(String, String)] {
        self.msg.user_properties()
    }
}

impl Delivery for MqttDelivery {
    fn payload(&self) -> &[u8] {
        self.msg.payload()
    }

    /// The first v5 user property with this name.
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.msg
            .user_properties()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| Cow::Borrowed(v.as_bytes()))
    }

    /// MQTT only says "sent before" (the DUP flag), not how often: 1 or 0.
    fn previous_deliveries(&self) -> u32 {
        u32::from(self.msg.dup())
    }

    fn origin(&self) -> String {
        format!("topic {} pkid {}", self.msg.topic(), self.msg.pkid())
    }

    async fn ack(self) -> Result<(), Error> {
        if self.link.generation.load(Ordering::SeqCst) != self.generation {
            // The connection it came on is gone; the broker resends it on the current one,
            // where that copy (a duplicate by then) is acknowledged. Acking the old packet ID
            // here could acknowledge a different message that reuses it.
            tracing::debug!(origin = %self.origin(), "not acknowledging on a newer connection; the broker redelivers and the duplicate is acked");
            return Ok(());
        }
        self.link.client.ack(&self.msg).await
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        let (payload, properties) =
            dead_letter_message(&self.msg, reason, self.link.dead_letters.protocol());
        self.link
            .dead_letters
            .publish(&self.link.dead_letter_topic, payload, properties)
            .await?;
        self.ack().await
    }

    async fn abandon(self) {
        self.link.abandoned.notify_one();
    }
}
