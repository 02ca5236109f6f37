//! The store conformance suite against the real PostgreSQL server in `IDEM_TEST_POSTGRES_URL`.
//! Each test gets its own schema (first on the pool's `search_path`), so tests run in parallel.

use idem_core::{BoxError, Migrate};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;
use idem_testkit::{StoreFixture, TxOf};

#[derive(Debug)]
struct PgFixture {
    store: PostgresStore,
    schema: PgSchema,
}

impl StoreFixture for PgFixture {
    type Store = PostgresStore;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem", test).await?;
        let pool = schema.pool(20).await;
        let store = PostgresStore::from_pool(pool);
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

idem_testkit::conformance_tests!(PgFixture);
