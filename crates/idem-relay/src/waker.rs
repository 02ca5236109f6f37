//! Wake-ups: an in-process handle the application pokes after a commit, and any stream of
//! notifications (a PostgreSQL `LISTEN` connection, a Redis pub/sub channel) plugged in next
//! to the polling fallback.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio::sync::Notify;

/// Wakes a [`Relay`](crate::Relay) now instead of at its next poll: call
/// [`wake`](Self::wake) after committing a transaction that enqueued outgoing messages.
/// Cheap to clone; a wake while the relay is busy is kept, so the relay looks again right
/// after its current round (several wakes meanwhile count as one).
#[derive(Clone, Default)]
pub struct RelayWaker {
    notify: Arc<Notify>,
}

impl fmt::Debug for RelayWaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayWaker").finish_non_exhaustive()
    }
}

impl RelayWaker {
    /// Asks the relay to look for rows now.
    pub fn wake(&self) {
        self.notify.notify_one();
    }

    pub(crate) async fn woken(&self) {
        self.notify.notified().await;
    }
}

/// Another source of wake-ups: each item is "rows may be waiting". A wake-up stream needs no
/// durability (a missed one costs at most a poll interval), so a PostgreSQL `LISTEN` whose
/// connection drops may simply end or pause its stream: the relay keeps polling. When the
/// stream ends, the relay goes on without it.
pub type WakeStream = Pin<Box<dyn Stream<Item = ()> + Send + 'static>>;

/// The next item of an optional wake stream; never resolves without one.
pub(crate) async fn next_wake(stream: &mut Option<WakeStream>) -> Option<()> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}
