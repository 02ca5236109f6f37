//! The broker-side object MQTT has: a persistent session. Creating one that keeps what is
//! published to a topic (where dead letters go), and ending one for good.

use std::time::Duration;

use idem_consumer::ReconnectBackoff;
use idem_core::{Error, ErrorKind};
use rumqttc::v5::{self, mqttbytes::v5::Packet};

use crate::config::{Config, Options};
use crate::error::{invalid, refused, unavailable};
use crate::wire::{self, Polled};

/// How long the broker may take to end a session.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the broker may take to grant a session's subscription (as a source's connect),
/// every try included.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections tried when the broker closes them before the subscription is granted.
const ENSURE_TRIES: u32 = 8;
/// The jittered wait between two tries: from 50 ms doubling to 1 s.
const ENSURE_FIRST_WAIT: Duration = Duration::from_millis(50);
const ENSURE_MAX_WAIT: Duration = Duration::from_secs(1);

/// Creates (or resumes) the persistent session `client_id` subscribed to `filter` at QoS 1,
/// then disconnects: the broker keeps whatever is published to `filter` in that session (for
/// seven days of disconnection, MQTT v5) until a consumer with the same client ID collects it.
/// An MQTT broker keeps nothing for a topic nobody subscribes to, so this is how a
/// dead-letter topic gets a keeper before any dead letter is published. Messages already
/// waiting in the session stay there.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// idem_mqtt::ensure_session("mqtt://127.0.0.1:1883", "billing-dead-letters", "payments/dead-letter")
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a bad URL, client ID or filter, or a subscription the
/// broker refuses; [`ErrorKind::Unavailable`] when the broker cannot be reached or does not
/// answer within 15 s. A connection the broker closes before the subscription is granted (a
/// replica of the same service ensuring the same session at the same moment takes it over)
/// is tried again after a jittered wait, 8 tries in all.
pub async fn ensure_session(url: &str, client_id: &str, filter: &str) -> Result<(), Error> {
    let config = Config::new(url, Options::default())?;
    if client_id.is_empty() {
        return Err(invalid(
            "a persistent MQTT session needs a non-empty client ID",
        ));
    }
    if !rumqttc::valid_filter(filter) {
        return Err(invalid(format!(
            "{filter:?} is not a valid MQTT topic filter"
        )));
    }
    // Replicas of one service ensure the same keeper session as they start: each connection
    // with the client ID takes the session over, and the broker closes the one before, often
    // before its subscription was granted. Tried again after a jittered wait, so the
    // replicas' attempts spread out and each completes once.
    let mut backoff = ReconnectBackoff::new(ENSURE_FIRST_WAIT, ENSURE_MAX_WAIT);
    let ensured = tokio::time::timeout(SUBSCRIBE_TIMEOUT, async {
        let mut tries = 0;
        loop {
            tries += 1;
            match ensure_once(&config, client_id, filter).await {
                Err(e) if e.kind() == ErrorKind::Unavailable && tries < ENSURE_TRIES => {
                    let wait = backoff.next_delay();
                    tracing::debug!(client_id, tries, error = %e, ?wait, "MQTT session setup interrupted; trying again");
                    tokio::time::sleep(wait).await;
                }
                r => return r,
            }
        }
    })
    .await;
    match ensured {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("creating MQTT session {client_id}: no answer within {SUBSCRIBE_TIMEOUT:?}"),
        )),
    }
}

/// One connection that subscribes the session and disconnects. `Unavailable` when the
/// connection failed or was closed before that (another client took the session over).
async fn ensure_once(config: &Config, client_id: &str, filter: &str) -> Result<(), Error> {
    let (client, mut events) = wire::open(config, client_id, true);
    loop {
        match events.poll().await? {
            // The request channel has room for far more than one request, so queueing
            // the subscribe here does not wait on the loop it is polled by.
            Polled::ConnAck { .. } => client.subscribe(filter).await?,
            Polled::SubAck(Ok(())) => client.disconnect().await?,
            Polled::SubAck(Err(reason)) => {
                return Err(refused(
                    format_args!("subscribing to {filter:?} at QoS 1"),
                    reason,
                ));
            }
            Polled::Disconnected => return Ok(()),
            _ => {}
        }
    }
}

/// Discards the broker's persistent session for `client_id`, with the messages queued in it:
/// connecting with clean start ends a session, and without an expiry interval the new one
/// ends with the connection. For a replica retired for good, and for tests; a running
/// consumer's session is what redelivers its unacknowledged messages.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a bad URL, [`ErrorKind::Unavailable`] when the broker
/// cannot be reached within 5 s.
pub async fn end_session(url: &str, client_id: &str) -> Result<(), Error> {
    let config = Config::new(url, Options::default())?;
    let (client, mut events) = v5::AsyncClient::new(config.v5_options(client_id, false), 4);
    let ended = tokio::time::timeout(ANSWER_TIMEOUT, async {
        loop {
            match events.poll().await {
                Ok(v5::Event::Incoming(Packet::ConnAck(_))) => {
                    let _ = client.try_disconnect();
                }
                Ok(v5::Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(unavailable(format_args!("ending session {client_id}"), e)),
            }
        }
    })
    .await;
    match ended {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("ending MQTT session {client_id}: no answer within 5 s"),
        )),
    }
}
