//! The store conformance suite against the real MySQL/MariaDB server in `IDEM_TEST_MYSQL_URL`,
//! with transactions on sqlx's pool and on the store's held connections (`hold_connections`).
//! Each test gets its own database, so tests run in parallel.

use idem_core::{BoxError, Migrate};
use idem_sql::MySqlStore;
use idem_testkit::isolated::MySqlDatabase;
use idem_testkit::{StoreFixture, TxOf};

/// `HELD`: transactions on the store's held connections instead of the pool.
#[derive(Debug)]
struct MySqlFixture<const HELD: bool> {
    store: MySqlStore,
    database: MySqlDatabase,
}

impl<const HELD: bool> StoreFixture for MySqlFixture<HELD> {
    type Store = MySqlStore;

    async fn setup(test: &str) -> Option<Self> {
        let database = MySqlDatabase::create("idem", test).await?;
        let pool = database.pool(20).await;
        let store = MySqlStore::from_pool(pool);
        let store = if HELD {
            store.hold_connections(8)
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (k VARCHAR(255) NOT NULL) ENGINE = InnoDB")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, database })
    }

    fn store(&self) -> MySqlStore {
        self.store.clone()
    }

    async fn record_effect(tx: &mut TxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (k) VALUES (?)")
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
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE k = ?")
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
        self.database.drop().await;
    }
}

mod pooled {
    use super::MySqlFixture;

    idem_testkit::conformance_tests!(MySqlFixture<false>);
}

mod held {
    use super::MySqlFixture;

    idem_testkit::conformance_tests!(MySqlFixture<true>);
}
