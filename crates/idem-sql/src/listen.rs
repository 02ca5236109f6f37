//! PostgreSQL's wake-up for relays: every transaction that enqueues into the outbox also
//! notifies its channel ([`idem_dialect::postgres::outbox_channel`]), which PostgreSQL delivers
//! at commit only, and [`PostgresStore::outbox_wakeups`] turns those notifications into a
//! stream a relay wakes on (`idem_relay::Relay::wake_on`). Notifications are not durable (a
//! relay that was not listening misses them), so they shorten the wait; the relay's poll
//! remains what guarantees a row is found.

use std::time::Duration;

use futures_util::Stream;
use sqlx::postgres::PgListener;

use crate::PostgresStore;

/// The longest wait between two attempts to listen again after the connection was lost.
const MAX_RETRY: Duration = Duration::from_secs(5);

impl PostgresStore {
    /// A stream that yields soon after each commit of a transaction that enqueued into this
    /// store's outbox, on any connection, in any process (`LISTEN` on a connection of its own
    /// from the pool). It also yields once after its connection was lost and listens again,
    /// since what was committed meanwhile was not heard: a wake-up too many costs one lease.
    /// It never ends.
    pub fn outbox_wakeups(&self) -> impl Stream<Item = ()> + Send + 'static {
        let pool = self.pool().clone();
        let channel = idem_dialect::postgres::outbox_channel(self.outbox_table());
        futures_util::stream::unfold(
            (None::<PgListener>, Duration::ZERO),
            move |(listener, wait)| {
                let (pool, channel) = (pool.clone(), channel.clone());
                async move {
                    let mut listener = match listener {
                        Some(l) => l,
                        None => {
                            tokio::time::sleep(wait).await;
                            match listen(&pool, &channel).await {
                                Ok(l) => l,
                                Err(e) => {
                                    tracing::debug!(error = %e, channel, "cannot listen for outbox notifications; retrying");
                                    let next =
                                        (wait * 2).clamp(Duration::from_millis(100), MAX_RETRY);
                                    return Some(((), (None, next)));
                                }
                            }
                        }
                    };
                    match listener.try_recv().await {
                        Ok(Some(_)) => Some(((), (Some(listener), Duration::ZERO))),
                        // The connection was lost; the next call reconnects. Commits made
                        // meanwhile went unheard: wake once for them.
                        Ok(None) => Some(((), (Some(listener), Duration::ZERO))),
                        Err(e) => {
                            tracing::debug!(error = %e, channel, "outbox notifications interrupted; listening again");
                            Some(((), (None, Duration::from_millis(100))))
                        }
                    }
                }
            },
        )
    }
}

async fn listen(pool: &sqlx::PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}
