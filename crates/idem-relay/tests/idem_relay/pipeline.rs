//! Rounds in flight against a real outbox's lease (a SQLite file; PostgreSQL when
//! `IDEM_TEST_POSTGRES_URL` is set, in a schema of its own): a store hands a relay's own
//! leased rows back to it, so a second lease under the same owner would hand out rows a round
//! is still publishing, and later rows of their keys. Each round leases under an owner of its
//! own; this checks that no row is published twice and that one key's publishes never overlap
//! and keep their order, with several rounds in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::outbox::{Emitter, OutboxStore, Outgoing, RelayStore};
use idem_core::{ConsumerName, Error, MessageId, Migrate};
use idem_relay::{Publish, Relay};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;

use crate::outbox::{Outbox, drain};

#[derive(Default)]
struct Seen {
    /// Keys with a publish in flight.
    busy: HashMap<String, String>,
    /// IDs in the order their publishes were confirmed.
    log: Vec<String>,
    /// A key's publish that started while another of its key was in flight.
    overlaps: Vec<String>,
}

/// A broker that takes a few milliseconds per publish and notes what overlaps.
#[derive(Clone, Default)]
struct Watching(Arc<Mutex<Seen>>);

impl Publish for Watching {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        let id = String::from_utf8_lossy(msg.id().as_bytes()).into_owned();
        if let Some(key) = msg.key() {
            let mut seen = self.0.lock().expect("lock");
            if let Some(other) = seen.busy.insert(key.to_owned(), id.clone()) {
                seen.overlaps.push(format!("{id} while {other}"));
            }
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut seen = self.0.lock().expect("lock");
        if let Some(key) = msg.key() {
            seen.busy.remove(key);
        }
        seen.log.push(id);
        Ok(())
    }
}

/// Three keys of 12 rows each, interleaved with unkeyed rows.
fn messages() -> (Vec<Outgoing>, HashMap<String, Vec<String>>) {
    let consumer = ConsumerName::new("orders-service").expect("test setup");
    let mut emitter = Emitter::for_message(&consumer, &MessageId::new("batch-1").expect("id"));
    let mut out = Vec::new();
    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for i in 0..48 {
        let m = emitter
            .message("orders", format!("{i}").into_bytes())
            .expect("message");
        let m = if i % 4 == 3 {
            m
        } else {
            let key = format!("order-{}", i % 4);
            let m = m.ordering_key(&key).expect("key");
            by_key
                .entry(key)
                .or_default()
                .push(String::from_utf8_lossy(m.id().as_bytes()).into_owned());
            m
        };
        out.push(m);
    }
    (out, by_key)
}

#[tokio::test]
async fn rounds_in_flight_never_share_a_row_or_overlap_a_key() {
    let outbox = Outbox::new("pipeline_fifo").await;
    relay_pipelined(outbox.store.clone()).await;
    outbox.remove().await;
}

#[tokio::test]
async fn rounds_in_flight_never_share_a_row_or_overlap_a_key_on_postgres() {
    let Some(schema) = PgSchema::create("idem_relay", "pipeline_fifo_pg").await else {
        return;
    };
    let store = PostgresStore::from_pool(schema.pool(10).await);
    store.migrate().await.expect("migrate");
    relay_pipelined(store.clone()).await;
    store.pool().close().await;
    schema.drop().await;
}

/// Commits the messages, relays them with four rounds of five rows in flight, and checks
/// what the broker saw.
async fn relay_pipelined<S: OutboxStore + RelayStore + Clone + 'static>(store: S) {
    let (sent, by_key) = messages();
    let mut tx = store.begin().await.expect("begin");
    store.enqueue(&mut tx, &sent).await.expect("enqueue");
    store.commit(tx).await.expect("commit");
    let broker = Watching::default();
    let relay = Relay::builder("pipelined")
        .batch(5)
        .pipeline(4)
        .concurrency(8)
        .poll_interval(Duration::from_millis(20))
        .build(store.clone(), broker.clone())
        .expect("relay settings");
    let stats = drain(relay, &store).await;
    let seen = broker.0.lock().expect("lock");
    assert!(seen.overlaps.is_empty(), "{:?}", seen.overlaps);
    let mut unique = seen.log.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        seen.log.len(),
        "a row published twice: {:?}",
        seen.log
    );
    assert_eq!(seen.log.len(), sent.len());
    for (key, want) in by_key {
        let got: Vec<&String> = seen.log.iter().filter(|id| want.contains(id)).collect();
        assert_eq!(
            got,
            want.iter().collect::<Vec<_>>(),
            "key {key} out of order"
        );
    }
    assert_eq!(stats.published, sent.len() as u64);
}
