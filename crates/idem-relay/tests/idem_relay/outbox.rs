//! A real outbox for the tests: a SQLite file's outbox table, written as a handler writes it.

use std::time::Duration;

use idem_core::outbox::{OutboxStore, Outgoing, RelayStore};
use idem_core::{MessageId, Migrate, TransactionalStore};
use idem_relay::{CancellationToken, Publish, Relay, RelayStats};
use idem_sql::{SqliteOptions, SqliteStore};

/// Runs `relay` until `store` shows nothing unsent (within 30 s), then stops it.
pub(crate) async fn drain<S, P>(relay: Relay<S, P>, store: &S) -> RelayStats
where
    S: RelayStore + 'static,
    P: Publish,
{
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while store.backlog().await.expect("backlog").unsent > 0 {
        assert!(tokio::time::Instant::now() < deadline, "rows left unsent");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await.expect("relay task").expect("relay run")
}

/// A real outbox: a SQLite file in its own directory, migrated.
pub(crate) struct Outbox {
    pub(crate) store: SqliteStore,
    pub(crate) dir: std::path::PathBuf,
}

impl Outbox {
    pub(crate) async fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(idem_testkit::unique_name("idem_relay", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = SqliteStore::open(dir.join("outbox.db"), SqliteOptions::default())
            .await
            .expect("open sqlite");
        store.migrate().await.expect("migrate");
        Self { store, dir }
    }

    /// Commits `messages` to the outbox in one transaction, as a handler would.
    pub(crate) async fn enqueue(&self, messages: &[Outgoing]) {
        let mut tx = self.store.begin().await.expect("begin");
        self.store
            .enqueue(&mut tx, messages)
            .await
            .expect("enqueue");
        self.store.commit(tx).await.expect("commit");
    }

    pub(crate) async fn backlog(&self) -> idem_core::outbox::Backlog {
        self.store.backlog().await.expect("backlog")
    }

    /// The reason `id`'s row was dead-lettered with, if it was.
    pub(crate) async fn dead_letter_reason(&self, id: &MessageId) -> Option<String> {
        sqlx::query_scalar("SELECT reason FROM idem_outbox_dead_letters WHERE message_id = ?")
            .bind(id.as_bytes())
            .fetch_optional(self.store.pool())
            .await
            .expect("read the dead letters")
    }

    pub(crate) async fn remove(self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
