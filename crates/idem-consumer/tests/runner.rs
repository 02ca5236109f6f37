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
        let stats = Consumer::new(processor, broker.source())
            .batch_size(batch)
            .retry(quick())
            .run(Json::<Ping>::new(), PanicsOnBoom, CancellationToken::new())
            .await
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
async fn a_store_outage_leaves_messages_to_redelivery_instead_of_dead_letters() {
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
    let consumer = Consumer::new(processor, broker.source()).retry(quick());
    let observer = consumer.observer();
    let run = tokio::spawn(consumer.run(Json::<Ping>::new(), PanicsOnBoom, stop.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while observer.snapshot().abandoned < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    let stats = run.await.expect("task").expect("run");
    assert!(stats.abandoned >= 2, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert!(broker.settled().is_empty());
    assert_eq!(
        broker.pending(),
        1,
        "the message waits for the database to come back"
    );
}
