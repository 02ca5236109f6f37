//! The outbox conformance suite against the real MySQL/MariaDB server in
//! `IDEM_TEST_MYSQL_URL`. Each test gets its own database, so tests run in parallel.

use idem_core::Migrate;
use idem_sql::{MySqlStore, TableName};
use idem_testkit::OutboxFixture;
use idem_testkit::isolated::MySqlDatabase;

#[derive(Debug)]
struct MySqlFixture {
    store: MySqlStore,
    database: MySqlDatabase,
}

impl OutboxFixture for MySqlFixture {
    type Store = MySqlStore;

    async fn setup(test: &str) -> Option<Self> {
        let database = MySqlDatabase::create("idem_outbox", test).await?;
        let store = MySqlStore::from_pool(database.pool(20).await);
        store.migrate().await.expect("migrate");
        Some(Self { store, database })
    }

    fn store(&self) -> MySqlStore {
        self.store.clone()
    }

    fn unmigrated(&self) -> MySqlStore {
        self.store
            .clone()
            .with_outbox_table(TableName::new("never_migrated").expect("name"))
            .expect("name")
    }

    async fn dead_letter_reason(&self, seq: i64) -> Option<String> {
        sqlx::query_scalar(
            "SELECT CONVERT(reason USING utf8mb4) FROM idem_outbox_dead_letters WHERE seq = ?",
        )
        .bind(seq)
        .fetch_optional(self.store.pool())
        .await
        .expect("read dead letter")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.database.drop().await;
    }
}

idem_testkit::outbox_conformance_tests!(MySqlFixture);
