//! The store conformance suite against the real PostgreSQL server in `IDEM_TEST_POSTGRES_URL`,
//! on a deadpool-postgres pool and on plain clients. Each test gets its own schema (first on
//! the connections' `search_path`), so tests run in parallel.

mod common;

use std::time::Duration;

use common::Conns;
use idem_core::{BoxError, Message, MessageId, Migrate, Outcome, Processor, TransactionalStore};
use idem_postgres::PgStore;
use idem_postgres::tokio_postgres::Client;
use idem_testkit::isolated::PgSchema;
use idem_testkit::{StoreFixture, TxOf};

/// `CLIENTS`: the store on 8 plain clients instead of a pool of 20; `PARTS`: the claims table
/// partitioned by the ID's time (the suite's IDs carry none, so every claim goes through the
/// partitioned statements into the undated partition; `tests/partitions.rs` covers day
/// partitions).
struct PgFixture<const CLIENTS: bool, const PARTS: bool = false> {
    store: PgStore,
    admin: Client,
    schema: PgSchema,
}

impl<const CLIENTS: bool, const PARTS: bool> std::fmt::Debug for PgFixture<CLIENTS, PARTS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgFixture")
            .field("store", &self.store)
            .field("schema", &self.schema)
            .finish()
    }
}

impl<const CLIENTS: bool, const PARTS: bool> StoreFixture for PgFixture<CLIENTS, PARTS> {
    type Store = PgStore;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_pg", test).await?;
        let config = common::config(&schema);
        let conns = if CLIENTS {
            Conns::Clients(8)
        } else {
            Conns::Pool(20)
        };
        let store = common::store(&config, conns).await;
        let store = if PARTS {
            store
                .partitioned(idem_postgres::partition::Partitioning::uuid_v7())
                .expect("partitioned")
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        let admin = common::client(&config).await;
        admin
            .batch_execute("CREATE TABLE effects (key text NOT NULL)")
            .await
            .expect("effects table");
        Some(Self {
            store,
            admin,
            schema,
        })
    }

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    async fn record_effect(tx: &mut TxOf<Self>, key: &str) -> Result<(), BoxError> {
        let insert = tx
            .prepare_cached("INSERT INTO effects (key) VALUES ($1)")
            .await?;
        tx.execute(&insert, &[&key]).await?;
        Ok(())
    }

    async fn fail_statement(tx: &mut TxOf<Self>) -> Result<(), BoxError> {
        tx.execute("SELECT * FROM idem_no_such_table", &[]).await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        common::count(
            &self.admin,
            "SELECT count(*) FROM effects WHERE key = $1",
            &[&key],
        )
        .await
    }

    async fn count_claims(&self) -> i64 {
        common::count(&self.admin, "SELECT count(*) FROM idem_processed", &[]).await
    }

    async fn teardown(self) {
        drop(self.store);
        drop(self.admin);
        self.schema.drop().await;
    }
}

mod pooled {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<false>);
}

mod clients {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<true>);
}

mod partitioned {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<false, true>);
}

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"x".to_vec())
}

/// The backend serving a transaction, and whether it is inside one.
async fn backend(tx: &idem_postgres::PgTx) -> (i32, bool) {
    let row = tx
        .query_one(
            "SELECT pg_backend_pid(), now() = statement_timestamp()",
            &[],
        )
        .await
        .expect("backend");
    // Inside a transaction `now()` is its start, earlier than this statement's.
    (row.get(0), !row.get::<_, bool>(1))
}

/// A transaction dropped while open (a cancelled handler) never lends its connection, still
/// inside the transaction, to the next one: on a pool the connection is closed, on plain
/// clients it rolls back first. Either way the next message commits on its own.
async fn a_dropped_transaction_never_leaks_into_the_next(conns: Conns) {
    let test = "a_dropped_transaction_never_leaks_into_the_next";
    let Some(schema) = PgSchema::create("idem_pg", test).await else {
        return;
    };
    let config = common::config(&schema);
    let store = common::store(&config, conns).await;
    store.migrate().await.expect("migrate");
    let p = Processor::builder(store.clone(), "drop")
        .build()
        .expect("p");

    // A handler cancelled half-way: its claim must not survive into a later commit.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(200),
        p.process(&msg("dropped"), async |tx| {
            let (_, inside) = backend(tx).await;
            assert!(inside, "the handler runs inside the transaction");
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<_, BoxError>(())
        }),
    )
    .await;
    assert!(cancelled.is_err(), "the handler was cancelled");

    let out = p
        .process(&msg("next"), async |tx| {
            Ok::<_, BoxError>(backend(tx).await)
        })
        .await
        .expect("next message");
    let Outcome::Processed((_pid, inside)) = out else {
        panic!("next was not new: {out:?}");
    };
    assert!(inside);
    let admin = common::client(&config).await;
    let claims = common::count(
        &admin,
        "SELECT count(*) FROM idem_processed WHERE message_id = $1",
        &[&b"dropped".as_slice()],
    )
    .await;
    assert_eq!(claims, 0, "the cancelled message's claim committed");
    // And the dropped message is processed as new on its redelivery.
    let again = p
        .process(&msg("dropped"), async |_tx| Ok::<_, BoxError>(()))
        .await
        .expect("redelivery");
    assert!(matches!(again, Outcome::Processed(())), "{again:?}");
    drop((p, store, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_never_leaks_into_the_next_pooled() {
    a_dropped_transaction_never_leaks_into_the_next(Conns::Pool(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_never_leaks_into_the_next_on_one_client() {
    a_dropped_transaction_never_leaks_into_the_next(Conns::Clients(1)).await;
}

/// A pooled connection the server closed (a restart, a terminated backend) is replaced: one
/// lost mid-transaction fails that message (nothing committed) and the next one gets a new
/// connection. A plain client the server closed is dropped, and the store works on with the
/// others.
async fn a_lost_connection_fails_one_message_only(conns: Conns) {
    let test = "a_lost_connection_fails_one_message_only";
    let Some(schema) = PgSchema::create("idem_pg", test).await else {
        return;
    };
    let config = common::config(&schema);
    let store = common::store(&config, conns).await;
    store.migrate().await.expect("migrate");
    let admin = common::client(&config).await;
    let p = Processor::builder(store.clone(), "lost")
        .build()
        .expect("p");
    let terminate = async |pid: i32| {
        let done: bool = admin
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .expect("terminate")
            .get(0);
        assert!(done, "backend {pid} terminated");
    };
    let lost = p
        .process(&msg("lost-1"), async |tx| {
            let (pid, _) = backend(tx).await;
            terminate(pid).await;
            tx.execute("SELECT 1", &[]).await?;
            Ok::<_, BoxError>(())
        })
        .await;
    let err = lost.expect_err("the connection was lost mid-transaction");
    assert!(err.is_outage(), "{err:?}");
    let out = p
        .process(&msg("lost-1"), async |_tx| Ok::<_, BoxError>(()))
        .await
        .expect("the message is processed on another connection");
    assert!(matches!(out, Outcome::Processed(())), "{out:?}");
    let claims = common::count(&admin, "SELECT count(*) FROM idem_processed", &[]).await;
    assert_eq!(claims, 1);
    drop((p, store));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_fails_one_message_only_pooled() {
    a_lost_connection_fails_one_message_only(Conns::Pool(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_fails_one_message_only_on_clients() {
    a_lost_connection_fails_one_message_only(Conns::Clients(2)).await;
}

/// Every client closed: the store says so as an outage instead of waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_clients_all_closed_is_unavailable() {
    let test = "a_store_whose_clients_all_closed_is_unavailable";
    let Some(schema) = PgSchema::create("idem_pg", test).await else {
        return;
    };
    let config = common::config(&schema);
    let client = common::client(&config).await;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let store = PgStore::from_client(client);
    let admin = common::client(&config).await;
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    // The connection task notices the closed socket shortly after.
    let mut err = None;
    for _ in 0..50 {
        match store.begin().await {
            Err(e) if e.to_string().contains("every client") => {
                err = Some(e);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let err = err.expect("the store reports that no client is left");
    assert_eq!(err.kind(), idem_core::ErrorKind::Unavailable, "{err}");
    drop((store, admin));
    schema.drop().await;
}

/// The low-level claim inside a `tokio_postgres::Transaction` the caller owns on a connection
/// the store never saw: new once, then the stored fingerprint; gone with a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_on_composes_with_a_tokio_postgres_transaction() {
    use idem_core::{ClaimRequest, ConsumerName, Fingerprint, Stamp};

    let test = "claim_on_composes_with_a_tokio_postgres_transaction";
    let Some(schema) = PgSchema::create("idem_pg", test).await else {
        return;
    };
    let config = common::config(&schema);
    let store = common::store(&config, Conns::Pool(2)).await;
    store.migrate().await.expect("migrate");
    let mut own = common::client(&config).await;
    let consumer = ConsumerName::new("own").expect("consumer");
    let fp = Fingerprint::of(b"x");
    let (kept, dropped) = (
        MessageId::new("own-1").expect("id"),
        MessageId::new("own-2").expect("id"),
    );
    let claim = |id| ClaimRequest {
        consumer: &consumer,
        id,
        fingerprint: &fp,
        at: Stamp::StoreClock,
    };
    for expected in [None, Some(fp)] {
        let tx = own.transaction().await.expect("begin");
        let found = store.claim_on(&tx, claim(&kept)).await.expect("claim");
        assert_eq!(found, expected);
        tx.commit().await.expect("commit");
    }
    let tx = own.transaction().await.expect("begin");
    let found = store.claim_on(&tx, claim(&dropped)).await.expect("claim");
    assert_eq!(found, None);
    tx.rollback().await.expect("rollback");
    let claims = common::count(&own, "SELECT count(*) FROM idem_processed", &[]).await;
    assert_eq!(claims, 1, "own-1 once; own-2 rolled back");
    drop((store, own));
    schema.drop().await;
}
