//! The store conformance suite against the real PostgreSQL server in `IDEM_TEST_POSTGRES_URL`,
//! with transactions on sqlx's pool and on the store's held connections
//! (`PostgresStore::hold_connections`). Each test gets its own schema (first on the pool's
//! `search_path`), so tests run in parallel.

use idem_core::{BoxError, Migrate};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;
use idem_testkit::{StoreFixture, TxOf};

/// `HELD`: transactions on the store's held connections instead of the pool; `PARTS`: the
/// claims table partitioned by the ID's time (the suite's IDs carry none, so every claim goes
/// through the partitioned statements into the undated partition; `partitions_postgres.rs`
/// covers day partitions).
#[derive(Debug)]
struct PgFixture<const HELD: bool, const PARTS: bool = false> {
    store: PostgresStore,
    schema: PgSchema,
}

impl<const HELD: bool, const PARTS: bool> StoreFixture for PgFixture<HELD, PARTS> {
    type Store = PostgresStore;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem", test).await?;
        let pool = schema.pool(20).await;
        let store = PostgresStore::from_pool(pool);
        let store = if HELD {
            store.hold_connections(8)
        } else {
            store
        };
        let store = if PARTS {
            store
                .partitioned(idem_sql::partition::Partitioning::uuid_v7())
                .expect("partitioned")
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key text NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, schema })
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    async fn record_effect(tx: &mut TxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn fail_statement(tx: &mut TxOf<Self>) -> Result<(), BoxError> {
        sqlx::query("SELECT * FROM idem_no_such_table")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn count_claims(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_processed")
            .fetch_one(self.store.pool())
            .await
            .expect("count claims")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.schema.drop().await;
    }
}

mod pooled {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<false>);
}

mod held {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<true>);
}

mod partitioned {
    use super::PgFixture;

    idem_testkit::conformance_tests!(PgFixture<true, true>);
}

/// A held connection the server closed (a restart, a terminated backend) is replaced: while
/// idle, when the next `BEGIN` fails on it; in the middle of a transaction, by that one
/// failing and the next one getting a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_held_connection_is_replaced() {
    use idem_core::{Message, MessageId, Outcome, Processor};

    let Some(fx) = PgFixture::<true>::setup("a_lost_held_connection_is_replaced").await else {
        return;
    };
    let p = Processor::builder(fx.store.clone().hold_connections(1), "held")
        .build()
        .expect("processor");
    let pid_of = async |id: &str| -> Result<i32, idem_core::Error> {
        let msg = Message::new(MessageId::new(id).expect("id"), b"x".to_vec());
        let outcome = p
            .process(&msg, async |tx| {
                sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                    .fetch_one(&mut **tx)
                    .await
            })
            .await?;
        match outcome {
            Outcome::Processed(pid) => Ok(pid),
            other => panic!("{id} was not new: {other:?}"),
        }
    };
    let terminate = async |pid: i32| {
        let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(fx.store.pool())
            .await
            .expect("terminate");
        assert!(done, "backend {pid} terminated");
    };
    let first = pid_of("held-1").await.expect("first");
    assert_eq!(
        pid_of("held-2").await.expect("second"),
        first,
        "one connection, reused"
    );
    terminate(first).await;
    let second = pid_of("held-3")
        .await
        .expect("a stale idle connection is replaced at BEGIN");
    assert_ne!(second, first);

    // Lost mid-transaction: that message fails (nothing committed), the next one runs.
    let msg = Message::new(MessageId::new("held-4").expect("id"), b"x".to_vec());
    let lost = p
        .process(&msg, async |tx| {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await?;
            terminate(pid).await;
            sqlx::query("SELECT 1").execute(&mut **tx).await?;
            Ok::<_, sqlx::Error>(())
        })
        .await;
    assert!(lost.is_err(), "{lost:?}");
    let third = pid_of("held-4")
        .await
        .expect("the message is processed on a new connection");
    assert_ne!(third, second);
    assert_eq!(fx.count_claims().await, 4, "held-1 … held-4, each once");
    fx.teardown().await;
}
