//! The consumer runner: fetch → decode → process → settle, with a bounded number in flight.
//!
//! One loop fetches from the [`Source`]; each delivery (or batch) runs in its own task holding a
//! permit, so at most `concurrency` units are in flight. A task settles its deliveries itself:
//! ack only after commit or on a duplicate, dead-letter poison at once, retry the rest with
//! backoff. On shutdown the loop stops fetching and waits for the tasks; none acks anything
//! that did not commit.

mod instrumented;
mod settle;
#[cfg(test)]
mod settle_schedules;
mod work;

use std::sync::{Arc, Mutex};

use idem_core::{
    BatchClaimStore, ClaimStore, Clock, Error, ErrorKind, Handler, Processor, SetHandler,
    StoreClock,
};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::decode::Decode;
use crate::id_source::IdSource;
use crate::metrics::{Instruments, RunStats};
use crate::retry::{ReconnectBackoff, RetryPolicy};
use crate::source::Source;

/// Most deliveries fetched in one call in per-message mode; bounds memory when concurrency is
/// large.
const MAX_FETCH: usize = 256;

/// Runs a [`Processor`] over a broker [`Source`].
///
/// ```no_run
/// # async fn demo<Src: idem_consumer::Source>(source: Src) -> Result<(), idem_core::Error> {
/// use std::sync::Arc;
/// use idem_consumer::{Consumer, Handler, Json, shutdown};
/// use idem_core::{BoxError, Message, Processor};
/// use idem_sql::{SqliteOptions, SqliteStore, Tx};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String, amount_cents: i64 }
///
/// struct Charge;
/// impl Handler<Tx<sqlx::Sqlite>, Payment> for Charge {
///     type Output = ();
///     async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Payment>) -> Result<(), BoxError> {
///         let p = msg.payload();
///         // `?` on database errors: the store classifies deadlocks as retryable.
///         sqlx::query("UPDATE accounts SET balance = balance - ? WHERE id = ?")
///             .bind(p.amount_cents).bind(&p.account)
///             .execute(&mut **tx).await?;
///         Ok(())
///     }
/// }
///
/// let store = SqliteStore::open("idem.db", SqliteOptions::default()).await?;
/// let processor = Arc::new(Processor::builder(store, "billing").build()?);
/// let stats = Consumer::new(processor, source)
///     .concurrency(8)
///     .run(Json::<Payment>::new(), Charge, shutdown::on_signal())
///     .await?;
/// println!("{} processed, {} duplicates", stats.processed, stats.duplicates);
/// # Ok(()) }
/// ```
///
/// The mode is part of the type: [`Consumer::new`] processes one message per transaction and
/// needs only a [`ClaimStore`]; [`Consumer::batch`] turns it into a batching consumer, whose
/// `run` (a [`Handler`] per message) and `run_set` (a [`SetHandler`] per batch) need a
/// [`BatchClaimStore`].
#[derive(Debug)]
pub struct Consumer<S, Src, C = StoreClock, M = PerMessage> {
    processor: Arc<Processor<S, C>>,
    source: Src,
    concurrency: usize,
    mode: M,
    retry: RetryPolicy,
    id_source: Option<IdSource>,
    instruments: Instruments,
    after_commit: Option<AfterCommit>,
    local_cache: Option<crate::cache::LocalCache>,
}

/// A hook run after each commit that processed a message (see [`Consumer::after_commit`]).
#[derive(Clone)]
pub(crate) struct AfterCommit(Arc<dyn Fn() + Send + Sync>);

impl AfterCommit {
    pub(crate) fn call(&self) {
        (self.0)();
    }
}

impl std::fmt::Debug for AfterCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterCommit(..)")
    }
}

/// [`Consumer`]'s default mode: one message per transaction.
#[derive(Debug, Clone, Copy, Default)]
pub struct PerMessage;

/// [`Consumer`]'s batch mode: up to this many deliveries per transaction.
#[derive(Debug, Clone, Copy)]
pub struct Batch {
    size: usize,
}

impl Batch {
    /// Deliveries fetched and processed per transaction, at most.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl<S, Src, C> Consumer<S, Src, C, PerMessage>
where
    S: ClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    Src: Source,
{
    /// A runner for `processor` fed by `source`: one message per transaction, default retries,
    /// the adapter's default ID source.
    pub fn new(processor: Arc<Processor<S, C>>, source: Src) -> Self {
        let instruments = Instruments::new(processor.consumer().as_str(), source.broker());
        Self {
            instruments,
            processor,
            source,
            concurrency: 1,
            mode: PerMessage,
            retry: RetryPolicy::default(),
            id_source: None,
            after_commit: None,
            local_cache: None,
        }
    }

    /// Consumes until `shutdown` is cancelled (or the source ends), then settles in-flight work
    /// and closes the source.
    ///
    /// Returns what was done, or the error that stopped consumption: a [`Fatal`
    /// ](idem_core::Disposition::Fatal) processing error such as a misconfiguration. Broker
    /// errors do not end the run: the runner backs off and fetches again.
    pub async fn run<D, H>(
        self,
        decoder: D,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<RunStats, Error>
    where
        D: Decode,
        H: Handler<S::Tx, D::Payload> + 'static,
    {
        self.drive(decoder, work::OneByOne(handler), 1, shutdown)
            .await
    }
}

#[cfg(feature = "phases")]
impl<S, Src, C> Consumer<S, Src, C, PerMessage>
where
    S: ClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    Src: Source,
{
    /// Consumes with a handler of recovery points ([`crate::phased`]): each message runs as an
    /// operation of phases over `phased`'s request records, keyed by its message ID, each
    /// boundary one commit, resumed at its last point by a redelivery after a crash. The
    /// processor's claims table is not written in this mode; the processor supplies the
    /// consumer's name, and its store is probed after a lost connection, as in [`run`
    /// ](Self::run).
    ///
    /// On top of `run`'s table: a redelivery while another consumer holds the message's
    /// record (its lease is live) waits in place with backoff, spending no attempt, and is
    /// never dead-lettered; the same ID with another payload is dead-lettered `conflict`; an
    /// operation that ends with [`Step::Abandon`](idem_request::Step::Abandon) is acked and
    /// counted in [`RunStats::operations_abandoned`].
    pub async fn run_phased<D, R, H>(
        self,
        decoder: D,
        phased: crate::phased::Phased<R, H>,
        shutdown: CancellationToken,
    ) -> Result<RunStats, Error>
    where
        D: Decode,
        R: idem_core::store::RecoveryStore + Clone + Send + Sync + 'static,
        R::Tx: Send,
        H: crate::phased::PhasedHandler<R, D::Payload>,
    {
        // Phased messages are request records with their own TTL, not claims: not cached.
        let consumer = Self {
            local_cache: None,
            ..self
        };
        consumer
            .drive(decoder, work::Phases(phased), 1, shutdown)
            .await
    }
}

impl<S, Src, C> Consumer<S, Src, C, Batch>
where
    S: BatchClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    Src: Source,
{
    /// [`Consumer::run`] in batches: each fetched batch is claimed in one statement, `handler`
    /// runs for its new messages, and it commits once ([`Processor::process_batch`]). A message
    /// whose handler fails is left out of the batch (which is redone without it) and retried
    /// on its own; a batch that fails as a whole (a deadlock, a lost connection) is processed
    /// again message by message, costing none of them an attempt.
    pub async fn run<D, H>(
        self,
        decoder: D,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<RunStats, Error>
    where
        D: Decode,
        H: Handler<S::Tx, D::Payload> + 'static,
    {
        let size = self.mode.size;
        self.drive(decoder, work::Batched(handler), size, shutdown)
            .await
    }

    /// [`Consumer::run`] with a [`SetHandler`]: each fetched batch is claimed in one statement
    /// and its new messages go to `handler` at once ([`Processor::process_batch_set_with`]),
    /// the peak-throughput mode. When the handler fails, the batch rolls back whole and each of
    /// its messages is processed again as a batch of one, so a poison message is isolated (and
    /// retried, then dead-lettered) while the others commit.
    pub async fn run_set<D, H>(
        self,
        decoder: D,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<RunStats, Error>
    where
        D: Decode,
        H: SetHandler<S::Tx, D::Payload> + 'static,
    {
        let size = self.mode.size;
        self.drive(decoder, work::SetBatched(handler), size, shutdown)
            .await
    }
}

impl<S, Src, C, M> Consumer<S, Src, C, M>
where
    S: ClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    Src: Source,
{
    /// How many messages (or batches) are processed at once (default 1). Above 1, messages from
    /// the same partition or stream may commit out of order; keep 1 where order matters.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Batch mode: fetch up to `n` deliveries at a time and process them in one transaction,
    /// with one claim statement and one commit per batch (see the batch mode's `run` and
    /// `run_set`). At 1, each message still has its own transaction.
    pub fn batch(self, n: usize) -> Consumer<S, Src, C, Batch> {
        Consumer {
            processor: self.processor,
            source: self.source,
            concurrency: self.concurrency,
            mode: Batch { size: n.max(1) },
            retry: self.retry,
            id_source: self.id_source,
            instruments: self.instruments,
            after_commit: self.after_commit,
            local_cache: self.local_cache,
        }
    }

    /// Attempts and backoff for retryable errors.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Live counts of this consumer's run, readable while it runs (tests, health checks).
    pub fn observer(&self) -> Observer {
        Observer(self.instruments.clone())
    }

    /// Where to read the message ID instead of the adapter's default.
    pub fn id_source(mut self, source: IdSource) -> Self {
        self.id_source = Some(source);
        self
    }

    /// Runs `hook` after every commit that processed at least one message (not after
    /// duplicates), before the acknowledgement: the place to wake an outbox relay in the same
    /// process, so rows a handler enqueued are published without waiting for its next poll.
    /// Keep it cheap and non-blocking (a `Notify`); it runs on the consumer's tasks.
    ///
    /// ```ignore
    /// let waker = relay.waker();
    /// consumer.after_commit(move || waker.wake())
    /// ```
    pub fn after_commit(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.after_commit = Some(AfterCommit(Arc::new(hook)));
        self
    }

    /// Answers redeliveries of messages this process committed from a local cache, without a
    /// round trip to the store (off by default; see [`LocalCache`](crate::LocalCache) for what
    /// it may hold). A cached duplicate is acknowledged and counted as a duplicate (and in
    /// `idem_local_cache_hits_total`); a cached ID with another payload still goes to the
    /// store and is dead-lettered `conflict`. In batch modes cached IDs are left out of the
    /// batch's claim. The cache only knows this process's commits: it saves round trips on
    /// same-process redeliveries, and a claim deleted behind the consumer's back is answered
    /// from it until its entry expires (at the retention at the latest). Not used by
    /// `run_phased`.
    pub fn local_cache(mut self, cache: crate::cache::LocalCache) -> Self {
        self.local_cache = Some(cache);
        self
    }

    /// The run loop every mode shares; `work` is the mode's transactions.
    async fn drive<D, W>(
        self,
        decoder: D,
        work: W,
        batch_size: usize,
        shutdown: CancellationToken,
    ) -> Result<RunStats, Error>
    where
        D: Decode,
        W: work::Work<S, C, D::Payload>,
    {
        let Consumer {
            processor,
            mut source,
            concurrency,
            retry,
            id_source,
            instruments,
            after_commit,
            local_cache,
            ..
        } = self;
        let cache =
            local_cache.and_then(|c| crate::cache::ClaimCache::for_processor(c, &processor));
        let broker = source.broker();
        let consumer = processor.consumer().as_str().to_owned();
        let stop = shutdown.child_token();
        let ctx = Arc::new(settle::Ctx {
            id_source: id_source.unwrap_or_else(|| source.default_id_source()),
            instruments,
            consumer,
            broker,
            processor,
            decoder,
            work,
            retry,
            stop: stop.clone(),
            fatal: Mutex::new(None),
            after_commit,
            cache,
        });
        tracing::info!(consumer = %ctx.consumer, broker, concurrency, batch_size, id_source = %ctx.id_source, "consumer started");

        let permits = Arc::new(Semaphore::new(concurrency));
        let mut tasks = JoinSet::new();
        let mut reconnect = ReconnectBackoff::default();
        loop {
            while let Some(done) = tasks.try_join_next() {
                report_panic(done);
            }
            let first = tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break, // the semaphore is never closed
                },
            };
            let want = if batch_size > 1 {
                batch_size
            } else {
                (1 + permits.available_permits()).min(MAX_FETCH)
            };
            let fetched = tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                r = source.next(want) => r,
            };
            let deliveries = match fetched {
                Ok(d) if d.is_empty() => {
                    tracing::info!(consumer = %ctx.consumer, broker, "source ended");
                    break;
                }
                Ok(d) => {
                    reconnect.reset();
                    d
                }
                Err(e) => {
                    ctx.instruments.broker_error();
                    let wait = reconnect.next_delay();
                    tracing::warn!(consumer = %ctx.consumer, broker, error = %e, retry_in = ?wait, "fetch failed; backing off");
                    drop(first);
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            if batch_size > 1 {
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    ctx.settle_batch(deliveries).await;
                    drop(first);
                });
                continue;
            }
            let mut first = Some(first);
            for delivery in deliveries {
                // Only this loop acquires permits and `want` never exceeds what was free, so
                // this succeeds; if it ever did not, wait rather than exceed the bound.
                let permit = match first.take() {
                    Some(p) => p,
                    None => match permits.clone().try_acquire_owned() {
                        Ok(p) => p,
                        Err(_) => match permits.clone().acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => break,
                        },
                    },
                };
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    ctx.settle_one(delivery).await;
                    drop(permit);
                });
            }
        }

        let in_flight = tasks.len();
        if in_flight > 0 {
            tracing::info!(consumer = %ctx.consumer, broker, in_flight, "stopping: settling in-flight deliveries");
        }
        while let Some(done) = tasks.join_next().await {
            report_panic(done);
        }
        if let Err(e) = source.close().await {
            tracing::warn!(consumer = %ctx.consumer, broker, error = %e, "closing the source failed");
        }
        let stats = ctx.instruments.snapshot();
        tracing::info!(consumer = %ctx.consumer, broker, ?stats, "consumer stopped");
        let fatal = ctx
            .fatal
            .lock()
            .map(|mut f| f.take())
            .unwrap_or_else(|p| p.into_inner().take());
        match fatal {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }
}

/// Reads a running consumer's counts; cheap to clone.
#[derive(Debug, Clone)]
pub struct Observer(Instruments);

impl Observer {
    /// The counts so far.
    pub fn snapshot(&self) -> RunStats {
        self.0.snapshot()
    }
}

/// Handler panics are caught and settled as failures; a panic elsewhere in a task leaves its
/// delivery unsettled (never acked), which the broker redelivers after the connection closes.
fn report_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && e.is_panic()
    {
        tracing::error!(error = %e, "a message task panicked; its delivery was not acknowledged");
    }
}

/// The error that stops a run when a store or handler reports a misconfiguration.
pub(crate) fn fatal(e: Error) -> Error {
    if matches!(
        e.kind(),
        ErrorKind::InvalidConfig | ErrorKind::Misconfigured
    ) {
        e
    } else {
        Error::new(ErrorKind::InvalidConfig, format!("consumer stopped: {e}")).with_source(e)
    }
}
