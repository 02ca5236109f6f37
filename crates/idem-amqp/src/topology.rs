//! Declaring a work queue with its dead-letter exchange and dead-letter queue.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use idem_core::Error;

use crate::builder::AmqpSourceBuilder;
use crate::error::{short_string, unavailable};

/// A durable work queue, a direct dead-letter exchange, and a durable dead-letter queue bound
/// to it with the work queue's name as routing key (so one exchange can serve many queues).
///
/// The work queue also names the exchange in `x-dead-letter-exchange`, so messages RabbitMQ
/// dead-letters by itself (TTL expiry, a quorum queue's delivery limit, another client's
/// `basic.reject`) land in the same dead-letter queue as idem's, with `x-death` instead of
/// idem's reason headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    dead_letter_exchange: String,
    dead_letter_queue: String,
    quorum: bool,
}

impl Topology {
    /// `queue`, with dead letters going through `<queue>.dlx` into `<queue>.dead`.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            dead_letter_exchange: format!("{queue}.dlx"),
            dead_letter_queue: format!("{queue}.dead"),
            queue,
            quorum: false,
        }
    }

    /// Names the dead-letter exchange.
    pub fn dead_letter_exchange(mut self, name: impl Into<String>) -> Self {
        self.dead_letter_exchange = name.into();
        self
    }

    /// Names the dead-letter queue.
    pub fn dead_letter_queue(mut self, name: impl Into<String>) -> Self {
        self.dead_letter_queue = name.into();
        self
    }

    /// Declares both queues as quorum queues (replicated; they count deliveries in
    /// `x-delivery-count`, and RabbitMQ 4 dead-letters a message itself after its delivery
    /// limit, 20 by default).
    pub fn quorum(mut self) -> Self {
        self.quorum = true;
        self
    }

    /// The work queue.
    pub fn queue_name(&self) -> &str {
        &self.queue
    }

    /// The dead-letter exchange.
    pub fn dead_letter_exchange_name(&self) -> &str {
        &self.dead_letter_exchange
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue_name(&self) -> &str {
        &self.dead_letter_queue
    }

    /// A source builder for the work queue that dead-letters through this topology.
    pub fn source(&self) -> AmqpSourceBuilder {
        crate::AmqpSource::builder(self.queue.clone())
            .dead_letter_exchange(self.dead_letter_exchange.clone())
            .dead_letter_routing_key(self.queue.clone())
    }

    /// Declares the exchange, both queues and the binding; idempotent. Redeclaring an
    /// existing queue with other arguments fails (`PRECONDITION_FAILED`) and closes `channel`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a name AMQP cannot
    /// carry; [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) when the broker
    /// refuses a declaration or cannot be reached.
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let queue = short_string("queue name", &self.queue)?;
        let dlx = short_string("dead-letter exchange", &self.dead_letter_exchange)?;
        let dlq = short_string("dead-letter queue", &self.dead_letter_queue)?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .exchange_declare(
                dlx.clone(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable(format_args!("exchange.declare {dlx}"), e))?;
        channel
            .queue_declare(dlq.clone(), durable, self.queue_arguments(None))
            .await
            .map_err(|e| unavailable(format_args!("queue.declare {dlq}"), e))?;
        channel
            .queue_bind(
                dlq.clone(),
                dlx.clone(),
                queue.clone(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| unavailable(format_args!("queue.bind {dlq} to {dlx}"), e))?;
        channel
            .queue_declare(queue.clone(), durable, self.queue_arguments(Some(&dlx)))
            .await
            .map_err(|e| unavailable(format_args!("queue.declare {queue}"), e))?;
        Ok(())
    }

    /// Deletes both queues (with their messages) and the exchange.
    ///
    /// # Errors
    /// As [`declare`](Self::declare).
    pub async fn delete(&self, channel: &Channel) -> Result<(), Error> {
        for q in [&self.queue, &self.dead_letter_queue] {
            channel
                .queue_delete(
                    short_string("queue name", q)?,
                    QueueDeleteOptions::default(),
                )
                .await
                .map_err(|e| unavailable(format_args!("queue.delete {q}"), e))?;
        }
        channel
            .exchange_delete(
                short_string("exchange", &self.dead_letter_exchange)?,
                ExchangeDeleteOptions::default(),
            )
            .await
            .map_err(|e| {
                unavailable(
                    format_args!("exchange.delete {}", self.dead_letter_exchange),
                    e,
                )
            })
    }

    fn queue_arguments(
        &self,
        dead_letter_exchange: Option<&lapin::types::ShortString>,
    ) -> FieldTable {
        let mut args = FieldTable::default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        if let Some(dlx) = dead_letter_exchange {
            args.insert("x-dead-letter-exchange".into(), text(dlx.as_str()));
            args.insert("x-dead-letter-routing-key".into(), text(&self.queue));
        }
        if self.quorum {
            args.insert("x-queue-type".into(), text("quorum"));
        }
        args
    }
}

/// Declares `queue` (durable) with its dead letters going through the direct exchange
/// `<queue>.dlx` into the durable queue `<queue>.dead`, where [`AmqpSource`
/// ](crate::AmqpSource) sends them by default; idempotent. For other names or quorum queues,
/// [`Topology::declare`].
///
/// # Errors
/// As [`Topology::declare`].
pub async fn ensure_queue(channel: &Channel, queue: &str) -> Result<(), Error> {
    Topology::new(queue).declare(channel).await
}
