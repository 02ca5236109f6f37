//! `--naive`: the classic mistake, run on the same traffic for comparison.
//!
//! Check "already processed?" in one transaction, charge in a second, mark as processed in a
//! third. It looks idempotent and is not, for two reasons the demo provokes:
//!
//! - a crash after the charge commits and before the mark leaves no trace of the charge in
//!   `naive_processed`, so the redelivery passes the check and charges again;
//! - two deliveries of the same ID (a duplicate publish) handled at once both pass the check
//!   before either marks it, and both charge.
//!
//! idem closes both gaps by making the mark (the claim) part of the charge's transaction.

use idem_consumer::{Delivery, InMemoryDelivery, Source};
use idem_core::BoxError;

use super::ledger;
use super::producer::PaymentRequested;
use super::worker::{self, WorkerContext};

/// Where one naive attempt ended.
enum Step {
    /// The check found the ID: ack without charging.
    AlreadyProcessed,
    /// Charged and marked: ack.
    Charged,
    /// Charged, then crashed before marking and acking.
    Crashed,
}

/// One naive worker: takes deliveries one at a time until the broker has nothing left.
pub(crate) async fn run(ctx: WorkerContext) -> anyhow::Result<()> {
    let mut source = ctx.broker.source();
    loop {
        let fetched = source.next(1).await?;
        if fetched.is_empty() {
            return Ok(());
        }
        for delivery in fetched {
            match attempt(&ctx, &delivery).await {
                Ok(Step::AlreadyProcessed) => ctx.skip_duplicate(delivery).await,
                Ok(Step::Charged) => worker::ack(delivery).await,
                // Gone without a word: the delivery stays in flight until its visibility
                // timeout, then comes back.
                Ok(Step::Crashed) => drop(delivery),
                Err(e) => ctx.failed(delivery, ctx.classify(e)).await?,
            }
        }
    }
}

async fn attempt(ctx: &WorkerContext, delivery: &InMemoryDelivery) -> Result<Step, BoxError> {
    let id = worker::message_id(delivery);
    let pool = ctx.store.pool();

    // Transaction 1: the check.
    let mut tx = pool.begin().await?;
    let seen: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM naive_processed WHERE message_id = ?1)")
            .bind(&id)
            .fetch_one(&mut *tx)
            .await?;
    tx.commit().await?;
    if seen {
        return Ok(Step::AlreadyProcessed);
    }
    // From here until transaction 3 commits, another delivery of this ID passes the check too.

    // Transaction 2: the charge (the same ledger code idem's consumer runs).
    let payment = PaymentRequested::decode(delivery.payload())?;
    let mut tx = ctx.store.begin_tx().await?;
    ledger::charge(&mut tx, &id, &payment).await?;
    tx.commit().await?;

    // The same crash point as idem's consumer: after the charge's commit, before anything else.
    if ctx.crashes_after_commit(delivery) {
        return Ok(Step::Crashed);
    }

    // Transaction 3: the mark. OR IGNORE: a racing duplicate may have marked it already.
    sqlx::query("INSERT OR IGNORE INTO naive_processed (message_id) VALUES (?1)")
        .bind(&id)
        .execute(pool)
        .await?;
    Ok(Step::Charged)
}
