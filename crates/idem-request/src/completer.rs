//! The completer: a background task that finishes operations of phases their client left
//! stuck (it gave up, its executor crashed). Each pass takes over a bounded batch of records
//! past their lease ([`Idempotency::take_stuck`]) and resumes each at its last recovery point
//! with the operation's own `step` function ([`Idempotency::resume_phases`]), or, after too
//! many attempts, gives it up with a compensation ([`Execution::give_up`]).
//!
//! ```
//! use std::time::Duration;
//!
//! use idem_core::{BoxError, IdempotencyKey, RequestScope};
//! use idem_request::{Completer, Idempotency, PhaseCtx, Step};
//! use idem_sql::{SqliteOptions, SqliteStore};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! enum Phase { Reserve, Confirm }
//!
//! /// The operation's phases: the caller's `run_phases` and the completer use the same one.
//! async fn step(phase: Phase, ctx: &mut PhaseCtx<SqliteStore>) -> Result<Step<Phase, String>, BoxError> {
//!     Ok(match phase {
//!         Phase::Reserve => Step::Next(Phase::Confirm),
//!         Phase::Confirm => Step::Done(format!("confirmed on attempt {}", ctx.attempt())),
//!     })
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! let idem = Idempotency::builder(store.clone()).lease(Duration::from_secs(10)).build()?;
//! let completer = Completer::builder(idem)
//!     .interval(Duration::from_secs(5))
//!     .batch(32)
//!     .max_attempts(5)
//!     .operation(
//!         RequestScope::new(["reserve"]),
//!         "reserve",
//!         |idem, stuck| async move { idem.resume_phases(stuck, step).await.map(drop) },
//!         |execution, _recovery| async move {
//!             // Out of attempts: undo in `tx`, and store the answer every retry replays.
//!             execution.give_up(br#""gave up""#, async |_tx| Ok::<(), BoxError>(())).await
//!         },
//!     )
//!     .build()?;
//! let shutdown = CancellationToken::new();
//! let task = tokio::spawn(completer.clone().run(shutdown.clone()));
//! shutdown.cancel();
//! let stats = task.await?;
//! assert_eq!(stats.abandoned, 0);
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::store::RecoveryStore;
use idem_core::{Error, ErrorKind, Recovery, RequestScope, Stuck};
use metrics::counter;
use tokio_util::sync::CancellationToken;

use crate::engine::{Execution, Idempotency, KeyDigest};

type BoxFut = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;
type ResumeFn<S> = dyn Fn(Idempotency<S>, Stuck) -> BoxFut + Send + Sync;
type GiveUpFn<S> = dyn Fn(Execution<S>, Recovery) -> BoxFut + Send + Sync;

struct Operation<S: RecoveryStore + Clone + 'static> {
    name: String,
    resume: Arc<ResumeFn<S>>,
    give_up: Arc<GiveUpFn<S>>,
}

/// What a [`Completer`] did, counted since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterStats {
    /// Passes that reached the store.
    pub passes: u64,
    /// Stuck records taken over.
    pub stuck_seen: u64,
    /// Operations resumed and driven to their end (done, or abandoned by a phase).
    pub resumed: u64,
    /// Operations given up after [`max_attempts`](CompleterBuilder::max_attempts).
    pub abandoned: u64,
    /// Resumes or give-ups that failed; the record keeps its point for a later attempt.
    pub failed: u64,
    /// Stuck records of a scope no operation was registered for; left alone.
    pub unknown: u64,
    /// Passes the store refused (an outage, a missing table) or failed under, waited out;
    /// never counted as an operation's failure.
    pub outages: u64,
}

/// Builds a [`Completer`] (consuming builder).
pub struct CompleterBuilder<S: RecoveryStore + Clone + 'static> {
    idem: Idempotency<S>,
    interval: Duration,
    batch: u32,
    max_attempts: u32,
    max_backoff: Duration,
    operations: HashMap<RequestScope, Operation<S>>,
    any_scope: Option<Operation<S>>,
}

impl<S: RecoveryStore + Clone + 'static> std::fmt::Debug for CompleterBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompleterBuilder")
            .field("interval", &self.interval)
            .field("batch", &self.batch)
            .field("max_attempts", &self.max_attempts)
            .field("operations", &self.operations.len())
            .finish()
    }
}

impl<S: RecoveryStore + Clone + Send + Sync + 'static> CompleterBuilder<S> {
    /// Time between passes that found nothing (default 5 s); a full batch is followed by
    /// another pass at once.
    pub fn interval(mut self, every: Duration) -> Self {
        self.interval = every;
        self
    }

    /// Stuck records taken over per pass (default 32, at least 1).
    pub fn batch(mut self, n: u32) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Executions an operation gets ([`Recovery::attempts`], the first one included) before
    /// the completer gives it up instead of resuming it (default 5, at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Longest wait between passes while the store is refusing (default 60 s); the wait
    /// starts at [`interval`](Self::interval) and doubles.
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max;
        self
    }

    /// Registers the operation whose records live in `scope` (named `name` in logs).
    ///
    /// `resume` finishes a stuck record, normally by handing it to
    /// [`Idempotency::resume_phases`] with the same `step` function the operation's
    /// [`run_phases`](Idempotency::run_phases) uses:
    /// `|idem, stuck| async move { idem.resume_phases(stuck, step).await.map(drop) }`.
    /// (It is a closure of yours rather than `step` itself so that Rust can see, at your
    /// concrete `step`, that the resume future is `Send`.)
    ///
    /// `give_up` ends a record that used up [`max_attempts`](Self::max_attempts): it calls
    /// [`Execution::give_up`] with the result every retry will get and the compensation that
    /// commits with it.
    pub fn operation<R, RF, G, GF>(
        mut self,
        scope: RequestScope,
        name: impl Into<String>,
        resume: R,
        give_up: G,
    ) -> Self
    where
        R: Fn(Idempotency<S>, Stuck) -> RF + Send + Sync + 'static,
        RF: Future<Output = Result<(), Error>> + Send + 'static,
        G: Fn(Execution<S>, Recovery) -> GF + Send + Sync + 'static,
        GF: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let resume: Arc<ResumeFn<S>> = Arc::new(move |idem, stuck| Box::pin(resume(idem, stuck)));
        let give_up: Arc<GiveUpFn<S>> =
            Arc::new(move |execution, recovery| Box::pin(give_up(execution, recovery)));
        self.operations.insert(
            scope,
            Operation {
                name: name.into(),
                resume,
                give_up,
            },
        );
        self
    }

    /// Registers the operation of every stuck record whose scope no
    /// [`operation`](Self::operation) names: for records whose scopes cannot be listed in
    /// advance, such as idem-http's, one scope per principal and route. Right when one
    /// operation of phases writes to this store (take care: every stuck record of another
    /// scope is handed to it).
    pub fn any_scope_operation<R, RF, G, GF>(
        mut self,
        name: impl Into<String>,
        resume: R,
        give_up: G,
    ) -> Self
    where
        R: Fn(Idempotency<S>, Stuck) -> RF + Send + Sync + 'static,
        RF: Future<Output = Result<(), Error>> + Send + 'static,
        G: Fn(Execution<S>, Recovery) -> GF + Send + Sync + 'static,
        GF: Future<Output = Result<(), Error>> + Send + 'static,
    {
        self.any_scope = Some(Operation {
            name: name.into(),
            resume: Arc::new(move |idem, stuck| Box::pin(resume(idem, stuck))),
            give_up: Arc::new(move |execution, recovery| Box::pin(give_up(execution, recovery))),
        });
        self
    }

    /// The completer; [`InvalidConfig`](ErrorKind::InvalidConfig) when no operation is
    /// registered (it could only take records over and leave them).
    pub fn build(self) -> Result<Completer<S>, Error> {
        if self.operations.is_empty() && self.any_scope.is_none() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "a completer needs at least one operation to resume",
            ));
        }
        Ok(Completer {
            inner: Arc::new(Inner {
                idem: self.idem,
                interval: self.interval,
                batch: self.batch,
                max_attempts: self.max_attempts,
                max_backoff: self.max_backoff,
                operations: self.operations,
                any_scope: self.any_scope,
                stats: Mutex::new(CompleterStats::default()),
                warned_unknown: Mutex::new(HashSet::new()),
            }),
        })
    }
}

struct Inner<S: RecoveryStore + Clone + 'static> {
    idem: Idempotency<S>,
    interval: Duration,
    batch: u32,
    max_attempts: u32,
    max_backoff: Duration,
    operations: HashMap<RequestScope, Operation<S>>,
    any_scope: Option<Operation<S>>,
    stats: Mutex<CompleterStats>,
    warned_unknown: Mutex<HashSet<RequestScope>>,
}

/// Finishes stuck operations of phases in the background; see the [module](self) docs.
/// Several completers (processes) can run at once: a record one holds is skipped by the
/// others, and a late write of one that lost its record is refused by its fence.
///
/// A record is taken over (its [`Recovery::attempts`] grows by one) before the completer
/// knows its operation: run every completer with the same operations registered, or an
/// unknown record spends attempts each time its lease runs out.
pub struct Completer<S: RecoveryStore + Clone + 'static> {
    inner: Arc<Inner<S>>,
}

impl<S: RecoveryStore + Clone + 'static> Clone for Completer<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: RecoveryStore + Clone + 'static> std::fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("batch", &self.inner.batch)
            .field("max_attempts", &self.inner.max_attempts)
            .field("stats", &self.stats())
            .finish()
    }
}

/// How a pass ended.
enum Pass {
    /// The store answered; this many records were taken.
    Took(usize),
    /// The store refused.
    Outage(Error),
}

impl<S: RecoveryStore + Clone + Send + Sync + 'static> Completer<S> {
    /// A builder for a completer on `idem`'s store (its lease is the completer's lease on
    /// the records it takes over).
    pub fn builder(idem: Idempotency<S>) -> CompleterBuilder<S> {
        CompleterBuilder {
            idem,
            interval: Duration::from_secs(5),
            batch: 32,
            max_attempts: 5,
            max_backoff: Duration::from_secs(60),
            operations: HashMap::new(),
            any_scope: None,
        }
    }

    /// The counts so far.
    pub fn stats(&self) -> CompleterStats {
        *self
            .inner
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, f: impl FnOnce(&mut CompleterStats)) {
        f(&mut self
            .inner
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner));
    }

    /// One pass: takes over at most one batch of stuck records and resumes or gives up each.
    /// Returns how many were taken; an error when the store refused the take-over (the
    /// records are then untouched) or failed as a store ([`Error::is_outage`]) under one of
    /// them (the pass stops there; the rest wait out the lease). An operation that fails
    /// otherwise does not stop the pass: it is counted and logged, and keeps its recovery
    /// point.
    pub async fn pass(&self) -> Result<usize, Error> {
        match self.pass_inner().await {
            Pass::Took(n) => Ok(n),
            Pass::Outage(e) => Err(e),
        }
    }

    async fn pass_inner(&self) -> Pass {
        let inner = &self.inner;
        let taken = match inner.idem.take_stuck(inner.batch).await {
            Ok(taken) => taken,
            Err(e) => {
                self.count(|s| s.outages += 1);
                return Pass::Outage(e);
            }
        };
        let n = taken.len();
        self.count(|s| {
            s.passes += 1;
            s.stuck_seen += n as u64;
        });
        counter!("idem_completer_stuck_total").increment(n as u64);
        for stuck in taken {
            if let Some(outage) = self.one(stuck).await {
                // The rest of the batch would fail the same way: their leases run out and a
                // later pass takes them again.
                self.count(|s| s.outages += 1);
                return Pass::Outage(outage);
            }
        }
        Pass::Took(n)
    }

    /// Resumes or gives up one record; the error when the store itself failed (an outage).
    async fn one(&self, stuck: Stuck) -> Option<Error> {
        let inner = &self.inner;
        let op = inner.operations.get(&stuck.key.scope);
        let Some(op) = op.or(inner.any_scope.as_ref()) else {
            self.count(|s| s.unknown += 1);
            counter!("idem_completer_unknown_total").increment(1);
            let first = inner
                .warned_unknown
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(stuck.key.scope);
            if first {
                tracing::warn!(scope = ?stuck.key.scope, "stuck records of a scope no operation is registered for; left alone (register it, or run a completer that has it)");
            }
            // Its lease runs out by itself; not released, so it is not retaken every pass.
            return None;
        };
        let key = stuck.key.clone();
        let attempts = stuck.recovery.attempts;
        if attempts > inner.max_attempts {
            let result = match inner.idem.resume(stuck).await {
                Ok((execution, recovery)) => (op.give_up)(execution, recovery).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => {
                    self.count(|s| s.abandoned += 1);
                    counter!("idem_completer_abandoned_total").increment(1);
                    tracing::info!(operation = %op.name, key = %KeyDigest(&key), attempts, "stuck operation given up after its last attempt");
                }
                Err(e) => return self.failed(&op.name, &key, attempts, e),
            }
            return None;
        }
        match (op.resume)(inner.idem.clone(), stuck).await {
            Ok(()) => {
                self.count(|s| s.resumed += 1);
                counter!("idem_completer_resumed_total").increment(1);
                tracing::debug!(operation = %op.name, key = %KeyDigest(&key), attempts, "stuck operation finished");
            }
            Err(e) => return self.failed(&op.name, &key, attempts, e),
        }
        None
    }

    fn failed(
        &self,
        name: &str,
        key: &idem_core::RequestKey,
        attempts: u32,
        e: Error,
    ) -> Option<Error> {
        if e.is_outage() {
            tracing::debug!(operation = %name, key = %KeyDigest(key), attempts, error = %e, "the store failed under a stuck operation; it keeps its recovery point");
            return Some(e);
        }
        self.count(|s| s.failed += 1);
        counter!("idem_completer_failed_total").increment(1);
        tracing::warn!(operation = %name, key = %KeyDigest(key), attempts, error = %e, "stuck operation not finished; it keeps its recovery point for a later attempt");
        None
    }

    /// Runs passes until `shutdown` is cancelled, and returns the counts. A pass that took a
    /// full batch is followed by another at once; otherwise the next waits
    /// [`interval`](CompleterBuilder::interval). While the store refuses, passes back off
    /// (doubling up to [`max_backoff`](CompleterBuilder::max_backoff)) and nothing is
    /// given up: an operation is abandoned only for its own attempts, never for an outage.
    pub async fn run(self, shutdown: CancellationToken) -> CompleterStats {
        let inner = &self.inner;
        tracing::info!(
            operations = inner.operations.len(),
            batch = inner.batch,
            max_attempts = inner.max_attempts,
            "completer started"
        );
        let mut backoff = inner.interval;
        let mut down = false;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let wait = match self.pass_inner().await {
                Pass::Took(n) => {
                    if down {
                        down = false;
                        tracing::info!("store answers again; completer resumed");
                    }
                    backoff = inner.interval;
                    if n >= inner.batch as usize {
                        Duration::ZERO
                    } else {
                        inner.interval
                    }
                }
                Pass::Outage(e) => {
                    if !down {
                        down = true;
                        tracing::warn!(error = %e, "store refused the completer; it waits with backoff, nothing is given up");
                    }
                    let wait = backoff;
                    backoff = (backoff * 2).min(inner.max_backoff.max(inner.interval));
                    wait
                }
            };
            if !wait.is_zero() {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
        let stats = self.stats();
        tracing::info!(
            resumed = stats.resumed,
            abandoned = stats.abandoned,
            failed = stats.failed,
            "completer stopped"
        );
        stats
    }
}
