//! Ending a persistent session: retiring a replica's client ID, or cleaning up after tests.

use std::time::Duration;

use idem_core::Error;
use rumqttc::v5::{self, mqttbytes::v5::Packet};

use crate::config::{MqttConfig, invalid};
use crate::wire::unavailable;

/// Discards the broker's persistent session for `client_id`, with the messages queued in it:
/// connecting with clean start ends a session, and without an expiry interval the new one
/// ends with the connection. For a replica retired for good, and for tests; a running
/// consumer's session is what redelivers its unacknowledged messages.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a bad URL,
/// [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) when the broker cannot be
/// reached within 5 s.
pub async fn end_session(url: &str, client_id: &str) -> Result<(), Error> {
    let config = MqttConfig::new(url, client_id, "#");
    if let Some(e) = &config.url_error {
        return Err(invalid(e.clone()));
    }
    let (client, mut events) = v5::AsyncClient::new(config.v5_options(client_id, false), 4);
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match events.poll().await {
                Ok(v5::Event::Incoming(Packet::ConnAck(_))) => {
                    let _ = client.try_disconnect();
                }
                Ok(v5::Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(unavailable("ending an MQTT session", e)),
            }
        }
    })
    .await;
    match ended {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            idem_core::ErrorKind::Unavailable,
            format!("ending MQTT session {client_id}: no answer within 5 s"),
        )),
    }
}
