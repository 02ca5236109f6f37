//! The outbox conformance suite on a real SQLite database file (always runs: SQLite is
//! embedded).

use std::path::PathBuf;

use idem_core::Migrate;
use idem_sql::{SqliteOptions, SqliteStore, TableName};
use idem_testkit::{OutboxFixture, unique_name};

#[derive(Debug)]
struct SqliteFixture {
    store: SqliteStore,
    dir: PathBuf,
}

impl OutboxFixture for SqliteFixture {
    type Store = SqliteStore;

    async fn setup(test: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(unique_name("idem_sqlite_outbox", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("outbox.db"), SqliteOptions::default())
            .await
            .expect("open sqlite");
        store.migrate().await.expect("migrate");
        Some(Self { store, dir })
    }

    fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    fn unmigrated(&self) -> SqliteStore {
        self.store
            .clone()
            .with_outbox_table(TableName::new("never_migrated").expect("name"))
            .expect("plain name")
    }

    async fn dead_letter_reason(&self, seq: i64) -> Option<String> {
        sqlx::query_scalar("SELECT reason FROM idem_outbox_dead_letters WHERE seq = ?")
            .bind(seq)
            .fetch_optional(self.store.pool())
            .await
            .expect("read dead letter")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

idem_testkit::outbox_conformance_tests!(SqliteFixture);
