//! Retention beside a running consumer: every service that consumes also has to delete its
//! expired claims, so the loop lives here once instead of in each service.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimStore, Clock, Processor, Prune};
use tokio_util::sync::CancellationToken;

/// Deletes `processor`'s claims older than its retention ([`Processor::prune`], in bounded
/// batches) at once and then every `every`, until `shutdown` is cancelled. Spawn it next to
/// [`Consumer::run`](crate::Consumer) with the same token:
///
/// ```no_run
/// # async fn demo<S: idem_core::ClaimStore + idem_core::Prune + 'static>(processor: std::sync::Arc<idem_core::Processor<S>>) {
/// use std::time::Duration;
/// let shutdown = idem_consumer::shutdown::on_signal();
/// let pruner = tokio::spawn(idem_consumer::prune_periodically(
///     processor.clone(),
///     Duration::from_secs(3600),
///     shutdown.clone(),
/// ));
/// // … Consumer::new(processor, source).run(…, shutdown).await …
/// pruner.await.ok();
/// # }
/// ```
///
/// A failed round (the database is down) is logged and retried at the next one: pruning is
/// never urgent, because claims outlive the redelivery window by construction. Deletions are
/// logged at `info` with their count, one line per round that deleted something.
pub async fn prune_periodically<S, C>(
    processor: Arc<Processor<S, C>>,
    every: Duration,
    shutdown: CancellationToken,
) where
    S: ClaimStore + Prune,
    C: Clock,
{
    let consumer = processor.consumer().as_str().to_owned();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = processor.prune() => match r {
                Ok(0) => {}
                Ok(n) => tracing::info!(consumer, pruned = n, "pruned expired claims"),
                Err(e) => tracing::warn!(consumer, error = %e, "pruning claims failed; retrying next round"),
            },
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
