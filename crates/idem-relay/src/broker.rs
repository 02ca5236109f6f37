//! [`BrokerPublisher`]: the publisher a long-running relay uses for a broker URL, which
//! outlives the broker's restarts and creates destinations on a connection of their own.

use std::sync::Arc;

use idem_any::{AnyProducer, Broker, BrokerUrl};
use idem_core::Error;
use idem_core::outbox::Outgoing;
use tokio::sync::Mutex;

use crate::Publish;
use crate::verdict::Verdict;

/// Publishes through an [`AnyProducer`] for `url`, connected on first use, and:
///
/// - **reconnects AMQP** after a failed publish: a lapin channel or connection that the broker
///   closed (a restart, a refused declaration) stays closed, so the next publish opens a new
///   producer. The other families' clients reconnect on their own and are kept.
/// - **creates destinations on a connection of their own** ([`BrokerUrl::ensure_destination`],
///   the declarations a consumer makes): a declaration the broker refuses (an AMQP queue that
///   exists with other arguments) closes that connection, not the one publishing.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// let url = idem_any::BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f")?;
/// let publisher = idem_relay::BrokerPublisher::new(url, "orders-relay");
/// # let _ = publisher; Ok(()) }
/// ```
#[derive(Debug)]
pub struct BrokerPublisher {
    url: BrokerUrl,
    client_id: String,
    producer: Mutex<Option<Arc<AnyProducer>>>,
}

impl BrokerPublisher {
    /// A publisher for `url`; `client_id` names its connection where the family needs a name
    /// (MQTT: unique among the broker's clients).
    pub fn new(url: BrokerUrl, client_id: impl Into<String>) -> Self {
        Self {
            url,
            client_id: client_id.into(),
            producer: Mutex::new(None),
        }
    }

    /// Connects now rather than on the first publish, to fail at start-up on a broker that
    /// cannot be reached.
    ///
    /// # Errors
    /// As [`AnyProducer::connect`].
    pub async fn connect(&self) -> Result<(), Error> {
        self.producer().await.map(|_| ())
    }

    async fn producer(&self) -> Result<Arc<AnyProducer>, Error> {
        // Held while connecting: concurrent publishes wait for one connection, not open many.
        let mut slot = self.producer.lock().await;
        if let Some(p) = slot.as_ref() {
            return Ok(Arc::clone(p));
        }
        let p = Arc::new(AnyProducer::connect(&self.url, &self.client_id).await?);
        *slot = Some(Arc::clone(&p));
        Ok(p)
    }
}

impl Publish for BrokerPublisher {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        let producer = self.producer().await?;
        let result = Publish::publish(producer.as_ref(), msg).await;
        if let Err(e) = &result
            && producer.broker() == Broker::Amqp
            && Verdict::of(e) == Verdict::Retry
        {
            let mut slot = self.producer.lock().await;
            // Only the producer that failed: another publish may have replaced it already.
            if slot.as_ref().is_some_and(|p| Arc::ptr_eq(p, &producer)) {
                tracing::debug!(error = %e, "AMQP publish failed; the next publish reconnects");
                *slot = None;
            }
        }
        result
    }

    async fn ensure_destination(&self, destination: &str) -> Result<(), Error> {
        self.url.ensure_destination(destination).await
    }
}
