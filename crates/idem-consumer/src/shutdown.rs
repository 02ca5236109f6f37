//! Graceful shutdown: a cancellation token that SIGINT or SIGTERM cancels.

use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGINT (Ctrl-C) or SIGTERM (what orchestrators send).
///
/// Pass it to [`Consumer::run`](crate::Consumer::run): the runner stops fetching, lets
/// in-flight messages commit or roll back, acknowledges what committed and leaves the rest to
/// redelivery. A second signal is not handled here, so it kills the process the default way.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; finishing in-flight messages");
        trigger.cancel();
    });
    token
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops gracefully");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}
