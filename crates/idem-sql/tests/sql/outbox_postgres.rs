//! The outbox conformance suite against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`. Each test gets its own schema (first on the pool's
//! `search_path`), so tests run in parallel.

use idem_core::Migrate;
use idem_sql::{PostgresStore, TableName};
use idem_testkit::OutboxFixture;
use idem_testkit::isolated::PgSchema;

#[derive(Debug)]
struct PgFixture {
    store: PostgresStore,
    schema: PgSchema,
}

impl OutboxFixture for PgFixture {
    type Store = PostgresStore;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_outbox", test).await?;
        let store = PostgresStore::from_pool(schema.pool(20).await);
        store.migrate().await.expect("migrate");
        Some(Self { store, schema })
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    fn unmigrated(&self) -> PostgresStore {
        self.store
            .clone()
            .with_outbox_table(TableName::new("never_migrated").expect("name"))
            .expect("name")
    }

    async fn dead_letter_reason(&self, seq: i64) -> Option<String> {
        sqlx::query_scalar("SELECT reason FROM idem_outbox_dead_letters WHERE seq = $1")
            .bind(seq)
            .fetch_optional(self.store.pool())
            .await
            .expect("read dead letter")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.schema.drop().await;
    }
}

idem_testkit::outbox_conformance_tests!(PgFixture);
