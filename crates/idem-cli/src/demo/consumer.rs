//! The idempotent consumer: each delivery goes through `Processor::process`, which claims the
//! message ID and runs the charge in one transaction. Whatever the broker does — duplicate
//! publishes, redeliveries after a crash, two workers holding the same ID at once — a message is
//! charged by exactly one committed transaction.

use std::sync::Arc;

use idem_core::{BoxError, Outcome, Processor};
use idem_sql::SqliteStore;

use super::ledger;
use super::producer::PaymentRequested;
use super::worker::WorkerContext;

/// The consumer name the demo's claims are recorded under.
pub(crate) const CONSUMER: &str = "payments-demo";

/// One worker: takes deliveries until the broker has nothing left.
pub(crate) async fn run(
    ctx: WorkerContext,
    processor: Arc<Processor<SqliteStore>>,
) -> anyhow::Result<()> {
    while let Some(delivery) = ctx.broker.receive().await {
        let envelope = delivery.envelope();
        let result = processor
            .process(&envelope.message, async |tx| -> Result<(), BoxError> {
                let payment = PaymentRequested::decode(envelope.message.payload())?;
                // `tx` derefs to the transaction's connection (`&mut **tx`): the charge joins
                // the claim's transaction, and both commit or neither does.
                ledger::charge(tx, &envelope.id, &payment).await
            })
            .await;
        match result {
            Ok(Outcome::Processed(())) => {
                // Committed: claim and charge are durable together. A crash now costs only a
                // redelivery, which will find the claim.
                if !ctx.crashes_after_commit(&delivery) {
                    ctx.broker.ack(&delivery);
                }
            }
            Ok(Outcome::Duplicate) => ctx.skip_duplicate(&delivery),
            Ok(Outcome::Conflict { stored, received }) => {
                let reason = format!(
                    "conflict: {} was already processed with payload fingerprint {stored}, \
                     this delivery's is {received}",
                    envelope.id
                );
                ctx.conflict(&delivery, reason).await?;
            }
            Err(e) => ctx.failed(&delivery, e).await?,
        }
    }
    Ok(())
}
