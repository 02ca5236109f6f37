//! The relay's loop: wait for a wake-up, a poll or housekeeping; lease a batch; publish it;
//! settle every row (mark sent, release, dead-letter); wait out store and broker outages.

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
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::Publish;
use crate::metrics::{Instruments, RelayStats};
use crate::round::{self, UnitOutcome};
use crate::settings::{RelayBuilder, RelaySettings};
use crate::verdict::{RETRIES_EXHAUSTED, Verdict, stops_the_relay};
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
    store: Arc<S>,
    publisher: Arc<P>,
    settings: RelaySettings,
    waker: RelayWaker,
    backoff: RetryPolicy,
    instruments: Instruments,
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
        let backoff = RetryPolicy::exponential(u32::MAX, settings.retry_base, settings.retry_max);
        Self {
            inner: Inner {
                instruments: Instruments::new(&settings.name),
                store: Arc::new(store),
                publisher: Arc::new(publisher),
                settings,
                waker: RelayWaker::default(),
                backoff,
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

    /// Relays until `shutdown` is cancelled, then finishes the publishes in flight, marks what
    /// the broker confirmed and releases the rest.
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

/// How a round went, for the loop's next step.
#[derive(Debug, Default)]
struct Round {
    full: bool,
    /// Publishes that reached the broker (confirmed or refused for good).
    reached: usize,
    /// Publishes that failed to reach it (retryable).
    missed: usize,
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
        let s = &self.settings;
        let mut next_purge = Instant::now() + s.purge_interval;
        let mut next_backlog = Instant::now();
        // Kept apart from the housekeeping wake-ups, which must not push the next poll back.
        let mut next_poll = Instant::now();
        // The first round runs at once: rows committed while no relay ran are waiting.
        let mut ready = true;
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
                self.purge(state, shutdown).await;
                next_purge = Instant::now() + s.purge_interval;
            }
            if !ready {
                let housekeeping = next_purge.min(next_backlog);
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return Ok(()),
                    () = self.waker.woken() => {}
                    woke = next_wake(wake_stream) => {
                        if woke.is_none() {
                            tracing::debug!(relay = %s.name, "wake stream ended; polling only");
                            *wake_stream = None;
                        }
                    }
                    () = tokio::time::sleep_until(next_poll) => {}
                    () = tokio::time::sleep_until(housekeeping) => continue,
                }
            }
            let round = self.round(state, shutdown).await;
            next_poll = Instant::now() + s.poll_interval;
            match round {
                Ok(round) => {
                    if state.store_down {
                        tracing::info!(relay = %s.name, "outbox store answers again; relay resumed");
                        state.store_down = false;
                    }
                    state.store_backoff.reset();
                    if round.missed > 0 && round.reached == 0 {
                        if !state.broker_down {
                            tracing::info!(relay = %s.name, "broker not taking messages; rows wait with backoff");
                            state.broker_down = true;
                            state.stats.broker_outages += 1;
                        }
                        let wait = state.broker_backoff.next_delay();
                        if sleep_or_stop(wait, shutdown).await {
                            return Ok(());
                        }
                        ready = true;
                    } else {
                        if round.reached > 0 {
                            if state.broker_down {
                                tracing::info!(relay = %s.name, "broker takes messages again");
                                state.broker_down = false;
                            }
                            state.broker_backoff.reset();
                        }
                        ready = round.full;
                    }
                }
                Err(e) if stops_the_relay(&e) => return Err(e),
                Err(e) => {
                    state.stats.store_errors += 1;
                    if !state.store_down {
                        tracing::info!(relay = %s.name, error = %e, "outbox store unavailable; relay paused, nothing is lost");
                        state.store_down = true;
                    } else {
                        tracing::debug!(relay = %s.name, error = %e, "outbox store still unavailable");
                    }
                    let wait = state.store_backoff.next_delay();
                    if sleep_or_stop(wait, shutdown).await {
                        return Ok(());
                    }
                    ready = true;
                }
            }
        }
    }

    /// Leases, publishes and settles one batch.
    async fn round(
        &self,
        state: &mut RunState,
        shutdown: &CancellationToken,
    ) -> Result<Round, Error> {
        let s = &self.settings;
        let rows = self.store.lease(&s.name, s.batch, s.lease).await?;
        let mut round = Round {
            full: rows.len() >= s.batch,
            ..Round::default()
        };
        if rows.is_empty() {
            return Ok(round);
        }
        state.stats.rounds += 1;
        tracing::debug!(relay = %s.name, rows = rows.len(), "leased");
        crash::reached(CrashPoint::RelayAfterLease);
        if s.create_destinations {
            self.ensure_destinations(state, &rows).await;
        }
        let permits = Arc::new(Semaphore::new(s.concurrency));
        let mut tasks = JoinSet::new();
        for unit in round::plan(rows) {
            tasks.spawn(round::publish_unit(
                Arc::clone(&self.publisher),
                Arc::clone(&permits),
                shutdown.clone(),
                unit,
            ));
        }
        let mut outcomes = Vec::new();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(outcome) => outcomes.push(outcome),
                // Which of its rows the broker confirmed is unknown: they stay leased and are
                // published again when the lease lapses (a duplicate at worst).
                Err(e) => tracing::error!(relay = %s.name, error = %e, "a publishing task failed"),
            }
        }
        self.settle(state, outcomes, &mut round).await?;
        Ok(round)
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
            match self.publisher.ensure_destination(dest).await {
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

    /// Marks what the broker confirmed, then releases or dead-letters what failed, then
    /// releases what was held or not started. Confirmed rows first: a store error half-way
    /// leaves the rest leased, to be published again when their lease lapses.
    async fn settle(
        &self,
        state: &mut RunState,
        outcomes: Vec<UnitOutcome>,
        round: &mut Round,
    ) -> Result<(), Error> {
        let name = &self.settings.name;
        let sent: Vec<i64> = outcomes
            .iter()
            .flat_map(|o| o.sent.iter().copied())
            .collect();
        round.reached += sent.len();
        if !sent.is_empty() {
            self.store.mark_sent(name, &sent).await?;
            crash::reached(CrashPoint::RelayAfterMark);
            self.instruments.published(&mut state.stats, sent.len());
        }
        let mut unstarted = Vec::new();
        for outcome in outcomes {
            unstarted.extend(outcome.unstarted);
            let Some((row, err)) = outcome.failed else {
                continue;
            };
            let attempts = row.attempts.saturating_add(1);
            let exhausted = self.settings.max_attempts.is_some_and(|m| attempts >= m);
            // How long the rows held behind it wait: never less than the failed row, so the
            // store cannot hand one of them out before it.
            let held_wait = match Verdict::of(&err) {
                Verdict::DeadLetter(code) => {
                    round.reached += 1;
                    self.dead_letter(state, &row, code, &format!("{code}: {err}"))
                        .await?;
                    Duration::ZERO
                }
                Verdict::Retry if exhausted => {
                    round.missed += 1;
                    let reason = format!("{RETRIES_EXHAUSTED} after {attempts} attempts: {err}");
                    self.dead_letter(state, &row, RETRIES_EXHAUSTED, &reason)
                        .await?;
                    Duration::ZERO
                }
                Verdict::Retry => {
                    round.missed += 1;
                    let wait = self.backoff.delay(attempts.saturating_add(1));
                    self.store
                        .release(name, row.seq, &err.to_string(), wait)
                        .await?;
                    self.instruments.failed(&mut state.stats);
                    tracing::debug!(seq = row.seq, attempts, retry_in = ?wait, "released to retry");
                    wait
                }
            };
            let why = format!("held behind seq {} of its ordering key", row.seq);
            for held in outcome.held {
                self.store.release(name, held.seq, &why, held_wait).await?;
                state.stats.released_unpublished += 1;
            }
        }
        for row in unstarted {
            self.store
                .release(
                    name,
                    row.seq,
                    "the relay stopped before publishing it",
                    Duration::ZERO,
                )
                .await?;
            state.stats.released_unpublished += 1;
        }
        Ok(())
    }

    async fn dead_letter(
        &self,
        state: &mut RunState,
        row: &OutboxRow,
        code: &'static str,
        reason: &str,
    ) -> Result<(), Error> {
        self.store
            .dead_letter(&self.settings.name, row.seq, reason)
            .await?;
        self.instruments.dead_lettered(&mut state.stats, code);
        tracing::debug!(seq = row.seq, id = ?row.message.id(), reason, "dead-lettered");
        Ok(())
    }

    async fn read_backlog(&self, state: &mut RunState) {
        match self.store.backlog().await {
            Ok(b) => self.instruments.backlog(&mut state.stats, &b),
            // The lease reports outages; a gauge a little stale says nothing new.
            Err(e) => {
                tracing::debug!(relay = %self.settings.name, error = %e, "reading the outbox backlog failed")
            }
        }
    }

    async fn purge(&self, state: &mut RunState, shutdown: &CancellationToken) {
        let batch = self.settings.purge_batch;
        for _ in 0..MAX_PURGES_PER_TURN {
            if shutdown.is_cancelled() {
                return;
            }
            match self.store.purge_sent(batch).await {
                Ok(n) => {
                    state.stats.purged += n;
                    if n < batch as u64 {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(relay = %self.settings.name, error = %e, "purging sent outbox rows failed");
                    return;
                }
            }
        }
    }
}

/// Sleeps `d`; true when `shutdown` came first.
async fn sleep_or_stop(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(d) => false,
    }
}
