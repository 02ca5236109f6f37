//! The broker conformance suite: the checks every adapter must pass against its real broker.
//!
//! Each check gets a fresh [`BrokerFixture`] (its own destination) and a fresh SQLite effects
//! database, runs the real [`Consumer`] over the adapter's source, and judges by what committed:
//! one effect row per message ID, never two, never none.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_consumer::{
    CancellationToken, Consumer, DeadLetter, Delivery, Json, Observer, RetryPolicy, RunStats,
    Source,
};
use idem_core::{BoxError, Error, Identified, Message, Migrate, Processor};
use idem_sql::{SqliteOptions, SqliteStore, TableName, Tx};
use sqlx::Sqlite;
use tokio::task::JoinHandle;

use crate::broker_fixture::{BrokerFixture, DeadLettered};
use crate::services::{service_url, unique_name};

/// The payload every check publishes: `{"n": <integer>}`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Order {
    /// Any number; distinct payloads make distinct fingerprints.
    pub n: i64,
}

/// The ID limit the checks configure, small enough that every broker can carry a longer ID.
pub const MAX_ID_LEN: usize = 64;

/// How every check's handler behaves.
#[derive(Debug, Default)]
pub struct Behaviour {
    /// IDs whose first attempt fails with a retryable error.
    pub fail_once: Mutex<HashSet<String>>,
    /// IDs that always fail with a retryable error.
    pub always_fail: HashSet<String>,
    /// Time spent inside the transaction per message.
    pub delay: Duration,
}

/// The checks' handler: one row per processed message in `effects`.
#[derive(Debug, Clone)]
pub struct EffectHandler(pub Arc<Behaviour>);

impl EffectHandler {
    /// What [`Behaviour`] says for `msg`: wait, fail, or go on (with its ID as text).
    async fn behave(&self, msg: &Message<Order>) -> Result<String, BoxError> {
        let id = msg.message_id().to_string();
        if !self.0.delay.is_zero() {
            tokio::time::sleep(self.0.delay).await;
        }
        if self.0.always_fail.contains(&id) {
            return Err(Error::retry("this test message always fails").into());
        }
        let first_failure = self
            .0
            .fail_once
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if first_failure {
            return Err(Error::retry("this test message fails once").into());
        }
        Ok(id)
    }
}

impl idem_consumer::Handler<Tx<Sqlite>, Order> for EffectHandler {
    type Output = ();

    async fn handle(&self, tx: &mut Tx<Sqlite>, msg: &Message<Order>) -> Result<(), BoxError> {
        let id = self.behave(msg).await?;
        sqlx::query("INSERT INTO effects (message_id, n) VALUES (?, ?)")
            .bind(&id)
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl idem_consumer::SetHandler<Tx<Sqlite>, Order> for EffectHandler {
    type Output = ();

    /// The same behaviour per message, and one multi-row insert for the whole set: any
    /// failing message fails the set, which the runner then processes message by message.
    async fn handle_set(
        &self,
        tx: &mut Tx<Sqlite>,
        msgs: &[&Message<Order>],
    ) -> Result<(), BoxError> {
        for msg in msgs {
            self.behave(msg).await?;
        }
        let mut insert = sqlx::QueryBuilder::<Sqlite>::new("INSERT INTO effects (message_id, n) ");
        insert.push_values(msgs, |mut row, msg| {
            row.push_bind(msg.message_id().to_string())
                .push_bind(msg.payload().n);
        });
        insert.build().execute(&mut **tx).await?;
        Ok(())
    }
}

/// How the suite's consumers process; the macro runs every check in each mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One message per transaction ([`Consumer::run`]).
    PerMessage,
    /// Up to this many deliveries per transaction, the handler per message
    /// ([`Consumer::batch`], then `run`).
    Batch(usize),
    /// Up to this many deliveries per transaction, one set handler for the batch's new
    /// messages ([`Consumer::batch`], then `run_set`).
    Set(usize),
}

impl Mode {
    /// Deliveries per transaction, at most.
    pub fn batch_size(self) -> usize {
        match self {
            Mode::PerMessage => 1,
            Mode::Batch(n) | Mode::Set(n) => n,
        }
    }
}

/// A fresh SQLite effects database and processor for one check.
#[derive(Debug)]
pub struct Harness {
    store: SqliteStore,
    dir: PathBuf,
    processor: Arc<Processor<SqliteStore>>,
}

impl Harness {
    /// Creates the database in a temporary folder.
    pub async fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name("idem_broker", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("effects.db"), SqliteOptions::default())
            .await
            .expect("open sqlite")
            .with_table(TableName::new("claims").expect("valid"))
            .expect("plain table");
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL, n INTEGER NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        let processor = Processor::builder(store.clone(), "conformance")
            .max_message_id_len(MAX_ID_LEN)
            .build()
            .expect("processor");
        Self {
            store,
            dir,
            processor: Arc::new(processor),
        }
    }

    /// Effect rows for `id`.
    pub async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = ?")
            .bind(id)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    /// Effect rows in all.
    pub async fn total_effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    /// IDs with more than one effect row: must always be empty.
    pub async fn doubled(&self) -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT message_id, count(*) FROM effects GROUP BY message_id HAVING count(*) > 1",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("doubles")
    }

    /// Starts a consumer on `source` in `mode`, with 4 in flight and quick retries.
    pub fn spawn<S: Source>(&self, source: S, handler: EffectHandler, mode: Mode) -> Running {
        let consumer = Consumer::new(self.processor.clone(), source)
            .concurrency(4)
            .retry(RetryPolicy::exponential(
                3,
                Duration::from_millis(20),
                Duration::from_millis(100),
            ));
        let observer = consumer.observer();
        let stop = CancellationToken::new();
        let decoder = Json::<Order>::new();
        let task = match mode {
            Mode::PerMessage => tokio::spawn(consumer.run(decoder, handler, stop.clone())),
            Mode::Batch(n) => tokio::spawn(consumer.batch(n).run(decoder, handler, stop.clone())),
            Mode::Set(n) => tokio::spawn(consumer.batch(n).run_set(decoder, handler, stop.clone())),
        };
        Running {
            observer,
            stop,
            task,
        }
    }

    /// Closes and deletes the database.
    pub async fn teardown(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A consumer running in a task.
#[derive(Debug)]
pub struct Running {
    /// Its live counts.
    pub observer: Observer,
    stop: CancellationToken,
    task: JoinHandle<Result<RunStats, Error>>,
}

impl Running {
    /// Requests a graceful stop and waits (at most 60 s) for the run's final counts.
    pub async fn stop(self) -> RunStats {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the consumer stops within 60 s of shutdown")
            .expect("the consumer task does not panic")
            .expect("the consumer run ends without a fatal error")
    }
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub async fn eventually<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Generous wait for work the broker hands out promptly.
const PROMPT: Duration = Duration::from_secs(30);

fn order(n: i64) -> Vec<u8> {
    format!("{{\"n\":{n}}}").into_bytes()
}

async fn setup<F: BrokerFixture>(test: &str) -> Option<(F, Harness)> {
    let url = if F::URL_VAR.is_empty() {
        String::new()
    } else {
        service_url(F::URL_VAR, test)?
    };
    let fixture = F::setup(url, unique_name("idem", test)).await;
    Some((fixture, Harness::new(test).await))
}

/// The same message published twice commits one effect; the second is acked as a duplicate.
pub async fn duplicate_publish_is_one_effect_and_one_duplicate<F: BrokerFixture>(
    test: &str,
    mode: Mode,
) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    fx.publish(Some("dup-a"), &order(1)).await;
    fx.publish(Some("dup-a"), &order(1)).await;
    fx.publish(Some("dup-b"), &order(2)).await;

    let run = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    let obs = run.observer.clone();
    let settled = eventually(PROMPT, || {
        let s = obs.snapshot();
        async move { s.processed == 2 && s.duplicates == 1 }
    })
    .await;
    let stats = run.stop().await;
    assert!(settled, "expected 2 processed + 1 duplicate, got {stats:?}");
    assert_eq!(h.effects("dup-a").await, 1);
    assert_eq!(h.effects("dup-b").await, 1);
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    h.teardown().await;
    fx.teardown().await;
}

/// A source whose deliveries are never acknowledged and which vanishes without closing: a
/// consumer process killed after its commit, before its ack.
#[derive(Debug)]
pub struct KilledBeforeAck<S> {
    inner: Option<S>,
    swallowed: Arc<AtomicU64>,
}

/// A delivery of [`KilledBeforeAck`].
#[derive(Debug)]
pub struct UnackedDelivery<D> {
    inner: D,
    swallowed: Arc<AtomicU64>,
}

impl<S: Source> Source for KilledBeforeAck<S> {
    type Delivery = UnackedDelivery<S::Delivery>;

    fn broker(&self) -> &'static str {
        self.inner.as_ref().map_or("killed", |s| s.broker())
    }

    fn default_id_source(&self) -> idem_consumer::IdSource {
        self.inner
            .as_ref()
            .map_or(idem_consumer::IdSource::BrokerId, |s| s.default_id_source())
    }

    async fn next(&mut self, max: usize) -> Result<Vec<Self::Delivery>, Error> {
        let Some(inner) = self.inner.as_mut() else {
            return Ok(Vec::new());
        };
        Ok(inner
            .next(max)
            .await?
            .into_iter()
            .map(|d| UnackedDelivery {
                inner: d,
                swallowed: self.swallowed.clone(),
            })
            .collect())
    }

    async fn close(mut self) -> Result<(), Error> {
        // A killed process flushes nothing: drop the connection without the adapter's close.
        drop(self.inner.take());
        Ok(())
    }
}

impl<D: Delivery> Delivery for UnackedDelivery<D> {
    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.inner.header(name)
    }
    fn broker_id(&self) -> Option<Cow<'_, [u8]>> {
        self.inner.broker_id()
    }
    fn previous_deliveries(&self) -> u32 {
        self.inner.previous_deliveries()
    }
    fn fmt_origin(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt_origin(f)
    }
    async fn ack(self) -> Result<(), Error> {
        // Committed, then killed before the ack left the process.
        self.swallowed.fetch_add(1, Ordering::SeqCst);
        std::mem::forget(self.inner);
        Ok(())
    }
    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        self.inner.dead_letter(reason).await
    }
    async fn abandon(self) {
        self.inner.abandon().await
    }
}

/// Committed but not acknowledged, then the consumer dies: the broker redelivers to a new
/// consumer, which finds the claim and acks a duplicate. Still one effect.
pub async fn killed_after_commit_before_ack_redelivers_as_duplicate<F: BrokerFixture>(
    test: &str,
    mode: Mode,
) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    fx.publish(Some("crash-1"), &order(7)).await;

    let swallowed = Arc::new(AtomicU64::new(0));
    let killed = KilledBeforeAck {
        inner: Some(fx.source().await),
        swallowed: swallowed.clone(),
    };
    let first = h.spawn(killed, EffectHandler(Arc::default()), mode);
    let committed = eventually(PROMPT, || {
        let n = swallowed.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    let first_stats = first.stop().await;
    assert!(committed, "the first consumer commits: {first_stats:?}");
    assert_eq!(h.effects("crash-1").await, 1);

    let second = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    let obs = second.observer.clone();
    let redelivered = eventually(fx.redelivery_timeout() + PROMPT, || {
        let s = obs.snapshot();
        async move { s.duplicates >= 1 }
    })
    .await;
    let stats = second.stop().await;
    assert!(
        redelivered,
        "the unacknowledged message is redelivered to the new consumer as a duplicate: {stats:?}"
    );
    assert_eq!(stats.processed, 0, "{stats:?}");
    assert_eq!(h.effects("crash-1").await, 1);
    h.teardown().await;
    fx.teardown().await;
}

/// Two consumers on one destination, every message published twice, and one of them killed
/// after committing without acking: its messages are redelivered to the others while they
/// run. One effect per message.
pub async fn two_consumers_with_overlapping_redeliveries_commit_each_message_once<
    F: BrokerFixture,
>(
    test: &str,
    mode: Mode,
) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    const N: i64 = 20;
    let swallowed = Arc::new(AtomicU64::new(0));
    let killed = KilledBeforeAck {
        inner: Some(fx.source().await),
        swallowed: swallowed.clone(),
    };
    let a = h.spawn(killed, EffectHandler(Arc::default()), mode);
    let b = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    for i in 0..N {
        fx.publish(Some(&format!("pair-{i}")), &order(i)).await;
        fx.publish(Some(&format!("pair-{i}")), &order(i)).await;
    }
    let all = eventually(PROMPT, || async { h.total_effects().await >= N }).await;
    let sa = a.stop().await;
    assert!(
        all,
        "every message committed once: {sa:?} {:?}",
        b.observer.snapshot()
    );
    // A replacement for the killed consumer (on MQTT it resumes the dead session).
    let c = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    let (ob, oc) = (b.observer.clone(), c.observer.clone());
    // Everything the killed consumer handled comes back: B and C settle all 2N deliveries.
    let settled = eventually(fx.redelivery_timeout() + PROMPT, || {
        let (x, y) = (ob.snapshot(), oc.snapshot());
        async move { x.processed + y.processed + x.duplicates + y.duplicates >= 2 * N as u64 }
    })
    .await;
    let (sb, sc) = (b.stop().await, c.stop().await);
    assert!(
        settled,
        "the killed consumer's {} unacknowledged deliveries were redelivered and settled: {sa:?} {sb:?} {sc:?}",
        swallowed.load(Ordering::SeqCst)
    );
    assert_eq!(
        sa.processed + sb.processed + sc.processed,
        N as u64,
        "{sa:?} {sb:?} {sc:?}"
    );
    assert_eq!(h.total_effects().await, N);
    assert!(h.doubled().await.is_empty(), "{:?}", h.doubled().await);
    h.teardown().await;
    fx.teardown().await;
}

/// After dead-lettering, the originals must have been acknowledged: a fresh consumer running
/// for the redelivery timeout receives nothing (a redelivered original would be processed,
/// found a duplicate, or dead-lettered again).
async fn assert_nothing_comes_back<F: BrokerFixture>(fx: &F, h: &Harness, mode: Mode) {
    let fresh = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    tokio::time::sleep(fx.redelivery_timeout()).await;
    let stats = fresh.stop().await;
    assert_eq!(
        stats.processed + stats.duplicates + stats.dead_lettered,
        0,
        "dead-lettered originals were acknowledged, not redelivered: {stats:?}"
    );
}

fn by_reason(letters: &[DeadLettered]) -> HashMap<String, &DeadLettered> {
    letters
        .iter()
        .filter_map(|d| {
            d.headers
                .get(idem_consumer::REASON_HEADER)
                .map(|r| (r.clone(), d))
        })
        .collect()
}

/// Starts a consumer and waits until `id` with `payload` has committed: the original that a
/// later conflicting publish under the same ID needs.
async fn spawn_with_committed_original<F: BrokerFixture>(
    fx: &F,
    h: &Harness,
    mode: Mode,
    id: &str,
    payload: &[u8],
) -> Running {
    let run = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    fx.publish(Some(id), payload).await;
    let original = eventually(PROMPT, || async { h.effects(id).await == 1 }).await;
    assert!(original, "the original of the conflicting ID {id} commits");
    run
}

/// No ID, an oversized ID, an undecodable payload and a conflicting payload each land in the
/// dead-letter destination with their reason and the original payload; nothing else happens.
pub async fn poison_messages_are_dead_lettered_with_reason_and_intact_payload<F: BrokerFixture>(
    test: &str,
    mode: Mode,
) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    let run = spawn_with_committed_original(&fx, &h, mode, "poison-c", &order(3)).await;

    let oversized = "x".repeat(MAX_ID_LEN + 36);
    fx.publish(None, &order(1)).await;
    fx.publish(Some(&oversized), &order(5)).await;
    fx.publish(Some("poison-bad-json"), b"not json {").await;
    fx.publish(Some("poison-c"), &order(4)).await;

    let letters = fx.dead_letters(4, PROMPT).await;
    let stats = run.stop().await;
    let reasons = by_reason(&letters);
    let expect = [
        ("missing-id", order(1)),
        ("invalid-id", order(5)),
        ("undecodable", b"not json {".to_vec()),
        ("conflict", order(4)),
    ];
    for (reason, payload) in &expect {
        let Some(dl) = reasons.get(*reason) else {
            panic!("no dead letter with reason {reason}: got {letters:?}, stats {stats:?}");
        };
        assert_eq!(&dl.payload, payload, "{reason}: payload intact");
        let detail = dl.headers.get(idem_consumer::DETAIL_HEADER);
        assert!(
            detail.is_some_and(|d| !d.is_empty()),
            "{reason}: detail attached: {dl:?}"
        );
    }
    assert_eq!(letters.len(), 4, "{letters:?}");
    assert_eq!(stats.conflicts, 1, "{stats:?}");
    assert_eq!(
        h.total_effects().await,
        1,
        "poison never reaches the handler"
    );
    h.teardown().await;
    fx.teardown().await;
}

/// Shutdown while slow messages are in flight: what committed is acked, the rest is
/// redelivered to the next consumer. Every message ends with exactly one effect.
pub async fn graceful_shutdown_in_flight_loses_nothing_and_doubles_nothing<F: BrokerFixture>(
    test: &str,
    mode: Mode,
) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    // Many more than can be in flight (4 units of BATCH_SIZE), so shutdown lands mid-stream.
    let n = 40 * mode.batch_size() as i64;
    for i in 0..n {
        fx.publish(Some(&format!("inflight-{i}")), &order(i)).await;
    }
    let slow = EffectHandler(Arc::new(Behaviour {
        delay: Duration::from_millis(50),
        ..Behaviour::default()
    }));
    let first = h.spawn(fx.source().await, slow, mode);
    let started = eventually(PROMPT, || async { h.total_effects().await >= 1 }).await;
    assert!(started, "the first consumer commits something");
    let first_stats = first.stop().await;
    let after_first = h.total_effects().await;
    assert_eq!(first_stats.processed as i64, after_first, "{first_stats:?}");
    assert_eq!(first_stats.ack_failures, 0, "{first_stats:?}");
    assert!(
        after_first < n,
        "shutdown happened mid-stream: {first_stats:?}"
    );

    let second = h.spawn(fx.source().await, EffectHandler(Arc::default()), mode);
    let rest = eventually(fx.redelivery_timeout() + PROMPT, || async {
        h.total_effects().await >= n
    })
    .await;
    // A committed message the first consumer failed to acknowledge would come back only
    // after the broker's redelivery timeout: wait that long before judging.
    tokio::time::sleep(fx.redelivery_timeout()).await;
    let second_stats = second.stop().await;
    assert!(
        rest,
        "every message committed in the end: {first_stats:?} {second_stats:?}"
    );
    assert_eq!(
        second_stats.duplicates, 0,
        "the first consumer acknowledged everything it committed before it stopped: {first_stats:?} {second_stats:?}"
    );
    assert_eq!(h.total_effects().await, n);
    assert!(h.doubled().await.is_empty(), "{:?}", h.doubled().await);
    h.teardown().await;
    fx.teardown().await;
}

/// A message that fails once is retried and commits; one that always fails is dead-lettered
/// as `retries-exhausted` with its payload.
pub async fn retries_then_dead_letter_when_exhausted<F: BrokerFixture>(test: &str, mode: Mode) {
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    let behaviour = Behaviour {
        fail_once: Mutex::new(HashSet::from(["retry-flaky".to_owned()])),
        always_fail: HashSet::from(["retry-doomed".to_owned()]),
        ..Behaviour::default()
    };
    fx.publish(Some("retry-flaky"), &order(1)).await;
    fx.publish(Some("retry-doomed"), &order(2)).await;
    let run = h.spawn(fx.source().await, EffectHandler(Arc::new(behaviour)), mode);
    let letters = fx.dead_letters(1, PROMPT).await;
    let flaky = eventually(PROMPT, || async { h.effects("retry-flaky").await == 1 }).await;
    let stats = run.stop().await;
    assert!(flaky, "the flaky message commits after a retry: {stats:?}");
    assert_eq!(letters.len(), 1, "{letters:?}");
    let dl = &letters[0];
    assert_eq!(
        dl.headers
            .get(idem_consumer::REASON_HEADER)
            .map(String::as_str),
        Some("retries-exhausted"),
        "{dl:?}"
    );
    assert_eq!(dl.payload, order(2));
    assert_eq!(h.effects("retry-doomed").await, 0);
    // flaky: 1 retry; doomed: 3 attempts = 2 retries. A failed set costs its messages no
    // attempt (they are processed again one by one), so there flaky may commit on its own
    // first try.
    let least = if matches!(mode, Mode::Set(_)) { 2 } else { 3 };
    assert!(stats.retries >= least, "{stats:?}");
    assert_nothing_comes_back(&fx, &h, mode).await;
    h.teardown().await;
    fx.teardown().await;
}

/// The corpus's "huge": a 10 MiB ID, a 10 MiB payload.
pub const HUGE: usize = 10 * 1024 * 1024;

/// Room a dead letter needs for its own headers (reason, a detail of at most 1 KiB, where it
/// came from, a cut ID) on top of the original: a message this close to the broker's limit
/// cannot be dead-lettered intact, so the corpus's largest messages stay this far below it.
pub const DEAD_LETTER_ROOM: usize = 8 * 1024;

/// What must become of one corpus message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expect {
    /// Exactly one dead letter with this reason and the payload intact.
    DeadLetter(&'static str),
    /// Processed: exactly one effect for the ID as [`MessageId`](idem_core::MessageId) prints it.
    Effect(String),
}

#[derive(Debug)]
struct Case {
    label: String,
    payload: Vec<u8>,
    expect: Expect,
    id_len: usize,
}

/// The bad input published so far, each followed by a good message.
struct Corpus<'a, F> {
    fx: &'a F,
    cases: Vec<Case>,
    goods: Vec<String>,
    /// What the producer refused, for the failure messages.
    refused: Vec<String>,
    n: i64,
}

impl<'a, F: BrokerFixture> Corpus<'a, F> {
    fn new(fx: &'a F) -> Self {
        Self {
            fx,
            cases: Vec::new(),
            goods: Vec::new(),
            refused: Vec::new(),
            n: 100,
        }
    }

    /// A payload no other corpus message has, so each dead letter is told apart by payload.
    fn order(&mut self) -> Vec<u8> {
        self.n += 1;
        order(self.n)
    }

    /// `{"n":…,"pad":"…"}` of exactly `len` bytes; cut short of its closing `"}` when `!valid`.
    fn padded(&mut self, len: usize, valid: bool) -> Vec<u8> {
        self.n += 1;
        let head = format!("{{\"n\":{},\"pad\":\"", self.n);
        let tail: &[u8] = if valid { b"\"}" } else { b"" };
        let mut p = Vec::with_capacity(len);
        p.extend_from_slice(head.as_bytes());
        p.resize(len - tail.len(), b'p');
        p.extend_from_slice(tail);
        p
    }

    async fn good(&mut self) {
        let id = format!("corpus-good-{}", self.goods.len());
        let payload = self.order();
        self.fx.publish(Some(&id), &payload).await;
        self.goods.push(id);
    }

    fn push(&mut self, label: &str, id: Option<&[u8]>, payload: Vec<u8>, expect: Expect) {
        self.cases.push(Case {
            label: label.to_owned(),
            payload,
            expect,
            id_len: id.map_or(0, <[u8]>::len),
        });
    }

    /// A message the broker must accept, then a good one.
    async fn accepted(&mut self, label: &str, id: Option<&[u8]>, payload: Vec<u8>, expect: Expect) {
        if let Err(e) = self.fx.try_publish(id, &payload).await {
            panic!("{label}: the broker must accept this message, got {e}");
        }
        self.push(label, id, payload, expect);
        self.good().await;
    }

    /// A message the adapter's producer may refuse with `InvalidMessageId` (the ID cannot
    /// travel on this broker unchanged); if it is accepted, `expect` must happen.
    async fn maybe_refused(
        &mut self,
        label: &str,
        id: Option<&[u8]>,
        payload: Vec<u8>,
        expect: Expect,
    ) {
        match self.fx.try_publish(id, &payload).await {
            Ok(()) => self.push(label, id, payload, expect),
            Err(e) => {
                assert_eq!(
                    e.kind(),
                    idem_core::ErrorKind::InvalidMessageId,
                    "{label}: a producer refuses an ID it cannot carry as the ID's fault: {e}"
                );
                self.refused.push(format!("{label}: {e}"));
            }
        }
        self.good().await;
    }

    /// A message the broker cannot take: the producer must say so with an error that blames
    /// the message (retrying cannot help), never drop it silently or report an outage.
    async fn refused(&mut self, label: &str, id: Option<&[u8]>, payload: &[u8]) {
        match self.fx.try_publish(id, payload).await {
            Ok(()) => panic!(
                "{label}: the fixture says the broker refuses it, but it was accepted (fix MAX_ID_BYTES / MAX_MESSAGE_BYTES)"
            ),
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        idem_core::ErrorKind::InvalidMessageId | idem_core::ErrorKind::Rejected
                    ),
                    "{label}: refused as the message's fault (InvalidMessageId or Rejected), not {:?}: {e}",
                    e.kind()
                );
                self.refused.push(format!("{label}: {e}"));
            }
        }
    }
}

/// Bad input of every kind, each followed by a good message: no ID, empty IDs (and the
/// broker's own empty forms), a 10 MiB ID (or, where the broker refuses one, the refusal and
/// the longest ID it takes), non-UTF-8 and NUL bytes in the ID, the same ID with another
/// payload, malformed JSON, and huge payloads. Each bad message gets exactly one dead letter
/// with its documented reason, a detail and its payload intact, or is processed once where
/// the documented behaviour is to process it; every good message has one effect, and a last
/// good message after the corpus still commits.
pub async fn bad_input_corpus_is_dead_lettered_and_consuming_continues<F: BrokerFixture>(
    test: &str,
    mode: Mode,
) {
    use Expect::{DeadLetter as Dl, Effect};
    let Some((fx, h)) = setup::<F>(test).await else {
        return;
    };
    let run = spawn_with_committed_original(&fx, &h, mode, "corpus-conflict", &order(1)).await;

    let mut c = Corpus::new(&fx);
    let p = c.order();
    c.accepted("no ID", None, p, Dl("missing-id")).await;
    let p = c.order();
    c.maybe_refused("empty ID", Some(b""), p, Dl("missing-id"))
        .await;
    for form in F::EMPTY_ID_FORMS {
        let p = c.order();
        fx.publish_empty_id_form(form, &p).await;
        c.push(form, None, p, Dl("missing-id"));
        c.good().await;
    }

    // The longest ID: 10 MiB where the broker takes it, else its refusal and the longest it takes.
    let longest = F::MAX_ID_BYTES.min(F::MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM);
    if longest < HUGE {
        let p = c.order();
        c.refused("10 MiB ID", Some(&vec![b'i'; HUGE]), &p).await;
    }
    // An ID limit of its own below the message limit (a header or property limit) refuses too.
    if F::MAX_ID_BYTES < HUGE && 2 * F::MAX_ID_BYTES < F::MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM {
        let p = c.order();
        let label = format!("{} byte ID", 2 * F::MAX_ID_BYTES);
        c.refused(&label, Some(&vec![b'i'; 2 * F::MAX_ID_BYTES]), &p)
            .await;
    }
    let long_id = vec![b'i'; longest.min(HUGE)];
    let p = c.order();
    let label = format!("{} byte ID", long_id.len());
    c.accepted(&label, Some(&long_id), p, Dl("invalid-id"))
        .await;
    drop(long_id);

    // An ID is bytes: where the broker carries these unchanged they are processed.
    for (label, id) in [
        ("non-UTF-8 ID", &b"corpus-\xff\xfe-id"[..]),
        ("NUL bytes in the ID", &b"corpus-\0-nul\0"[..]),
    ] {
        let display = idem_core::MessageId::new(id)
            .expect("a valid ID")
            .to_string();
        let p = c.order();
        c.maybe_refused(label, Some(id), p, Effect(display)).await;
    }

    let p = c.order();
    c.accepted(
        "same ID, other payload",
        Some(b"corpus-conflict"),
        p,
        Dl("conflict"),
    )
    .await;
    for (i, payload) in [
        &b"{\"n\": 7,"[..],
        b"{\"n\":\"seven\"}",
        b"\xff\xfe{\"n\":7}",
        b"",
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("corpus-undecodable-{i}");
        c.accepted(
            &format!("undecodable payload {payload:?}"),
            Some(id.as_bytes()),
            payload.to_vec(),
            Dl("undecodable"),
        )
        .await;
    }

    // Huge payloads: 10 MiB where the broker takes it, else its refusal and the largest it takes.
    let largest = HUGE.min(F::MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM);
    if largest < HUGE && HUGE > F::MAX_MESSAGE_BYTES {
        let p = vec![b' '; HUGE];
        c.refused("10 MiB payload", Some(b"corpus-huge-refused"), &p)
            .await;
    }
    let p = c.padded(largest, false);
    c.accepted(
        &format!("{largest} byte malformed payload"),
        Some(b"corpus-huge-malformed"),
        p,
        Dl("undecodable"),
    )
    .await;
    let p = c.padded(largest, true);
    c.accepted(
        &format!("{largest} byte valid payload"),
        Some(b"corpus-huge-valid"),
        p,
        Effect("corpus-huge-valid".to_owned()),
    )
    .await;

    // The consumer keeps consuming.
    fx.publish(Some("corpus-last"), &order(2)).await;
    let letters_expected = c.cases.iter().filter(|k| matches!(k.expect, Dl(_))).count() as u64;
    let processed_expected = (c.goods.len()
        + 2
        + c.cases
            .iter()
            .filter(|k| matches!(k.expect, Effect(_)))
            .count()) as u64;
    let obs = run.observer.clone();
    let settled = eventually(PROMPT, || {
        let s = obs.snapshot();
        async move { s.dead_lettered >= letters_expected && s.processed >= processed_expected }
    })
    .await;
    let last = h.effects("corpus-last").await;
    let stats = run.stop().await;
    assert!(
        settled && last == 1,
        "every corpus message settled and the last good one committed ({last}): expected {letters_expected} dead letters and {processed_expected} processed, got {stats:?}"
    );
    // One more than expected, so that a doubled dead letter would show.
    let letters = fx
        .dead_letters(letters_expected as usize + 1, Duration::from_secs(2))
        .await;
    let summary = |d: &DeadLettered| {
        format!(
            "{} byte payload {:?}, reason {:?}",
            d.payload.len(),
            String::from_utf8_lossy(&d.payload[..d.payload.len().min(40)]),
            d.headers.get(idem_consumer::REASON_HEADER)
        )
    };
    let all: Vec<String> = letters.iter().map(summary).collect();

    for case in &c.cases {
        let label = &case.label;
        let mine: Vec<&DeadLettered> = letters
            .iter()
            .filter(|d| d.payload == case.payload)
            .collect();
        match &case.expect {
            Dl(reason) => {
                assert_eq!(
                    mine.len(),
                    1,
                    "{label}: exactly one dead letter; all: {all:?}; refused: {:?}",
                    c.refused
                );
                let dl = mine[0];
                assert_eq!(
                    dl.headers
                        .get(idem_consumer::REASON_HEADER)
                        .map(String::as_str),
                    Some(*reason),
                    "{label}: reason"
                );
                let detail = dl.headers.get(idem_consumer::DETAIL_HEADER);
                assert!(
                    detail.is_some_and(|d| !d.is_empty()),
                    "{label}: a detail: {:?}",
                    summary(dl)
                );
                if case.id_len > idem_consumer::DeadLetter::MAX_FORWARDED_ID_VALUE {
                    // Adapters that copy the original headers copy the ID cut short, and say so.
                    let longest = dl.headers.values().map(String::len).max().unwrap_or(0);
                    assert!(
                        longest <= 4 * 1024,
                        "{label}: the dead letter carries the ID cut short, not whole ({longest} bytes)"
                    );
                    let cut = "i".repeat(idem_consumer::DeadLetter::MAX_FORWARDED_ID_VALUE);
                    if dl.headers.values().any(|v| *v == cut) {
                        assert!(
                            dl.headers
                                .contains_key(idem_consumer::DeadLetter::TRUNCATED_HEADER),
                            "{label}: the dead letter says the ID was cut: {:?}",
                            dl.headers.keys().collect::<Vec<_>>()
                        );
                    }
                }
            }
            Effect(id) => {
                assert!(mine.is_empty(), "{label}: not dead-lettered: {all:?}");
                assert_eq!(h.effects(id).await, 1, "{label}: processed once as {id:?}");
            }
        }
    }
    assert_eq!(
        letters.len() as u64,
        letters_expected,
        "no other dead letters: {all:?}"
    );
    for id in &c.goods {
        assert_eq!(h.effects(id).await, 1, "good message {id}: one effect");
    }
    assert_eq!(h.effects("corpus-conflict").await, 1);
    assert!(h.doubled().await.is_empty(), "{:?}", h.doubled().await);
    assert_eq!(stats.dead_lettered, letters_expected, "{stats:?}");
    assert_eq!(stats.processed, processed_expected, "{stats:?}");
    assert_eq!(stats.conflicts, 1, "{stats:?}");
    assert_eq!(
        (
            stats.duplicates,
            stats.retries,
            stats.abandoned,
            stats.broker_errors
        ),
        (0, 0, 0, 0),
        "no redelivery, retry or failed dead letter: {stats:?}"
    );
    eprintln!(
        "{test}: {} cases, {} refused by the producer: {:?}",
        c.cases.len(),
        c.refused.len(),
        c.refused
    );
    h.teardown().await;
    fx.teardown().await;
}
