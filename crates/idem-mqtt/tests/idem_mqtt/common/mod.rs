//! Helpers shared by the MQTT tests: source builders with short session expiry, session
//! cleanup, and a dead-letter reader.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use idem_consumer::{Delivery, Source};
use idem_mqtt::{MqttDelivery, MqttSource, MqttSourceBuilder};

/// The env var and, when set, its URL.
pub fn url(test: &str) -> Option<String> {
    idem_testkit::service_url(idem_testkit::services::MQTT, test)
}

/// A consumer whose session outlives the test only briefly if teardown fails.
pub fn builder(client_id: &str, filter: &str) -> MqttSourceBuilder {
    MqttSource::builder(filter, client_id).session_expiry(Duration::from_secs(600))
}

/// Deletes the brokers' sessions for `ids`: connecting with clean start discards a session,
/// and with no expiry interval the new one ends with the connection.
pub async fn purge_sessions(url: &str, ids: &[String]) {
    for id in ids {
        if let Err(e) = idem_mqtt::end_session(url, id).await {
            eprintln!("could not purge MQTT session {id}: {e}");
        }
    }
}

/// Waits up to `timeout` for `n` deliveries from `source`, acknowledging each.
pub async fn take(source: &mut MqttSource, n: usize, timeout: Duration) -> Vec<MqttDelivery> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(timeout, async {
        while out.len() < n {
            match source.next(n - out.len()).await {
                Ok(batch) if batch.is_empty() => break,
                Ok(batch) => out.extend(batch),
                Err(e) => eprintln!("next failed: {e}"),
            }
        }
    })
    .await;
    out
}

/// Acknowledges every delivery.
pub async fn ack_all(deliveries: Vec<MqttDelivery>) {
    for d in deliveries {
        d.ack().await.expect("ack");
    }
}
