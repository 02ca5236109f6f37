//! The idempotent consumer: idem's real runner (`Consumer`) over the in-memory broker, with the
//! charge as its `Handler`. Each delivery goes through `Processor::process`, which claims the
//! message ID and runs the charge in one transaction; the runner acks only after the commit,
//! retries and dead-letters by its own rules — the same code a service runs on a real broker.
//! Whatever the broker does (duplicate publishes, redeliveries after a lost ack, two deliveries
//! of one ID at once), a message is charged by exactly one committed transaction.

use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{
    CancellationToken, Consumer, Handler, InMemoryBroker, Json, RetryPolicy, RunStats,
};
use idem_core::{BoxError, Identified, Message, Processor};
use idem_sql::{SqliteStore, Tx};
use sqlx::Sqlite;

use super::ledger;
use super::producer::PaymentRequested;

/// The consumer name the demo's claims are recorded under.
pub(crate) const CONSUMER: &str = "payments-demo";

/// Attempts of a message whose charge keeps failing with a retryable error before the runner
/// dead-letters it (`retries-exhausted`).
const ATTEMPTS: u32 = 5;

/// The side effect, in the claim's transaction.
struct Charge;

impl Handler<Tx<Sqlite>, PaymentRequested> for Charge {
    type Output = ();

    async fn handle(
        &self,
        tx: &mut Tx<Sqlite>,
        msg: &Message<PaymentRequested>,
    ) -> Result<(), BoxError> {
        // `tx` derefs to the transaction's connection: the charge joins the claim's
        // transaction, and both commit or neither does.
        ledger::charge(tx, &msg.message_id().to_string(), msg.payload()).await
    }
}

/// Runs the consumer with `workers` messages in flight until the broker is closed and every
/// delivery settled.
pub(crate) async fn run(
    broker: &InMemoryBroker,
    processor: Arc<Processor<SqliteStore>>,
    workers: usize,
) -> anyhow::Result<RunStats> {
    let stats = Consumer::new(processor, broker.source())
        .concurrency(workers)
        .retry(RetryPolicy::exponential(
            ATTEMPTS,
            Duration::from_millis(5),
            Duration::from_millis(100),
        ))
        .run(
            Json::<PaymentRequested>::new(),
            Charge,
            CancellationToken::new(),
        )
        .await?;
    Ok(stats)
}
