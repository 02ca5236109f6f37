//! Runner behaviours the broker suite does not reach: handler panics, and a store outage that
//! must not empty the queue into the dead letters. In-memory fake broker, real SQLite store.

use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{
    CancellationToken, Consumer, Handler, InMemoryBroker, Json, REASON_HEADER, RetryPolicy, Settled,
};
use idem_core::{BoxError, Identified, Message, Migrate, Processor};
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
