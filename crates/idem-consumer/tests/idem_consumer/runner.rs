//! Runner behaviours the broker suite does not reach: handler panics, a store outage that
//! must not empty the queue into the dead letters, and lost connections told apart from
//! outages (by a probe, and by the outage limit). In-memory fake broker; a real SQLite store,
//! or an in-memory one on paused time for outages that last minutes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idem_consumer::{
    ATTEMPTS_HEADER, CancellationToken, Consumer, Handler, InMemoryBroker, Json, REASON_HEADER,
    RetryPolicy, Settled,
};
use idem_core::{
    BoxError, ClaimRequest, ClaimStore, ErrorKind, Fingerprint, Identified, Message, Migrate,
    Processor, TransactionalStore,
};
use idem_sql::{SqliteOptions, SqliteStore, Tx};

#[derive(Debug, serde::Deserialize)]
struct Ping {
    n: i64,
}

struct PanicsOnBoom;

impl Handler<Tx<sqlx::Sqlite>, Ping> for PanicsOnBoom {
    type Output = ();
    async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Ping>) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO pings (n) VALUES (?)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        if msg.message_id().as_bytes() == b"boom" {
            panic!("boom");
        }
        Ok(())
    }
}

async fn store(dir: &tempfile::TempDir) -> SqliteStore {
    let store = SqliteStore::open(dir.path().join("r.db"), SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    store
}

fn quick() -> RetryPolicy {
    RetryPolicy::exponential(3, Duration::from_millis(5), Duration::from_millis(20))
}

#[tokio::test]
async fn a_panicking_handler_rolls_back_and_is_dead_lettered_after_its_retries() {
    for batch in [1, 4] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = store(&dir).await;
        let processor = Arc::new(
            Processor::builder(store.clone(), "panics")
                .build()
                .expect("p"),
        );
        let broker = InMemoryBroker::new();
        broker.publish(&[("message-id", b"ok-1")], br#"{"n":1}"#.to_vec());
        broker.publish(&[("message-id", b"boom")], br#"{"n":2}"#.to_vec());
        broker.publish(&[("message-id", b"ok-2")], br#"{"n":3}"#.to_vec());
        broker.close();
        let consumer = Consumer::new(processor, broker.source()).retry(quick());
        let stats = if batch > 1 {
            consumer
                .batch(batch)
                .run(Json::<Ping>::new(), PanicsOnBoom, CancellationToken::new())
                .await
        } else {
            consumer
                .run(Json::<Ping>::new(), PanicsOnBoom, CancellationToken::new())
                .await
        }
        .expect("run");
        assert_eq!(
            (stats.processed, stats.dead_lettered),
            (2, 1),
            "batch {batch}: {stats:?}"
        );
        let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM pings ORDER BY n")
            .fetch_all(store.pool())
            .await
            .expect("rows");
        assert_eq!(
            rows,
            vec![1, 3],
            "batch {batch}: the panicking message's write rolled back"
        );
        let dead: Vec<_> = broker
            .settled()
            .into_iter()
            .filter_map(|(_, payload, how)| match how {
                Settled::DeadLettered(h) => Some((payload, h)),
                Settled::Acked => None,
            })
            .collect();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].0, br#"{"n":2}"#.to_vec());
        assert!(
            dead[0]
                .1
                .contains(&(REASON_HEADER, "retries-exhausted".to_owned()))
        );
        assert!(
            dead[0]
                .1
                .iter()
                .any(|(_, v)| v.contains("handler panicked: boom")),
            "{:?}",
            dead[0].1
        );
    }
}

#[tokio::test]
async fn a_store_outage_is_retried_in_place_with_backoff_never_dead_lettered() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = store(&dir).await;
    let processor = Arc::new(
        Processor::builder(store.clone(), "outage")
            .build()
            .expect("p"),
    );
    store.pool().close().await; // every begin now fails: the database is out of reach
    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
    let stop = CancellationToken::new();
    let consumer = Consumer::new(processor, broker.source()).retry(RetryPolicy::exponential(
        3,
        Duration::from_millis(20),
        Duration::from_millis(100),
    ));
    let observer = consumer.observer();
    let run = tokio::spawn(consumer.run(Json::<Ping>::new(), PanicsOnBoom, stop.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = observer.snapshot();
    stop.cancel();
    let stats = run.await.expect("task").expect("run");
    // Well past the 3 attempts a message gets, yet still retrying, and at the capped backoff
    // (≥ 50 ms apart once capped), not in a hot loop.
    assert!(during.retries >= 5, "{during:?}");
    assert!(
        during.retries <= 40,
        "backoff applies during an outage: {during:?}"
    );
    assert_eq!(during.abandoned, 0, "{during:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(stats.abandoned, 1, "given back at shutdown: {stats:?}");
    assert!(broker.settled().is_empty());
    assert_eq!(
        broker.pending(),
        1,
        "the message waits for the database to come back"
    );
}

struct FailsFirstTime(std::sync::Mutex<bool>);

impl Handler<Tx<sqlx::Sqlite>, Ping> for FailsFirstTime {
    type Output = ();
    async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Ping>) -> Result<(), BoxError> {
        if msg.message_id().as_bytes() == b"flaky" {
            let mut first = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if *first {
                *first = false;
                return Err(idem_core::Error::retry("first attempt fails").into());
            }
        }
        sqlx::query("INSERT INTO pings (n) VALUES (?)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn a_batch_acks_what_committed_before_retrying_a_failed_neighbour() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = store(&dir).await;
    let processor = Arc::new(
        Processor::builder(store.clone(), "batch")
            .build()
            .expect("p"),
    );
    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"flaky")], br#"{"n":1}"#.to_vec());
    broker.publish(&[("message-id", b"steady")], br#"{"n":2}"#.to_vec());
    broker.close();
    let stats = Consumer::new(processor, broker.source())
        .batch(8)
        .retry(RetryPolicy::exponential(
            3,
            Duration::from_millis(300),
            Duration::from_millis(300),
        ))
        .run(
            Json::<Ping>::new(),
            FailsFirstTime(std::sync::Mutex::new(true)),
            CancellationToken::new(),
        )
        .await
        .expect("run");
    assert_eq!((stats.processed, stats.retries), (2, 1), "{stats:?}");
    let order: Vec<Vec<u8>> = broker.settled().into_iter().map(|(_, p, _)| p).collect();
    assert_eq!(
        order,
        vec![br#"{"n":2}"#.to_vec(), br#"{"n":1}"#.to_vec()],
        "the committed neighbour is acked before the failed message's retry"
    );
}

// ---- lost connections: the message's, or an outage ----------------------------------------------

/// A claim store in memory whose `BEGIN` can be refused and whose probe can be made to fail:
/// enough to drive the runner's outage decisions on paused time.
#[derive(Debug, Clone, Default)]
struct Switchboard {
    /// `BEGIN` fails as an outage: the message never runs.
    refuse_begin: Arc<AtomicBool>,
    /// The probe answers.
    answers: Arc<AtomicBool>,
    probes: Arc<AtomicU64>,
}

impl TransactionalStore for Switchboard {
    type Tx = ();

    async fn begin(&self) -> Result<(), idem_core::Error> {
        if self.refuse_begin.load(Ordering::SeqCst) {
            return Err(idem_core::Error::new(
                ErrorKind::Unavailable,
                "connection refused",
            ));
        }
        Ok(())
    }

    async fn commit(&self, _tx: ()) -> Result<(), idem_core::Error> {
        Ok(())
    }

    async fn rollback(&self, _tx: ()) -> Result<(), idem_core::Error> {
        Ok(())
    }

    async fn probe(&self) -> Result<(), idem_core::Error> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        if self.answers.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(idem_core::Error::new(
                ErrorKind::Unavailable,
                "the database system is in recovery mode",
            ))
        }
    }
}

impl ClaimStore for Switchboard {
    fn max_message_id_len(&self) -> usize {
        255
    }

    async fn claim(
        &self,
        _tx: &mut (),
        _claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, idem_core::Error> {
        Ok(None)
    }
}

/// Loses its connection on every message with a negative `n`, as a statement that crashes the
/// database does; the others succeed.
struct CrashesOnNegative;

impl Handler<(), Ping> for CrashesOnNegative {
    type Output = ();
    async fn handle(&self, _tx: &mut (), msg: &Message<Ping>) -> Result<(), BoxError> {
        if msg.payload().n < 0 {
            return Err(idem_core::Error::new(
                ErrorKind::ConnectionLost,
                "server closed the connection unexpectedly",
            )
            .into());
        }
        Ok(())
    }
}

/// Three attempts, backoff up to 1 s, outages waited out for a minute.
fn limited() -> RetryPolicy {
    RetryPolicy::exponential(3, Duration::from_millis(10), Duration::from_secs(1))
        .with_outage_limit(Duration::from_secs(60))
}

fn reason_of(broker: &InMemoryBroker, payload: &[u8]) -> Option<Vec<(&'static str, String)>> {
    broker
        .settled()
        .into_iter()
        .find(|(_, p, _)| p.as_slice() == payload)
        .and_then(|(_, _, how)| match how {
            Settled::DeadLettered(h) => Some(h),
            Settled::Acked => None,
        })
}

/// Issue 18, point 4, the store up: the connection is lost under the message while a probe on
/// another connection answers, so the message itself ends its session. It spends its three
/// attempts at once (no outage is declared) and is dead-lettered as `connection-lost`.
#[tokio::test(start_paused = true)]
async fn a_lost_connection_while_the_store_answers_spends_the_message_s_attempts() {
    let store = Switchboard::default();
    store.answers.store(true, Ordering::SeqCst);
    let processor = Arc::new(Processor::builder(store.clone(), "up").build().expect("p"));
    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"crash")], br#"{"n":-1}"#.to_vec());
    broker.publish(&[("message-id", b"fine")], br#"{"n":1}"#.to_vec());
    broker.close();
    let start = tokio::time::Instant::now();
    let run = Consumer::new(processor, broker.source())
        .retry(limited())
        .run(
            Json::<Ping>::new(),
            CrashesOnNegative,
            CancellationToken::new(),
        );
    let stats = tokio::time::timeout(Duration::from_secs(3600), run)
        .await
        .expect("the consumer waited for ever")
        .expect("run");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1), "{stats:?}");
    assert_eq!(
        (stats.store_outages, stats.connections_lost),
        (0, 3),
        "{stats:?}"
    );
    assert_eq!(
        store.probes.load(Ordering::SeqCst),
        3,
        "one probe per lost connection"
    );
    let headers = reason_of(&broker, br#"{"n":-1}"#).expect("dead-lettered");
    assert!(
        headers.contains(&(REASON_HEADER, "connection-lost".to_owned())),
        "{headers:?}"
    );
    assert!(
        headers.contains(&(ATTEMPTS_HEADER, "3".to_owned())),
        "{headers:?}"
    );
}

/// Point 4, the store down each time: a message that crashes its database (which then
/// restarts) finds the probe failing after every lost connection, so each looks like an outage.
/// It waits in place for the outage limit, spending nothing; past it the runner says so
/// (`outage_limit_exceeded`) and the recurring lost connections spend its attempts, so it is
/// dead-lettered and the message behind it runs: the consumer does not wait for ever.
#[tokio::test(start_paused = true)]
async fn an_outage_that_strikes_whenever_a_message_runs_is_bounded_by_the_outage_limit() {
    let store = Switchboard::default();
    let processor = Arc::new(
        Processor::builder(store.clone(), "down")
            .build()
            .expect("p"),
    );
    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"crash")], br#"{"n":-1}"#.to_vec());
    broker.publish(&[("message-id", b"fine")], br#"{"n":1}"#.to_vec());
    broker.close();
    let start = tokio::time::Instant::now();
    let run = Consumer::new(processor, broker.source())
        .retry(limited())
        .run(
            Json::<Ping>::new(),
            CrashesOnNegative,
            CancellationToken::new(),
        );
    let stats = tokio::time::timeout(Duration::from_secs(3600), run)
        .await
        .expect("the consumer waited for ever")
        .expect("run");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(60) && waited < Duration::from_secs(70),
        "waited the outage limit, then three attempts: {waited:?}"
    );
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1), "{stats:?}");
    assert_eq!(stats.store_outages, 1, "{stats:?}");
    assert_eq!(stats.outage_limit_exceeded, 1, "{stats:?}");
    assert_eq!(stats.connections_lost, 3, "{stats:?}");
    let headers = reason_of(&broker, br#"{"n":-1}"#).expect("dead-lettered");
    assert!(
        headers.contains(&(REASON_HEADER, "connection-lost".to_owned())),
        "{headers:?}"
    );
    assert!(
        headers.contains(&(ATTEMPTS_HEADER, "3".to_owned())),
        "{headers:?}"
    );
}

/// Point 4's bound never dead-letters a message that did not run: refused at `BEGIN`, it
/// waits past the outage limit (reported once) for as long as the outage lasts, spending no
/// attempt, and is given back at shutdown.
#[tokio::test(start_paused = true)]
async fn a_message_that_never_ran_waits_out_an_outage_past_its_limit() {
    let store = Switchboard::default();
    store.refuse_begin.store(true, Ordering::SeqCst);
    let processor = Arc::new(
        Processor::builder(store.clone(), "never")
            .build()
            .expect("p"),
    );
    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
    let stop = CancellationToken::new();
    let consumer = Consumer::new(processor, broker.source()).retry(limited());
    let observer = consumer.observer();
    let run = tokio::spawn(consumer.run(Json::<Ping>::new(), CrashesOnNegative, stop.clone()));
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    let during = observer.snapshot();
    stop.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!(during.store_outages, 1, "{during:?}");
    assert_eq!(during.outage_limit_exceeded, 1, "reported once: {during:?}");
    assert!(during.retries > 100, "still retrying in place: {during:?}");
    assert_eq!((stats.dead_lettered, stats.abandoned), (0, 1), "{stats:?}");
    assert_eq!(
        store.probes.load(Ordering::SeqCst),
        0,
        "a refusal is not probed"
    );
    assert_eq!(broker.pending(), 1);
}

/// The hook runs once per processed message, after its commit (the row is visible from another
/// connection by then) and never for a duplicate: what wakes an in-process outbox relay.
#[tokio::test]
async fn after_commit_runs_once_per_processed_message_after_the_commit() {
    for batch in [1, 4] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = store(&dir).await;
        let processor = Arc::new(
            Processor::builder(store.clone(), "hook")
                .build()
                .expect("p"),
        );
        let broker = InMemoryBroker::new();
        broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
        broker.publish(&[("message-id", b"m-2")], br#"{"n":2}"#.to_vec());
        broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
        broker.close();
        let calls = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let hook = {
            let (calls, seen, pool) = (calls.clone(), seen.clone(), store.pool().clone());
            move || {
                calls.fetch_add(1, Ordering::SeqCst);
                // Committed already: another connection counts the rows from inside the hook.
                let pool = pool.clone();
                let seen = seen.clone();
                tokio::spawn(async move {
                    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pings")
                        .fetch_one(&pool)
                        .await
                        .expect("count");
                    seen.lock().unwrap_or_else(|p| p.into_inner()).push(n);
                });
            }
        };
        let consumer = Consumer::new(processor, broker.source()).after_commit(hook);
        let stats = if batch > 1 {
            consumer
                .batch(batch)
                .run(Json::<Ping>::new(), PanicsOnBoom, CancellationToken::new())
                .await
        } else {
            consumer
                .run(Json::<Ping>::new(), PanicsOnBoom, CancellationToken::new())
                .await
        }
        .expect("run");
        assert_eq!(stats.processed, 2, "batch {batch}: {stats:?}");
        assert_eq!(stats.duplicates, 1, "batch {batch}: {stats:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "batch {batch}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(seen.len(), 2, "batch {batch}");
        assert!(seen.iter().all(|&n| n >= 1), "batch {batch}: {seen:?}");
    }
}
