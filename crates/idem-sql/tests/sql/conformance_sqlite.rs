//! The store conformance suite on a real SQLite database file (always runs: SQLite is embedded),
//! with transactions on sqlx's pool and on the store's held connections (`hold_connections`).

use std::path::PathBuf;

use idem_core::{BoxError, Migrate};
use idem_sql::{SqliteOptions, SqliteStore, TableName};
use idem_testkit::{StoreFixture, TxOf, unique_name};

/// `HELD`: transactions on the store's held connections instead of the pool.
#[derive(Debug)]
struct SqliteFixture<const HELD: bool> {
    store: SqliteStore,
    dir: PathBuf,
}

impl<const HELD: bool> StoreFixture for SqliteFixture<HELD> {
    type Store = SqliteStore;

    async fn setup(test: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(unique_name("idem_sqlite", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("claims.db"), SqliteOptions::default())
            .await
            .expect("open sqlite")
            .with_table(TableName::new("claims").expect("valid"))
            .expect("plain table");
        let store = if HELD {
            store.hold_connections(8)
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, dir })
    }

    fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    async fn record_effect(tx: &mut TxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (key) VALUES (?)")
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
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = ?")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn count_claims(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM claims")
            .fetch_one(self.store.pool())
            .await
            .expect("count claims")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

mod pooled {
    use super::SqliteFixture;

    idem_testkit::conformance_tests!(SqliteFixture<false>);
}

mod held {
    use super::SqliteFixture;

    idem_testkit::conformance_tests!(SqliteFixture<true>);
}
