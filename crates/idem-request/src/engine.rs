//! The engine: take a record, run the operation, complete or abandon — in one of two modes.
//!
//! The two modes are described on [`Idempotency`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_core::store::RequestStore;
use idem_core::{
    Begin, BeginIn, Error, ErrorKind, Fence, Fingerprint, Recovery, RequestErrorKind, RequestKey,
};
use tokio::task::JoinHandle;

/// Idempotent execution of operations keyed by client keys, on a [`RequestStore`].
///
/// Cheap to clone; one per service (or per route group with its own policy).
///
/// # Two modes
///
/// - **One transaction** (the default where the store supports it:
///   [`RequestStore::begin_request_in`], PostgreSQL and MariaDB): the record is taken inside
///   the operation's transaction, so the effect, the record and the stored result commit once
///   — one commit per first execution instead of two. No lease is renewed and nothing is
///   released: a crash, a dropped connection or an abandon rolls everything back and the key
///   is free. A concurrent duplicate is answered "in progress" at once by the store.
/// - **Leased**: the record is taken in a committed statement of its own
///   ([`RequestStore::begin_request`]), held under a lease with a heartbeat, and completed in
///   the operation's transaction. Needed where the record must be visible before the operation
///   ends: recovery points ([`Idempotency::run_phases`], idem-http's `IdemPhases`: each phase
///   boundary commits, and a foreign call's key must outlive a crash), an operation that must
///   survive its connection (it commits more than once), the completer, and stores without a
///   shared transaction (Redis) or whose one write lock must not be held for the operation
///   (SQLite). An execution begun in one transaction moves to the leased mode when it starts
///   phases ([`Execution::lease_record`]).
#[derive(Debug)]
pub struct Idempotency<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

#[derive(Debug)]
struct Inner<S> {
    store: S,
    ttl: Duration,
    lease: Duration,
    heartbeat: Option<Duration>,
    /// Whether a first execution takes its record inside its transaction where the store can
    /// ([`IdempotencyBuilder::leased_only`] turns it off).
    one_transaction: bool,
    /// Records this engine gave up (abandoned, or failed to complete) whose release the store
    /// refused: SQLite's write lock held by another request past the busy timeout, an outage.
    /// A task keeps releasing each until the store takes it or its lease ran out, and a
    /// lookup of one of these keys releases it first, so the key is never answered "in
    /// progress" for an execution that is over.
    unreleased: Mutex<HashMap<RequestKey, Fence>>,
    /// Completions this engine committed ([`IdempotencyBuilder::local_cache`]).
    cache: Option<crate::cache::RecordCache>,
}

/// Configures an [`Idempotency`]; [`build`](Self::build) refuses inconsistent timings.
#[derive(Debug)]
pub struct IdempotencyBuilder<S> {
    store: S,
    ttl: Duration,
    lease: Duration,
    heartbeat: Option<Option<Duration>>,
    local_cache: Option<crate::cache::LocalCache>,
    one_transaction: bool,
}

impl<S: RequestStore + Clone + 'static> Idempotency<S> {
    /// Starts configuring on `store`: records kept 24 h, leases of 30 s renewed every 10 s.
    pub fn builder(store: S) -> IdempotencyBuilder<S> {
        IdempotencyBuilder {
            store,
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            heartbeat: None,
            local_cache: None,
            one_transaction: true,
        }
    }
}

impl<S> IdempotencyBuilder<S> {
    /// How long a completed record is replayed (default 24 h). After that the key executes
    /// again, and the reaper may delete the record.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long an executor holds a record without renewing it (default 30 s). A retry meanwhile
    /// is answered "in progress"; after an executor's crash, the next retry takes over once the
    /// lease ran out.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How often a running operation renews its lease (default a third of the lease).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(Some(every));
        self
    }

    /// No heartbeat: an operation running longer than the lease may be taken over (its late
    /// completion is then refused).
    pub fn without_heartbeat(mut self) -> Self {
        self.heartbeat = Some(None);
        self
    }

    /// Replays retries of requests this engine completed from a local cache, without a round
    /// trip to the store (off by default). Filled only after a completion's commit returned;
    /// a key cached with another fingerprint goes to the store; entries expire with their
    /// records' TTL at the latest. The cache only knows this process's completions, and a
    /// record deleted by an operator is still replayed from it until its entry expires (see
    /// [`LocalCache`](crate::LocalCache)).
    pub fn local_cache(mut self, cache: crate::cache::LocalCache) -> Self {
        self.local_cache = Some(cache);
        self
    }

    /// Takes every record in the leased mode, even on a store that can take it inside the
    /// operation's transaction (see [`Idempotency`]'s two modes): two commits per first execution,
    /// a record visible (in progress) from its take on, released or taken over after a crash.
    /// For an operation that must commit before it completes; an execution of phases switches
    /// by itself.
    pub fn leased_only(mut self) -> Self {
        self.one_transaction = false;
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<Idempotency<S>, Error> {
        let bad = |why: String| Err(Error::new(ErrorKind::InvalidConfig, why));
        if self.lease < Duration::from_millis(10) {
            return bad(format!("lease of {:?} is too short", self.lease));
        }
        if self.ttl < self.lease {
            return bad(format!(
                "record TTL {:?} is shorter than the lease {:?}",
                self.ttl, self.lease
            ));
        }
        let heartbeat = self.heartbeat.unwrap_or(Some(self.lease / 3));
        if let Some(every) = heartbeat
            && (every.is_zero() || every >= self.lease)
        {
            return bad(format!(
                "heartbeat every {every:?} does not renew a lease of {:?} in time",
                self.lease
            ));
        }
        Ok(Idempotency {
            inner: Arc::new(Inner {
                store: self.store,
                ttl: self.ttl,
                lease: self.lease,
                heartbeat,
                one_transaction: self.one_transaction,
                unreleased: Mutex::new(HashMap::new()),
                cache: self
                    .local_cache
                    .and_then(|c| crate::cache::RecordCache::new(c, self.ttl)),
            }),
        })
    }
}

/// What [`Idempotency::start`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Start<S: RequestStore + Clone + 'static> {
    /// The record is this caller's: run the operation through the execution's transaction.
    Run(Execution<S>),
    /// Completed earlier: the stored result, byte for byte.
    Replay(Vec<u8>),
    /// Another executor is running it; ask again after `retry_after` (whole seconds, ≥ 1).
    InProgress {
        /// When the other executor's lease runs out at the latest.
        retry_after: Duration,
    },
    /// The key was used for a different request (another fingerprint); nothing was touched.
    Mismatch,
}

impl<S: RequestStore + Clone + 'static> Idempotency<S> {
    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// How long completed records are replayed.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// How long a lease lasts without renewal.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Looks `key` up and takes its record when it is free (absent, expired, or its holder's
    /// lease ran out), and begins the execution's transaction
    /// ([`RequestStore::begin_execution`]): inside that transaction where the store can
    /// ([`RequestStore::begin_request_in`], the one-transaction mode), else under a lease
    /// (see [`Idempotency`]'s two modes). Never waits for another executor. An execution of
    /// the same key that this engine gave up but whose record the store would not free yet
    /// (see [`Execution::abandon`]) is freed first; if the store still refuses, so does this.
    pub async fn start(
        &self,
        key: RequestKey,
        fingerprint: Fingerprint,
    ) -> Result<Start<S>, Error> {
        let cache = self.inner.cache.as_ref();
        if let Some(result) = cache.and_then(|c| c.replay(&key, &fingerprint)) {
            return Ok(Start::Replay(result));
        }
        let pending = cache.map(|_| crate::cache::Pending::now(fingerprint));
        let (lease, ttl) = (self.inner.lease, self.inner.ttl);
        let one_transaction = self.inner.one_transaction;
        let lookup = move |store: S, key: RequestKey| async move {
            if one_transaction {
                match store
                    .begin_request_in(&key, &fingerprint, lease, ttl)
                    .await?
                {
                    BeginIn::Acquired {
                        fence,
                        takeover,
                        tx,
                    } => return Ok((Begin::Acquired { fence, takeover }, None, Some(tx))),
                    BeginIn::Answer(answer) => return Ok((answer, None, None)),
                    // Unsupported: the leased mode below.
                    _ => {}
                }
            }
            let begin = store.begin_request(&key, &fingerprint, lease, ttl).await;
            begin.map(|begin| (begin, None, None))
        };
        let (mut start, _) = self.take(key, lookup).await?;
        if let Start::Run(execution) = &mut start {
            execution.cache_fill = pending;
        }
        Ok(start)
    }

    /// [`start`](Self::start) with the store's lookup given: `lookup` takes the record (and
    /// may tell where it stands, see
    /// [`RecoveryStore::begin_phases`](idem_core::store::RecoveryStore::begin_phases)), and
    /// hands over the transaction it took it in, in the one-transaction mode.
    pub(crate) async fn take<L, F>(
        &self,
        key: RequestKey,
        lookup: L,
    ) -> Result<(Start<S>, Option<Recovery>), Error>
    where
        L: FnOnce(S, RequestKey) -> F,
        F: Future<Output = Result<(Begin, Option<Recovery>, Option<S::Tx>), Error>>
            + Send
            + 'static,
    {
        let me = &self.inner;
        if key.key.as_str().len() > me.store.max_key_len() {
            return Err(Error::request(
                RequestErrorKind::InvalidKey,
                format!(
                    "idempotency key is {} bytes, over this store's limit of {}",
                    key.key.as_str().len(),
                    me.store.max_key_len()
                ),
            ));
        }
        // An execution of this key that this engine gave up and could not free yet: free it
        // now, or answer as the store does (a 503 in HTTP terms), never "in progress".
        if let Some(fence) = self.unreleased(&key) {
            me.store.release(&key, fence).await?;
            self.forget_unreleased(&key, fence);
        }
        // The lookup runs in a task of its own: a caller dropped while it is under way (a
        // client gone, a timeout) must not leave a record taken with nobody to free it. The
        // task hands the outcome over, or frees the record itself when no one is left to take it
        // (taken in a transaction: dropping the transaction rolls the take back).
        let (hand_over, taken) = tokio::sync::oneshot::channel();
        let lookup = {
            let (idem, key) = (self.clone(), key.clone());
            let begin = lookup(me.store.clone(), key.clone());
            async move {
                if let Err(Ok((Begin::Acquired { fence, .. }, _, None))) =
                    hand_over.send(begin.await)
                {
                    idem.release_quietly(&key, fence, "a caller gone during the lookup")
                        .await;
                }
            }
        };
        tokio::spawn(lookup);
        let begin = taken.await.map_err(|_| {
            Error::new(
                ErrorKind::Store,
                "the record lookup ended without an answer (its task panicked or the runtime is shutting down)",
            )
        })??;
        let (begin, recovery, tx) = begin;
        let (fence, takeover) = match begin {
            Begin::Acquired { fence, takeover } => (fence, takeover),
            Begin::Completed { result } => return Ok((Start::Replay(result), None)),
            Begin::InProgress { retry_after } => {
                return Ok((Start::InProgress { retry_after }, None));
            }
            Begin::Mismatch => return Ok((Start::Mismatch, None)),
            _ => {
                return Err(Error::new(
                    ErrorKind::Store,
                    "the store answered the lookup with a state this engine does not know",
                ));
            }
        };
        if takeover {
            tracing::info!(key = %KeyDigest(&key), fence = fence.0, "took over a record whose lease ran out (its executor likely crashed)");
        }
        let execution = match tx {
            Some(tx) => self.execution_in(key, fence, takeover, tx),
            None => self.execution(key, fence, takeover).await?,
        };
        Ok((Start::Run(execution), recovery))
    }

    /// The execution of a record taken uncommitted in `tx` (the one-transaction mode): no
    /// heartbeat, nothing to release.
    fn execution_in(
        &self,
        key: RequestKey,
        fence: Fence,
        takeover: bool,
        tx: S::Tx,
    ) -> Execution<S> {
        Execution {
            idem: self.clone(),
            key,
            fence,
            takeover,
            tx: Some(tx),
            heartbeat: None,
            in_tx: true,
            settled: false,
            cache_fill: None,
        }
    }

    /// The execution of a record this caller holds under `fence`: its transaction begun and
    /// its heartbeat running. On failure the record is given up.
    pub(crate) async fn execution(
        &self,
        key: RequestKey,
        fence: Fence,
        takeover: bool,
    ) -> Result<Execution<S>, Error> {
        let me = &self.inner;
        // From here the record is this execution's: dropped at any later await, its `Drop`
        // frees the key.
        let mut execution = Execution {
            idem: self.clone(),
            key,
            fence,
            takeover,
            tx: None,
            heartbeat: None,
            in_tx: false,
            settled: false,
            cache_fill: None,
        };
        match me.store.begin_execution().await {
            Ok(tx) => execution.tx = Some(tx),
            Err(e) => {
                let _ = execution.abandon().await;
                return Err(e);
            }
        }
        execution.start_heartbeat();
        Ok(execution)
    }
}

/// A record's key as logs show it at info and above: a short digest of (scope, key). The key
/// itself is the client's secret in a shared scope (whoever knows it gets the response), so
/// it appears only at debug level.
#[derive(Clone, Copy)]
pub struct KeyDigest<'a>(pub &'a RequestKey);

impl std::fmt::Display for KeyDigest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest = idem_core::RequestScope::new([
            b"idem-request/log".as_slice(),
            self.0.scope.as_bytes(),
            self.0.key.as_str().as_bytes(),
        ])
        .to_hex();
        write!(f, "k:{}", &digest[..16])
    }
}

impl std::fmt::Debug for KeyDigest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl<S: RequestStore + Clone + 'static> Idempotency<S> {
    fn unreleased_map(&self) -> MutexGuard<'_, HashMap<RequestKey, Fence>> {
        // Held for one map operation at a time: a panic cannot leave it half-written.
        self.inner
            .unreleased
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn unreleased(&self, key: &RequestKey) -> Option<Fence> {
        self.unreleased_map().get(key).copied()
    }

    fn forget_unreleased(&self, key: &RequestKey, fence: Fence) {
        let mut map = self.unreleased_map();
        if map.get(key) == Some(&fence) {
            map.remove(key);
        }
    }

    /// Frees a record this engine gave up; when the store refuses, frees it later (see
    /// [`release_later`](Self::release_later)) and returns the store's error.
    pub(crate) async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let released = self.inner.store.release(key, fence).await;
        if released.is_err() {
            self.release_later(key.clone(), fence);
        }
        released
    }

    /// [`release`](Self::release), logging (not returning) a failure.
    async fn release_quietly(&self, key: &RequestKey, fence: Fence, why: &str) {
        if let Err(e) = self.release(key, fence).await {
            tracing::warn!(key = %KeyDigest(key), error = %e, "could not free the key of {why} yet; freeing it in the background");
        }
    }

    /// Frees the record in the background: retried until the store takes the release or the
    /// lease ran out (a retry can then take the record over), and released first by the
    /// next lookup of the key through this engine meanwhile.
    pub(crate) fn release_later(&self, key: RequestKey, fence: Fence) {
        self.unreleased_map().insert(key.clone(), fence);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let idem = self.clone();
        rt.spawn(async move {
            let give_up = tokio::time::Instant::now() + idem.inner.lease;
            let mut pause = Duration::from_millis(50);
            while idem.unreleased(&key) == Some(fence) {
                tokio::time::sleep(pause).await;
                match idem.inner.store.release(&key, fence).await {
                    Ok(()) => break,
                    Err(e) if tokio::time::Instant::now() >= give_up => {
                        tracing::warn!(key = %KeyDigest(&key), error = %e, "could not free a key within its lease; a retry takes the record over");
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(key = %KeyDigest(&key), error = %e, "freeing a key failed; trying again");
                    }
                }
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            idem.forget_unreleased(&key, fence);
        });
    }
}

/// The shortest pause before renewing again after the store refused a renewal.
const RENEW_RETRY_FLOOR: Duration = Duration::from_millis(20);

/// Renews the lease until aborted or lost. A renewal the store refuses is tried again sooner
/// the closer the lease is to running out: SQLite refuses it while any transaction holds the
/// write lock (this execution's own, too) instead of queueing behind it, and no one can take
/// the record over meanwhile either, but the moment the lock is free a lapsed lease can be.
async fn renew<S: RequestStore>(
    store: S,
    key: RequestKey,
    fence: Fence,
    lease: Duration,
    every: Duration,
) {
    use tokio::time::Instant;
    // The lease was just taken.
    let mut held_until = Instant::now() + lease;
    let mut next = Instant::now() + every;
    let mut warned = false;
    loop {
        tokio::time::sleep_until(next).await;
        let asked = Instant::now();
        match store.extend_lease(&key, fence, lease).await {
            Ok(true) => {
                held_until = asked + lease;
                next = asked + every;
                warned = false;
            }
            Ok(false) => {
                tracing::warn!(key = %KeyDigest(&key), fence = fence.0, "lease lost to a takeover; this execution's completion will be refused");
                return;
            }
            Err(e) => {
                let now = Instant::now();
                let left = held_until.saturating_duration_since(now);
                next = now + (left / 4).max(RENEW_RETRY_FLOOR).min(every);
                if e.kind() == ErrorKind::Transient && !left.is_zero() {
                    tracing::debug!(key = %KeyDigest(&key), error = %e, "the lease was not renewed now; trying again");
                } else if !warned {
                    warned = true;
                    tracing::warn!(key = %KeyDigest(&key), error = %e, "renewing the lease failed; trying again");
                }
            }
        }
    }
}

/// One operation running under a taken record. Complete it or abandon it; dropped without
/// either (a panic, a cancelled request) it rolls back and frees the key.
pub struct Execution<S: RequestStore + Clone + 'static> {
    pub(crate) idem: Idempotency<S>,
    pub(crate) key: RequestKey,
    pub(crate) fence: Fence,
    takeover: bool,
    pub(crate) tx: Option<S::Tx>,
    heartbeat: Option<JoinHandle<()>>,
    /// Taken uncommitted in `tx` (the one-transaction mode): no lease, nothing to release;
    /// rolling `tx` back frees the key.
    in_tx: bool,
    /// Completed or abandoned: nothing is left for `Drop` to undo.
    pub(crate) settled: bool,
    /// What to put in the engine's local cache once the completion committed.
    cache_fill: Option<crate::cache::Pending>,
}

impl<S: RequestStore + Clone + 'static> Execution<S> {
    /// The record's key.
    pub fn key(&self) -> &RequestKey {
        &self.key
    }

    /// This execution's fencing token.
    pub fn fence(&self) -> Fence {
        self.fence
    }

    /// Whether this execution took over a record whose earlier executor's lease ran out.
    pub fn took_over(&self) -> bool {
        self.takeover
    }

    /// The transaction the operation writes through.
    ///
    /// # Panics
    /// After [`take_tx`](Self::take_tx) without [`put_tx`](Self::put_tx): a programming error.
    pub fn tx(&mut self) -> &mut S::Tx {
        match self.tx.as_mut() {
            Some(tx) => tx,
            None => panic!("Execution::tx after take_tx without put_tx"),
        }
    }

    /// Moves the transaction out, for an operation that must own it (e.g. an HTTP handler
    /// reached through request extensions). Give it back with [`put_tx`](Self::put_tx) before
    /// completing; completing without it is an error, and the writes roll back.
    pub fn take_tx(&mut self) -> Option<S::Tx> {
        self.tx.take()
    }

    /// Gives the transaction back.
    pub fn put_tx(&mut self, tx: S::Tx) {
        self.tx = Some(tx);
    }

    /// Whether the record is held uncommitted in the execution's transaction (the
    /// one-transaction mode) rather than under a committed lease.
    pub fn in_transaction(&self) -> bool {
        self.in_tx
    }

    /// Moves an execution of the one-transaction mode to the leased mode: commits its
    /// transaction — the record, in progress, with whatever was written through it so far —,
    /// renews the lease from now, begins a new transaction and starts the heartbeat. For an
    /// operation that must commit before it completes: recovery points
    /// ([`drive_phases`](Idempotency::drive_phases) calls it), or one that must outlive its
    /// connection. Does nothing in the leased mode. On an error the transaction is rolled back
    /// (the key is free again, unless the commit's outcome is unknown: then its lease runs out)
    /// and the execution is over.
    pub async fn lease_record(&mut self) -> Result<(), Error> {
        if !self.in_tx {
            return Ok(());
        }
        let store = self.idem.inner.store.clone();
        let Some(tx) = self.tx.take() else {
            return Err(Error::new(
                ErrorKind::Store,
                "the operation kept the transaction: the record cannot be committed under a lease",
            ));
        };
        if let Err(e) = store.commit(tx).await {
            self.settled = true;
            return Err(e);
        }
        self.in_tx = false;
        // The take's lease counted from the take; the operation may have run since.
        match store
            .extend_lease(&self.key, self.fence, self.idem.inner.lease)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                self.settled = true;
                return Err(idem_core::request_record::lease_lost(self.fence));
            }
            Err(e) => {
                let _ = self.idem.release(&self.key, self.fence).await;
                self.settled = true;
                return Err(e);
            }
        }
        match store.begin_execution().await {
            Ok(tx) => self.tx = Some(tx),
            Err(e) => {
                let _ = self.idem.release(&self.key, self.fence).await;
                self.settled = true;
                return Err(e);
            }
        }
        self.start_heartbeat();
        Ok(())
    }

    fn start_heartbeat(&mut self) {
        let me = &self.idem.inner;
        self.heartbeat = me.heartbeat.map(|every| {
            let store = me.store.clone();
            let key = self.key.clone();
            let (fence, lease) = (self.fence, me.lease);
            tokio::spawn(async move { renew(store, key, fence, lease, every).await })
        });
    }

    /// Frees the key of an execution given up: in the leased mode the record is released (see
    /// [`Idempotency::release`]); in the one-transaction mode rolling back (or dropping) its
    /// transaction did it already.
    pub(crate) async fn free(&mut self) -> Result<(), Error> {
        if self.in_tx {
            return Ok(());
        }
        self.idem.release(&self.key, self.fence).await
    }

    pub(crate) fn stop_heartbeat(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }

    /// Stores `result` with the record in the operation's transaction and commits both.
    ///
    /// [`RequestErrorKind::LeaseLost`] when another executor took the record over meanwhile: the
    /// transaction is rolled back, so this execution's writes never happened.
    ///
    /// Dropped before it returns (a cancelled request), the key is freed in the background:
    /// the transaction rolls back unless its commit already went out, and a committed
    /// completion stays (freeing only ever touches a record still in progress). Any other
    /// failure frees the key as [`abandon`](Self::abandon) does; after a
    /// [`Transient`](ErrorKind::Transient) one (a lock not free within the store's bound) it is
    /// freed in the background at once, since freeing it waits for the same lock.
    pub async fn complete(mut self, result: &[u8]) -> Result<(), Error> {
        self.stop_heartbeat();
        let store = self.idem.inner.store.clone();
        let ttl = self.idem.inner.ttl;
        let Some(mut tx) = self.tx.take() else {
            let _ = self.free().await;
            self.settled = true;
            return Err(Error::new(
                ErrorKind::Store,
                "the operation kept the transaction: nothing was committed and the key is free again",
            ));
        };
        if let Err(e) = store
            .complete_in(&mut tx, &self.key, self.fence, result, ttl)
            .await
        {
            let _ = store.rollback(tx).await;
            match e.kind() {
                // Taken in the transaction: its rollback freed the key.
                _ if self.in_tx => {}
                ErrorKind::Request(RequestErrorKind::LeaseLost) => {}
                // The completion waited for a lock (SQLite's write lock) as long as the store
                // waits; the release would wait for the same lock: free it in the background.
                ErrorKind::Transient => self.idem.release_later(self.key.clone(), self.fence),
                _ => {
                    let _ = self.idem.release(&self.key, self.fence).await;
                }
            }
            self.settled = true;
            return Err(e);
        }
        if let Err(e) = store.commit(tx).await {
            // Rolled back, or unknown: freeing a record this fence still holds in progress is
            // right either way (a committed completion is no longer in progress and stays).
            let _ = self.free().await;
            self.settled = true;
            return Err(e);
        }
        self.settled = true;
        if let (Some(cache), Some(fill)) = (&self.idem.inner.cache, self.cache_fill) {
            cache.fill(&self.key, fill, result);
        }
        idem_core::crash::reached(idem_core::crash::CrashPoint::ResponseCommitted);
        Ok(())
    }

    /// Rolls the operation's writes back and frees the key: the outcome is not stored, so a
    /// retry executes again. Dropped before it returns, the key is still freed, in the
    /// background. When the store refuses to free it (SQLite's write lock held by another
    /// transaction past the busy timeout, an outage), the error is returned and the key is
    /// freed in the background — retried until the store takes it or the lease ran out — and
    /// before the next [`start`](Idempotency::start) of the same key.
    pub async fn abandon(mut self) -> Result<(), Error> {
        self.stop_heartbeat();
        let store = self.idem.inner.store.clone();
        if let Some(tx) = self.tx.take() {
            let _ = store.rollback(tx).await;
        }
        let released = self.free().await;
        self.settled = true;
        released
    }
}

impl<S: RequestStore + Clone + 'static> std::fmt::Debug for Execution<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("key", &KeyDigest(&self.key))
            .field("fence", &self.fence)
            .field("takeover", &self.takeover)
            .field("in_transaction", &self.in_tx)
            .field("holds_tx", &self.tx.is_some())
            .finish()
    }
}

impl<S: RequestStore + Clone + 'static> Drop for Execution<S> {
    fn drop(&mut self) {
        self.stop_heartbeat();
        // Completed or abandoned: nothing left. Otherwise the operation panicked, or its future
        // (or that of `start`, `complete` or `abandon`) was dropped at an await: dropping the
        // transaction rolls it back; free the key in the background.
        if self.settled {
            return;
        }
        drop(self.tx.take());
        if self.in_tx {
            // The rollback of the transaction (its connection closed) freed the key.
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let idem = self.idem.clone();
            let (key, fence) = (self.key.clone(), self.fence);
            rt.spawn(async move {
                idem.release_quietly(&key, fence, "an interrupted execution")
                    .await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use idem_core::{IdempotencyKey, RequestScope, TransactionalStore};
    use idem_sql::{SqliteOptions, SqliteStore};

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A key is the client's secret in a shared scope: info and warn lines name it by digest.
    #[tokio::test(flavor = "current_thread")]
    async fn info_and_warn_lines_never_show_the_key() {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);

        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("k.db"), SqliteOptions::default())
            .await
            .unwrap();
        idem_core::Migrate::migrate(&store).await.unwrap();
        let idem = Idempotency::builder(store)
            .lease(Duration::from_millis(50))
            .without_heartbeat()
            .build()
            .unwrap();
        let secret = "sk-live-4242-secret";
        let key = RequestKey::new(
            RequestScope::new(["shared"]),
            IdempotencyKey::new(secret).unwrap(),
        );
        let fp = Fingerprint::of("body");
        let Ok(Start::Run(mut first)) = idem.start(key.clone(), fp).await else {
            panic!("the first start runs");
        };
        // Its transaction ends (the write lock of SQLite with it) but its lease stays.
        let tx = first.take_tx().unwrap();
        idem.store().rollback(tx).await.unwrap();
        tokio::time::sleep(Duration::from_millis(80)).await;
        let Ok(Start::Run(second)) = idem.start(key.clone(), fp).await else {
            panic!("the lapsed lease is taken over");
        };
        assert!(second.took_over());
        assert!(!format!("{second:?}").contains(secret));
        second.abandon().await.unwrap();
        drop(first);
        tokio::task::yield_now().await;
        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("took over"), "{text}");
        assert!(text.contains(&KeyDigest(&key).to_string()), "{text}");
        assert!(!text.contains(secret), "the key is in the logs: {text}");
    }
}
