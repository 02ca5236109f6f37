//! Randomized-schedule tests of the settle logic under shuttle: many `settle_one` (and
//! `settle_batch`) calls at once, as the runner's tasks make them, over deliveries that repeat
//! message IDs (redeliveries, duplicate publishes) and one ID published with two payloads.
//!
//! The claim store is in memory and yields to shuttle between its steps (begin, claim, commit);
//! a claim waits while another open transaction holds an uncommitted claim on the same ID, as a
//! unique index does. The handler yields too, records its effect in the transaction (so it
//! commits or rolls back with the claim), and sometimes fails.
//!
//! Retries run with a zero-delay `RetryPolicy` of three attempts: `after_failure` does not wait
//! on a timer for a zero backoff, so retries (and their dead letter once exhausted) are
//! explored too. The store-outage wait is not: the store never reports one, and a real outage
//! backoff is never zero.
//!
//! Checked to fail on purpose (then restored; `settle.rs` and idem-core were mutated in a scratch
//! copy of the workspace, never in place): a duplicate dead-lettered instead of acked; a
//! retryable failure dead-lettered as retries exhausted on its first attempt; a batch's
//! outcomes settled against the wrong deliveries; the processor committing the claim in a
//! transaction of its own before the handler's (a concurrent duplicate is then acked before
//! the effect commits); a store whose claim does not wait for an uncommitted one.
//!
//! Each schedule also runs with the local cache of completed claims on (`Consumer::local_cache`):
//! the same checks hold, and a cached redelivery's ack still finds its claim and effect
//! committed. Checked to fail on purpose the same way: the cache filled whatever the outcome
//! (a rolled-back message's redelivery is then acked with no effect committed).
//!
//! Each failure prints shuttle's failing schedule and seed; rerun the seed with
//! `SHUTTLE_RANDOM_SEED=<seed>`. `IDEM_SHUTTLE_ITERATIONS` sets the number of schedules for a
//! longer soak.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{
    BatchClaimStore, BoxError, ClaimRequest, ClaimStore, ConsumerName, Error, Fingerprint,
    Identified, Message, MessageId, Processor, Stamp, StoreClock, TransactionalStore,
};
use shuttle::future::{self, yield_now};
use shuttle::rand::{Rng, thread_rng};
use shuttle::scheduler::RandomScheduler;
use shuttle::sync::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;

use super::settle::Ctx;
use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::decode::Raw;
use crate::id_source::IdSource;
use crate::metrics::Instruments;
use crate::retry::RetryPolicy;
use crate::source::Delivery;
use idem_core::Handler;

/// Schedules per test unless `IDEM_SHUTTLE_ITERATIONS` says otherwise: about two seconds each
/// in a debug build.
fn iterations(default: usize) -> usize {
    std::env::var("IDEM_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The deliveries of one schedule: (message ID, payload). `b` is published twice with
/// different payloads (a producer bug: whichever commits first wins, the other conflicts).
const DELIVERIES: &[(Option<&str>, &str)] = &[
    (Some("a"), "A"),
    (Some("a"), "A"),
    (Some("a"), "A"),
    (Some("b"), "B1"),
    (Some("b"), "B2"),
    (Some("b"), "B1"),
    (Some("c"), "C"),
    (None, "no id"),
];

// ---- the store -------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Db {
    next_tx: u64,
    open: usize,
    /// Committed claims: message ID → fingerprint.
    claims: HashMap<Vec<u8>, Fingerprint>,
    /// Claims of open transactions: message ID → (transaction, fingerprint).
    pending: HashMap<Vec<u8>, (u64, Fingerprint)>,
    /// Committed handler effects: (message ID, payload).
    effects: Vec<(Vec<u8>, Vec<u8>)>,
}

#[derive(Debug, Clone, Default)]
struct Store {
    db: Arc<Mutex<Db>>,
}

impl Store {
    fn db(&self) -> MutexGuard<'_, Db> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug)]
struct Tx {
    id: u64,
    claims: Vec<Vec<u8>>,
    effects: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Db {
    fn forget_pending(&mut self, claims: &[Vec<u8>]) {
        for id in claims {
            self.pending.remove(id);
        }
        self.open -= 1;
    }
}

impl TransactionalStore for Store {
    type Tx = Tx;

    async fn begin(&self) -> Result<Tx, Error> {
        yield_now().await;
        let mut db = self.db();
        db.next_tx += 1;
        db.open += 1;
        Ok(Tx {
            id: db.next_tx,
            claims: Vec::new(),
            effects: Vec::new(),
        })
    }

    async fn commit(&self, tx: Tx) -> Result<(), Error> {
        yield_now().await;
        let mut db = self.db();
        for id in &tx.claims {
            let (_, fp) = db
                .pending
                .remove(id)
                .expect("a claim of this open transaction");
            db.claims.insert(id.clone(), fp);
        }
        db.effects.extend(tx.effects);
        db.open -= 1;
        Ok(())
    }

    async fn rollback(&self, tx: Tx) -> Result<(), Error> {
        self.db().forget_pending(&tx.claims);
        Ok(())
    }
}

impl ClaimStore for Store {
    fn max_message_id_len(&self) -> usize {
        255
    }

    async fn claim(
        &self,
        tx: &mut Tx,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        yield_now().await;
        let id = claim.id.as_bytes().to_vec();
        loop {
            {
                let mut db = self.db();
                if let Some(fp) = db.claims.get(&id) {
                    return Ok(Some(*fp));
                }
                match db.pending.get(&id) {
                    // Inserted earlier in this transaction (a batch repeating an ID).
                    Some((owner, fp)) if *owner == tx.id => return Ok(Some(*fp)),
                    // Another open transaction holds the key: wait until it ends, as an insert
                    // into a unique index does.
                    Some(_) => {}
                    None => {
                        db.pending.insert(id.clone(), (tx.id, *claim.fingerprint));
                        tx.claims.push(id);
                        return Ok(None);
                    }
                }
            }
            // Waiting yields instead of blocking the thread, as a driver's wait for a lock
            // does: one task may hold the key in one transaction while it waits in another
            // (a batch's failed messages retried together, two of them with the same ID).
            yield_now().await;
        }
    }
}

impl BatchClaimStore for Store {
    /// One claim after another, each waiting as [`Store::claim`] does: the batch's claims are
    /// one statement in a real database, which waits for held keys the same way.
    async fn claim_many(
        &self,
        tx: &mut Tx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let mut found = Vec::with_capacity(items.len());
        for (id, fingerprint) in items {
            let request = ClaimRequest {
                consumer,
                id,
                fingerprint,
                at,
            };
            found.push(self.claim(tx, request).await?);
        }
        Ok(found)
    }
}

// ---- the handler -----------------------------------------------------------------------------

/// Writes its effect into the transaction, and fails one time in five: rejected (dead-lettered
/// as such) or retryable (retried; dead-lettered as retries exhausted after [`ATTEMPTS`]).
#[derive(Debug, Default)]
struct Effect {
    rejected: AtomicU64,
    failed: AtomicU64,
}

impl Handler<Tx, Vec<u8>> for Arc<Effect> {
    type Output = ();

    async fn handle(&self, tx: &mut Tx, msg: &Message<Vec<u8>>) -> Result<(), BoxError> {
        yield_now().await;
        tx.effects
            .push((msg.message_id().as_bytes().to_vec(), msg.payload().clone()));
        yield_now().await;
        match thread_rng().gen_range(0..10) {
            0 => {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                Err(Error::reject("injected").into())
            }
            1 => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                Err(Error::retry("injected").into())
            }
            _ => Ok(()),
        }
    }
}

// ---- the deliveries --------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum How {
    Acked,
    DeadLettered(DeadLetterReason),
    Abandoned,
}

#[derive(Debug)]
struct TestDelivery {
    index: usize,
    id: Option<&'static str>,
    payload: &'static [u8],
    store: Store,
    log: Arc<Mutex<Vec<(usize, How)>>>,
}

impl TestDelivery {
    fn record(&self, how: How) {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((self.index, how));
    }

    /// The fingerprint committed under this delivery's ID, if any, and whether this payload's
    /// effect committed.
    fn committed(&self) -> (Option<Fingerprint>, bool) {
        let Some(id) = self.id else {
            return (None, false);
        };
        let db = self.store.db();
        let effect = db
            .effects
            .iter()
            .any(|(i, p)| i.as_slice() == id.as_bytes() && p.as_slice() == self.payload);
        (db.claims.get(id.as_bytes()).copied(), effect)
    }
}

impl Delivery for TestDelivery {
    fn payload(&self) -> &[u8] {
        self.payload
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        match (name, self.id) {
            ("message-id", Some(id)) => Some(Cow::Borrowed(id.as_bytes())),
            _ => None,
        }
    }

    fn fmt_origin(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "delivery #{}", self.index)
    }

    async fn ack(self) -> Result<(), Error> {
        yield_now().await;
        // Nothing is acknowledged that did not commit: this payload's claim and effect are in
        // the store (a duplicate's too: its original committed first).
        assert_eq!(
            self.committed(),
            (Some(Fingerprint::of(self.payload)), true),
            "{} acked before its claim and effect committed",
            self.origin()
        );
        self.record(How::Acked);
        Ok(())
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        yield_now().await;
        if reason.reason() == DeadLetterReason::Conflict {
            let stored = self
                .committed()
                .0
                .expect("a conflict has a committed claim");
            assert_ne!(
                stored,
                Fingerprint::of(self.payload),
                "a conflict with itself"
            );
        }
        self.record(How::DeadLettered(reason.reason()));
        Ok(())
    }

    async fn abandon(self) {
        self.record(How::Abandoned);
    }
}

// ---- one schedule ----------------------------------------------------------------------------

type TestCtx = Ctx<Store, StoreClock, Raw, super::work::Batched<Arc<Effect>>>;

/// Attempts per message before a retryable failure is dead-lettered.
const ATTEMPTS: u32 = 3;

/// The context of one schedule; `cache`: with the local cache of completed claims on, so
/// redeliveries of committed IDs are settled from it (and must still be acked only after
/// their commit, and a cached ID with another payload still dead-lettered as a conflict).
fn context(store: Store, effect: Arc<Effect>, cache: bool) -> Arc<TestCtx> {
    let processor = Processor::builder(store, "schedules")
        .build()
        .expect("processor");
    Arc::new(Ctx {
        processor: Arc::new(processor),
        decoder: Raw,
        work: super::work::Batched(effect),
        id_source: IdSource::header("message-id"),
        // Retried at once (no tokio timer, which shuttle cannot drive), up to three attempts.
        retry: RetryPolicy::exponential(ATTEMPTS, Duration::ZERO, Duration::ZERO),
        consumer: "schedules".to_owned(),
        broker: "shuttle",
        instruments: Instruments::new("schedules", "shuttle"),
        stop: CancellationToken::new(),
        fatal: std::sync::Mutex::new(None),
        after_commit: None,
        cache: cache
            .then(|| {
                crate::cache::ClaimCache::new(
                    crate::LocalCache::new(100),
                    Duration::from_secs(3600),
                    None,
                )
            })
            .flatten(),
    })
}

/// Runs every delivery concurrently: each in its own `settle_one` task, or (`batches`) some
/// grouped into `settle_batch` calls, each batch in ID order as lock ordering in a real
/// database would need to avoid deadlocks between batches.
fn one_schedule(batches: bool, cache: bool) {
    let store = Store::default();
    let effect = Arc::new(Effect::default());
    let ctx = context(store.clone(), effect.clone(), cache);
    let log = Arc::new(Mutex::new(Vec::new()));
    let deliveries: Vec<TestDelivery> = DELIVERIES
        .iter()
        .enumerate()
        .map(|(index, (id, payload))| TestDelivery {
            index,
            id: *id,
            payload: payload.as_bytes(),
            store: store.clone(),
            log: log.clone(),
        })
        .collect();

    let mut groups: Vec<Vec<TestDelivery>> = Vec::new();
    for d in deliveries {
        match groups.last_mut() {
            Some(g) if batches && g.len() < 3 && thread_rng().gen_bool(0.5) => g.push(d),
            _ => groups.push(vec![d]),
        }
    }
    future::block_on(async move {
        let tasks: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                let ctx = ctx.clone();
                future::spawn(async move {
                    if group.len() == 1 {
                        let d = group.pop().expect("one delivery");
                        ctx.settle_one(d).await;
                    } else {
                        group.sort_by_key(|d| d.id);
                        ctx.settle_batch(group).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("settle task");
        }
        check(&store, &effect, &ctx, &log);
    });
}

fn check(store: &Store, effect: &Effect, ctx: &TestCtx, log: &Mutex<Vec<(usize, How)>>) {
    let db = store.db();
    assert_eq!(db.open, 0, "a transaction was left open");
    assert!(db.pending.is_empty(), "an uncommitted claim was left");

    // Each ID's effect committed at most once, and exactly when its claim did.
    let mut effects: HashMap<&[u8], &[u8]> = HashMap::new();
    for (id, payload) in &db.effects {
        let earlier = effects.insert(id, payload);
        assert!(
            earlier.is_none(),
            "the effect of {} committed twice",
            String::from_utf8_lossy(id)
        );
        assert_eq!(
            db.claims.get(id.as_slice()),
            Some(&Fingerprint::of(payload)),
            "an effect without its claim"
        );
    }
    assert_eq!(effects.len(), db.claims.len(), "a claim without its effect");

    // Every delivery settled exactly once, never abandoned.
    let log = log.lock().unwrap_or_else(|p| p.into_inner());
    let mut how: HashMap<usize, How> = HashMap::new();
    for (index, h) in log.iter() {
        assert!(
            how.insert(*index, h.clone()).is_none(),
            "delivery #{index} settled twice"
        );
    }
    let mut acked = 0u64;
    let mut rejected = 0u64;
    let mut exhausted = 0u64;
    let mut conflicts = 0u64;
    for (index, (id, payload)) in DELIVERIES.iter().enumerate() {
        let h = how
            .get(&index)
            .unwrap_or_else(|| panic!("delivery #{index} was never settled"));
        let Some(id) = id else {
            assert_eq!(*h, How::DeadLettered(DeadLetterReason::MissingId));
            continue;
        };
        let winner = effects.get(id.as_bytes()).copied();
        match h {
            How::Acked => {
                acked += 1;
                assert_eq!(
                    winner,
                    Some(payload.as_bytes()),
                    "delivery #{index} acked but its payload is not the one committed"
                );
            }
            How::DeadLettered(DeadLetterReason::Conflict) => {
                conflicts += 1;
                assert!(
                    winner.is_some_and(|w| w != payload.as_bytes()),
                    "delivery #{index} dead-lettered as a conflict without one"
                );
            }
            How::DeadLettered(DeadLetterReason::Rejected) => rejected += 1,
            How::DeadLettered(DeadLetterReason::RetriesExhausted) => exhausted += 1,
            other => panic!("delivery #{index} settled as {other:?}"),
        }
    }
    // Every rejection is dead-lettered at once; every retryable failure is retried, except the
    // last of a message that used up its attempts, which is dead-lettered instead.
    assert_eq!(
        rejected,
        effect.rejected.load(Ordering::Relaxed),
        "dead letters for rejections (a processed or duplicate delivery dead-lettered?)"
    );
    let failed = effect.failed.load(Ordering::Relaxed);
    let stats = ctx.instruments.snapshot();
    assert_eq!(
        stats.retries + exhausted,
        failed,
        "retryable failures: each retried, or the last of {ATTEMPTS} and dead-lettered"
    );
    assert!(
        failed >= exhausted * u64::from(ATTEMPTS),
        "{exhausted} dead-lettered as retries exhausted after {failed} retryable failures in all"
    );
    assert_eq!(stats.processed, effects.len() as u64, "processed count");
    assert_eq!(stats.duplicates, acked - stats.processed, "duplicate count");
    assert_eq!(stats.conflicts, conflicts, "conflict count");
    assert_eq!(stats.abandoned, 0, "abandoned count");
}

/// `shuttle::check_random` with room on each task's stack: the settle futures are deep in a
/// debug build, and a panic on shuttle's default 60 KiB stack can overflow it while unwinding,
/// which kills the test binary with SIGSEGV before the failing seed is printed.
fn check_random(iterations: usize, f: impl Fn() + Send + Sync + 'static) {
    let mut config = shuttle::Config::new();
    config.stack_size = 256 << 10;
    shuttle::Runner::new(RandomScheduler::new(iterations), config).run(f);
}

#[test]
fn settle_one_settles_each_delivery_once_and_commits_each_effect_once() {
    check_random(iterations(500), || one_schedule(false, false));
}

#[test]
fn settle_one_with_the_local_cache_keeps_the_same_guarantees() {
    check_random(iterations(500), || one_schedule(false, true));
}

#[test]
fn settle_batch_and_settle_one_together_keep_the_same_guarantees() {
    check_random(iterations(1_000), || one_schedule(true, false));
}

#[test]
fn settle_batch_and_settle_one_with_the_local_cache_keep_the_same_guarantees() {
    check_random(iterations(1_000), || one_schedule(true, true));
}
