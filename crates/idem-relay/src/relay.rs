//! The relay's loop: wait for a wake-up, a poll or housekeeping; lease a batch; hand it to a
//! round in flight ([`inflight`](crate::inflight)) and, while up to
//! [`pipeline`](crate::RelayBuilder::pipeline) rounds publish, lease the next; fold each
//! finished round's counts in; wait out store and broker outages.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use idem_consumer::crash::{self, CrashPoint};
use idem_consumer::{ReconnectBackoff, RetryPolicy};
use idem_core::Error;
use idem_core::outbox::{OutboxRow, RelayStore};
use tokio::sync::Semaphore;
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::Publish;
use crate::inflight::{self, Report, Shared};
use crate::metrics::{Instruments, RelayStats};
use crate::settings::{RelayBuilder, RelaySettings, lease_owner};
use crate::verdict::stops_the_relay;
use crate::waker::{RelayWaker, WakeStream, next_wake};

/// Most purge statements per housekeeping turn, so a large purge does not hold up publishing.
const MAX_PURGES_PER_TURN: usize = 10;

/// How long after a failed attempt to create a destination the relay tries again (publishing
/// to it meanwhile).
const ENSURE_RETRY: Duration = Duration::from_secs(60);

/// Publishes the outbox rows of a [`RelayStore`] through a [`Publish`]er until cancelled.
///
/// ```no_run
/// # async fn demo<S: idem_core::outbox::RelayStore + 'static>(store: S) -> Result<(), idem_core::Error> {
/// use idem_any::BrokerUrl;
/// use idem_relay::{BrokerPublisher, Relay};
///
/// let broker = BrokerUrl::parse("nats://127.0.0.1:4222")?;
/// let publisher = BrokerPublisher::new(broker, "orders-relay");
/// publisher.connect().await?;
/// let relay = Relay::builder("orders-relay").batch(200).build(store, publisher)?;
/// let waker = relay.waker(); // the application calls `waker.wake()` after each commit
/// let stats = relay.run(idem_consumer::shutdown::on_signal()).await?;
/// println!("{} published, {} dead-lettered", stats.published, stats.dead_lettered);
/// # drop(waker); Ok(()) }
/// ```
pub struct Relay<S, P> {
    inner: Inner<S, P>,
    wake_stream: Option<WakeStream>,
}

/// Everything but the wake stream (which is `Send` but not `Sync`), so the loop can borrow it
/// across awaits and stay `Send` for `tokio::spawn`.
struct Inner<S, P> {
    shared: Arc<Shared<S, P>>,
    settings: RelaySettings,
    waker: RelayWaker,
}

impl<S, P> fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("settings", &self.inner.settings)
            .field("wake_stream", &self.wake_stream.is_some())
            .finish_non_exhaustive()
    }
}

impl Relay<(), ()> {
    /// A [`RelayBuilder`] for a relay named `name`.
    pub fn builder(name: impl Into<String>) -> RelayBuilder {
        RelayBuilder::new(name)
    }
}

impl<S, P> Relay<S, P>
where
    S: RelayStore + 'static,
    P: Publish,
{
    /// The relay over `store` and `publisher` with checked `settings`.
    pub fn new(store: S, publisher: P, settings: RelaySettings) -> Self {
        let shared = Shared {
            store: Arc::new(store),
            publisher: Arc::new(publisher),
            permits: Arc::new(Semaphore::new(settings.concurrency)),
            backoff: RetryPolicy::exponential(u32::MAX, settings.retry_base, settings.retry_max),
            instruments: Instruments::new(&settings.name),
            max_attempts: settings.max_attempts,
        };
        Self {
            inner: Inner {
                shared: Arc::new(shared),
                settings,
                waker: RelayWaker::default(),
            },
            wake_stream: None,
        }
    }

    /// The handle that wakes this relay (keep it before calling [`run`](Self::run)).
    pub fn waker(&self) -> RelayWaker {
        self.inner.waker.clone()
    }

    /// Also wakes on every item of `stream` (see [`WakeStream`]), e.g. a PostgreSQL `LISTEN`
    /// on the channel the enqueuing transaction `NOTIFY`s.
    pub fn wake_on(mut self, stream: impl Stream<Item = ()> + Send + 'static) -> Self {
        self.wake_stream = Some(Box::pin(stream));
        self
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &RelaySettings {
        &self.inner.settings
    }

    /// Relays until `shutdown` is cancelled, then finishes the publishes in flight (of every
    /// round in flight), marks what the broker confirmed and releases the rest.
    ///
    /// Store and broker outages do not end the run: it waits them out with backoff, and
    /// nothing is lost or dead-lettered for them.
    ///
    /// # Errors
    /// A store error that waiting cannot fix ([`ErrorKind::Misconfigured`
    /// ](idem_core::ErrorKind::Misconfigured), `InvalidConfig`: the outbox table is missing,
    /// privileges are): the relay stops with it; leased rows return to the outbox when their
    /// lease lapses.
    pub async fn run(self, shutdown: CancellationToken) -> Result<RelayStats, Error> {
        let Relay {
            inner,
            mut wake_stream,
        } = self;
        let mut state = RunState::default();
        tracing::info!(relay = %inner.settings.name, "relay started");
        let result = inner.run(&mut state, &mut wake_stream, &shutdown).await;
        match &result {
            Ok(()) => {
                tracing::info!(relay = %inner.settings.name, published = state.stats.published, "relay stopped")
            }
            Err(e) => {
                tracing::info!(relay = %inner.settings.name, error = %e, "relay stopped on a store error it cannot wait out")
            }
        }
        result.map(|()| state.stats)
    }
}

/// What one run remembers between rounds.
#[derive(Debug, Default)]
struct RunState {
    stats: RelayStats,
    ensured: HashSet<String>,
    /// Destinations whose creation failed, and when.
    ensure_failed: HashMap<String, Instant>,
    store_down: bool,
    broker_down: bool,
    store_backoff: ReconnectBackoff,
    broker_backoff: ReconnectBackoff,
}

/// The rounds in flight, and the pipeline slot each holds.
#[derive(Default)]
struct Rounds {
    tasks: JoinSet<Report>,
    slots: HashMap<tokio::task::Id, usize>,
}

/// What the loop does after a round finished.
#[derive(Debug, Default)]
struct Next {
    /// Lease again at once.
    ready: bool,
    /// Wait this long before leasing again (an outage).
    wait: Option<Duration>,
}

impl<S, P> Inner<S, P>
where
    S: RelayStore + 'static,
    P: Publish,
{
    async fn run(
        &self,
        state: &mut RunState,
        wake_stream: &mut Option<WakeStream>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        let mut rounds = Rounds::default();
        let result = self.relay(state, wake_stream, shutdown, &mut rounds).await;
        // Stopping, or stopped by a store error: the rounds in flight finish their publishes,
        // mark what the broker confirmed and release the rest (or leave them leased when the
        // store fails them too).
        while let Some(done) = rounds.tasks.join_next_with_id().await {
            let mut free = Vec::new();
            let _ = self.finished(state, done, &mut rounds.slots, &mut free);
        }
        result
    }

    async fn relay(
        &self,
        state: &mut RunState,
        wake_stream: &mut Option<WakeStream>,
        shutdown: &CancellationToken,
        rounds: &mut Rounds,
    ) -> Result<(), Error> {
        let s = &self.settings;
        let mut next_purge = Instant::now() + s.purge_interval;
        let mut next_backlog = Instant::now();
        // Kept apart from the housekeeping wake-ups, which must not push the next poll back.
        let mut next_poll = Instant::now();
        // The first round runs at once: rows committed while no relay ran are waiting.
        let mut ready = true;
        // Pipeline slots no round holds; a slot is a lease owner of its own.
        let mut free: Vec<usize> = (0..s.pipeline).rev().collect();
        // A lease came back short while other rounds were in flight: their keys may have held
        // rows back, so look again as soon as one of them finishes.
        let mut recheck = false;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= next_backlog {
                self.read_backlog(state).await;
                next_backlog = Instant::now() + s.backlog_interval;
            }
            if now >= next_purge {
                // A turn that stopped at its cap left sent rows behind: the next turn follows
                // between rounds, not an interval later, or a relay publishing more than a
                // turn's rows per interval grows the table without bound.
                let more = self.purge(state, shutdown).await;
                next_purge = Instant::now()
                    + if more {
                        Duration::ZERO
                    } else {
                        s.purge_interval
                    };
            }
            if !ready || free.is_empty() {
                let housekeeping = next_purge.min(next_backlog);
                let idle = !ready;
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return Ok(()),
                    Some(done) = rounds.tasks.join_next_with_id(), if !rounds.tasks.is_empty() => {
                        let next = self.finished(state, done, &mut rounds.slots, &mut free)?;
                        if next.ready || std::mem::take(&mut recheck) {
                            ready = true;
                        }
                        if let Some(wait) = next.wait {
                            if sleep_or_stop(wait, shutdown).await {
                                return Ok(());
                            }
                            ready = true;
                        }
                        continue;
                    }
                    () = self.waker.woken(), if idle => {}
                    woke = next_wake(wake_stream), if idle => {
                        if woke.is_none() {
                            tracing::debug!(relay = %s.name, "wake stream ended; polling only");
                            *wake_stream = None;
                        }
                    }
                    () = tokio::time::sleep_until(next_poll), if idle => {}
                    () = tokio::time::sleep_until(housekeeping) => continue,
                }
                ready = true;
                if free.is_empty() {
                    continue;
                }
            }
            let Some(slot) = free.pop() else { continue };
            let owner = lease_owner(&s.name, slot);
            let leased = self.shared.store.lease(&owner, s.batch, s.lease).await;
            next_poll = Instant::now() + s.poll_interval;
            let rows = match leased {
                Ok(rows) => {
                    self.store_answers(state);
                    rows
                }
                Err(e) => {
                    free.push(slot);
                    let wait = self.store_failed(state, e)?;
                    if sleep_or_stop(wait, shutdown).await {
                        return Ok(());
                    }
                    ready = true;
                    continue;
                }
            };
            let full = rows.len() >= s.batch;
            if !full && !rounds.tasks.is_empty() {
                recheck = true;
            }
            ready = full;
            if rows.is_empty() {
                free.push(slot);
                continue;
            }
            state.stats.rounds += 1;
            tracing::debug!(relay = %s.name, lease_owner = %owner, rows = rows.len(), "leased");
            crash::reached(CrashPoint::RelayAfterLease);
            if s.create_destinations {
                self.ensure_destinations(state, &rows).await;
            }
            let task = rounds.tasks.spawn(inflight::run(
                Arc::clone(&self.shared),
                owner,
                slot,
                full,
                rows,
                shutdown.clone(),
            ));
            rounds.slots.insert(task.id(), slot);
        }
    }

    /// Folds a finished round into the run: its counts, its slot back, and what its outcome
    /// says about the store and the broker.
    fn finished(
        &self,
        state: &mut RunState,
        done: Result<(tokio::task::Id, Report), JoinError>,
        slots: &mut HashMap<tokio::task::Id, usize>,
        free: &mut Vec<usize>,
    ) -> Result<Next, Error> {
        let s = &self.settings;
        let report = match done {
            Ok((id, report)) => {
                slots.remove(&id);
                report
            }
            Err(e) => {
                // Its rows stay leased to its slot and come back with the slot's next lease.
                tracing::error!(relay = %s.name, error = %e, "a relay round failed");
                free.extend(slots.remove(&e.id()));
                return Ok(Next {
                    ready: true,
                    wait: None,
                });
            }
        };
        free.push(report.slot);
        state.stats.absorb(&report.stats);
        if let Some(e) = report.error {
            let wait = self.store_failed(state, e)?;
            return Ok(Next {
                ready: true,
                wait: Some(wait),
            });
        }
        self.store_answers(state);
        if report.missed > 0 && report.reached == 0 {
            if !state.broker_down {
                tracing::info!(relay = %s.name, "broker not taking messages; rows wait with backoff");
                state.broker_down = true;
                state.stats.broker_outages += 1;
            }
            return Ok(Next {
                ready: true,
                wait: Some(state.broker_backoff.next_delay()),
            });
        }
        if report.reached > 0 {
            if state.broker_down {
                tracing::info!(relay = %s.name, "broker takes messages again");
                state.broker_down = false;
            }
            state.broker_backoff.reset();
        }
        Ok(Next {
            ready: report.full,
            wait: None,
        })
    }

    fn store_answers(&self, state: &mut RunState) {
        if state.store_down {
            tracing::info!(relay = %self.settings.name, "outbox store answers again; relay resumed");
            state.store_down = false;
        }
        state.store_backoff.reset();
    }

    /// A store error: the error itself when waiting cannot fix it, else how long to pause.
    fn store_failed(&self, state: &mut RunState, e: Error) -> Result<Duration, Error> {
        if stops_the_relay(&e) {
            return Err(e);
        }
        let name = &self.settings.name;
        state.stats.store_errors += 1;
        if !state.store_down {
            tracing::info!(relay = %name, error = %e, "outbox store unavailable; relay paused, nothing is lost");
            state.store_down = true;
        } else {
            tracing::debug!(relay = %name, error = %e, "outbox store still unavailable");
        }
        Ok(state.store_backoff.next_delay())
    }

    /// Creates each destination not yet created in this run. A failure is not the rows'
    /// fault: the publish goes ahead and its own result decides (the broker is down: it fails
    /// too and the row waits; the destination exists in another shape, or the operator made
    /// it: it succeeds). A failed creation is tried again after [`ENSURE_RETRY`].
    async fn ensure_destinations(&self, state: &mut RunState, rows: &[OutboxRow]) {
        for row in rows {
            let dest = row.message.destination();
            if state.ensured.contains(dest)
                || state
                    .ensure_failed
                    .get(dest)
                    .is_some_and(|at| at.elapsed() < ENSURE_RETRY)
            {
                continue;
            }
            match self.shared.publisher.ensure_destination(dest).await {
                Ok(()) => {
                    state.ensure_failed.remove(dest);
                    state.ensured.insert(dest.to_owned());
                }
                Err(e) => {
                    let first = state
                        .ensure_failed
                        .insert(dest.to_owned(), Instant::now())
                        .is_none();
                    if first {
                        tracing::warn!(relay = %self.settings.name, destination = dest, error = %e, "could not create the destination; publishing to it anyway");
                    } else {
                        tracing::debug!(relay = %self.settings.name, destination = dest, error = %e, "could not create the destination yet");
                    }
                }
            }
        }
    }

    async fn read_backlog(&self, state: &mut RunState) {
        match self.shared.store.backlog().await {
            Ok(b) => self.shared.instruments.backlog(&mut state.stats, &b),
            // The lease reports outages; a gauge a little stale says nothing new.
            Err(e) => {
                tracing::debug!(relay = %self.settings.name, error = %e, "reading the outbox backlog failed")
            }
        }
    }

    /// One housekeeping turn of purge statements; true when it stopped at its cap with every
    /// statement full (more sent rows are likely waiting).
    async fn purge(&self, state: &mut RunState, shutdown: &CancellationToken) -> bool {
        let batch = self.settings.purge_batch;
        for _ in 0..MAX_PURGES_PER_TURN {
            if shutdown.is_cancelled() {
                return false;
            }
            match self.shared.store.purge_sent(batch).await {
                Ok(n) => {
                    state.stats.purged += n;
                    if n < batch as u64 {
                        return false;
                    }
                }
                Err(e) => {
                    tracing::debug!(relay = %self.settings.name, error = %e, "purging sent outbox rows failed");
                    return false;
                }
            }
        }
        true
    }
}

/// Sleeps `d`; true when `shutdown` came first.
async fn sleep_or_stop(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(d) => false,
    }
}
