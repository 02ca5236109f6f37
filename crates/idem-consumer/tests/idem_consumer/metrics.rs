//! The Prometheus exposition after a real run over the in-memory fake broker and a real SQLite
//! store. The recorder is process-wide and shared with the other tests of this binary
//! ([`recorder`](crate::recorder)): every line read here is this test's consumer's.

use std::sync::Arc;

use idem_consumer::{CancellationToken, Consumer, Handler, InMemoryBroker, Json};
use idem_core::{BoxError, Message, Migrate, Processor};
use idem_sql::{SqliteOptions, SqliteStore, Tx};

#[derive(Debug, serde::Deserialize)]
struct Ping {
    n: i64,
}

struct Record;

impl Handler<Tx<sqlx::Sqlite>, Ping> for Record {
    type Output = ();
    async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Ping>) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO pings (n) VALUES (?)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn prometheus_exposition_counts_outcomes_and_times_handlers() {
    let handle = crate::recorder::recorder();
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("m.db"), SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    let processor = Arc::new(
        Processor::builder(store, "metrics-test")
            .build()
            .expect("processor"),
    );

    let broker = InMemoryBroker::new();
    broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
    broker.publish(&[("message-id", b"m-1")], br#"{"n":1}"#.to_vec());
    broker.publish(&[("message-id", b"m-2")], br#"{"n":2}"#.to_vec());
    broker.publish(&[], br#"{"n":3}"#.to_vec());
    broker.close();

    let stats = Consumer::new(processor, broker.source())
        .run(Json::<Ping>::new(), Record, CancellationToken::new())
        .await
        .expect("run");
    assert_eq!(
        (stats.processed, stats.duplicates, stats.dead_lettered),
        (2, 1, 1)
    );

    let text = handle.render();
    // Other tests of this binary report to the same recorder under their own consumer names.
    let ours = r#"consumer="metrics-test""#;
    let line = |needle: &str| {
        text.lines()
            .filter(|l| l.contains(ours))
            .find(|l| l.starts_with(needle) || (l.contains(needle) && !l.starts_with('#')))
            .unwrap_or_else(|| panic!("no {needle} in\n{text}"))
            .to_owned()
    };
    assert!(line(r#"outcome="processed""#).ends_with(" 2"), "{text}");
    assert!(line(r#"outcome="duplicate""#).ends_with(" 1"), "{text}");
    assert!(line(r#"reason="missing-id""#).ends_with(" 1"), "{text}");
    assert!(line("idem_handler_seconds_count").ends_with(" 2"), "{text}");
    assert!(line("idem_commit_seconds_count").ends_with(" 2"), "{text}");
    assert!(text.contains(r#"consumer="metrics-test""#) && text.contains(r#"broker="in-memory""#));
}
