//! `FakeRelayStore`: an in-memory fake of an outbox table, for tests of the relay and of
//! publishers against real brokers before a SQL store is wired in. Not a store: nothing is
//! durable, and it shares nothing with a business transaction.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use idem_core::outbox::{Backlog, OutboxRow, Outgoing, RelayStore};
use idem_core::{Error, ErrorKind, Timestamp};
use tokio::time::Instant;

/// Where one fake row stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeRowState {
    /// Waiting to be leased once `due` passed.
    Unsent {
        /// When it may be leased again (tokio time, so paused-time tests control it).
        due: Instant,
    },
    /// Leased to `relay` until `until`.
    Leased {
        /// The relay holding it.
        relay: String,
        /// When the lease lapses.
        until: Instant,
    },
    /// Published and marked.
    Sent,
    /// Moved to the dead letters with this reason.
    DeadLettered(String),
}

/// One row of the fake outbox.
#[derive(Debug, Clone)]
pub struct FakeRow {
    /// Its sequence and message.
    pub row: OutboxRow,
    /// Where it stands.
    pub state: FakeRowState,
    /// The last release's error.
    pub last_error: Option<String>,
}

/// A release the fake recorded: (seq, error, retry_in).
pub type FakeRelease = (i64, String, Duration);

#[derive(Debug, Default)]
struct State {
    rows: Vec<FakeRow>,
    next_seq: i64,
    releases: Vec<FakeRelease>,
    down: Option<ErrorKind>,
    calls: u64,
}

/// An in-memory fake outbox with [`RelayStore`]'s contract: rows leased oldest first; a keyed
/// row only when no earlier unsent row of its (destination, key) is leased elsewhere or
/// waiting out a retry (so a key's order holds); [`set_down`](Self::set_down) makes every call
/// fail as a store outage would.
#[derive(Debug, Clone, Default)]
pub struct FakeRelayStore {
    state: Arc<Mutex<State>>,
}

impl FakeRelayStore {
    /// An empty fake outbox.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock already failed.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends committed messages, in order; returns their sequence numbers.
    pub fn enqueue(&self, messages: impl IntoIterator<Item = Outgoing>) -> Vec<i64> {
        let mut s = self.lock();
        let now = Instant::now();
        let mut seqs = Vec::new();
        for message in messages {
            s.next_seq += 1;
            let seq = s.next_seq;
            s.rows.push(FakeRow {
                row: OutboxRow {
                    seq,
                    message,
                    attempts: 0,
                    created: Timestamp::from(SystemTime::now()),
                },
                state: FakeRowState::Unsent { due: now },
                last_error: None,
            });
            seqs.push(seq);
        }
        seqs
    }

    /// Every row, in sequence order.
    pub fn rows(&self) -> Vec<FakeRow> {
        self.lock().rows.clone()
    }

    /// The state of row `seq`.
    pub fn state_of(&self, seq: i64) -> Option<FakeRowState> {
        self.lock()
            .rows
            .iter()
            .find(|r| r.row.seq == seq)
            .map(|r| r.state.clone())
    }

    /// Every release so far, in order.
    pub fn releases(&self) -> Vec<FakeRelease> {
        self.lock().releases.clone()
    }

    /// Store calls so far.
    pub fn calls(&self) -> u64 {
        self.lock().calls
    }

    /// From now on every call fails with `kind` (`None`: the store answers again).
    pub fn set_down(&self, kind: Option<ErrorKind>) {
        self.lock().down = kind;
    }

    fn enter(&self) -> Result<MutexGuard<'_, State>, Error> {
        let mut s = self.lock();
        s.calls += 1;
        match s.down {
            Some(kind) => Err(Error::new(kind, "fake outbox store is down")),
            None => Ok(s),
        }
    }

    fn leased_to<'a>(s: &'a mut State, relay: &str, seq: i64) -> Result<&'a mut FakeRow, Error> {
        let now = Instant::now();
        s.rows
            .iter_mut()
            .find(|r| {
                r.row.seq == seq
                    && matches!(&r.state, FakeRowState::Leased { relay: owner, until } if owner == relay && *until > now)
            })
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Store,
                    format!("row {seq} is not leased to {relay}"),
                )
            })
    }
}

impl RelayStore for FakeRelayStore {
    async fn lease(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRow>, Error> {
        let mut s = self.enter()?;
        let now = Instant::now();
        let until = now + lease;
        let mut blocked: Vec<(String, String)> = Vec::new();
        let mut out = Vec::new();
        for r in &mut s.rows {
            let group = r
                .row
                .message
                .key()
                .map(|k| (r.row.message.destination().to_owned(), k.to_owned()));
            let takeable = match &r.state {
                FakeRowState::Unsent { due } => *due <= now,
                FakeRowState::Leased { until, .. } => *until <= now,
                FakeRowState::Sent | FakeRowState::DeadLettered(_) => continue,
            };
            let is_blocked = group.as_ref().is_some_and(|g| blocked.contains(g));
            if takeable && !is_blocked && out.len() < limit {
                r.state = FakeRowState::Leased {
                    relay: relay.to_owned(),
                    until,
                };
                out.push(r.row.clone());
            } else if let Some(g) = group {
                // An unsent row not taken now holds every later row of its key.
                blocked.push(g);
            }
        }
        Ok(out)
    }

    async fn mark_sent(&self, relay: &str, seqs: &[i64]) -> Result<(), Error> {
        let mut s = self.enter()?;
        for &seq in seqs {
            Self::leased_to(&mut s, relay, seq)?.state = FakeRowState::Sent;
        }
        Ok(())
    }

    async fn release(
        &self,
        relay: &str,
        seq: i64,
        error: &str,
        retry_in: Duration,
    ) -> Result<(), Error> {
        let mut s = self.enter()?;
        let row = Self::leased_to(&mut s, relay, seq)?;
        row.state = FakeRowState::Unsent {
            due: Instant::now() + retry_in,
        };
        row.row.attempts += 1;
        row.last_error = Some(error.to_owned());
        s.releases.push((seq, error.to_owned(), retry_in));
        Ok(())
    }

    async fn dead_letter(&self, relay: &str, seq: i64, reason: &str) -> Result<(), Error> {
        let mut s = self.enter()?;
        Self::leased_to(&mut s, relay, seq)?.state = FakeRowState::DeadLettered(reason.to_owned());
        Ok(())
    }

    async fn purge_sent(&self, limit: usize) -> Result<u64, Error> {
        let mut s = self.enter()?;
        let mut purged = 0;
        s.rows.retain(|r| {
            if r.state == FakeRowState::Sent && purged < limit {
                purged += 1;
                false
            } else {
                true
            }
        });
        Ok(purged as u64)
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let s = self.enter()?;
        let now = Timestamp::from(SystemTime::now());
        let mut b = Backlog::default();
        for r in &s.rows {
            match r.state {
                FakeRowState::Sent => b.sent += 1,
                FakeRowState::DeadLettered(_) => b.dead_lettered += 1,
                _ => {
                    b.unsent += 1;
                    let age = Duration::from_micros(
                        u64::try_from(now.as_micros() - r.row.created.as_micros()).unwrap_or(0),
                    );
                    b.oldest_unsent = Some(b.oldest_unsent.map_or(age, |o| o.max(age)));
                }
            }
        }
        Ok(b)
    }
}
