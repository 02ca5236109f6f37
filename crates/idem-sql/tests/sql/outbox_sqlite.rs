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

    type RowLock = ();

    /// SQLite has no row locks: one transaction writes at a time.
    async fn lock_row(&self, _id: &idem_core::MessageId) -> Option<()> {
        None
    }

    async fn unlock_row(&self, (): ()) {}

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

/// `idem relay --database URL` relays through [`idem_sql::AnyStore`]: it reads what a typed
/// store's handlers enqueued, in the table it is told.
#[tokio::test]
async fn any_store_relays_what_a_typed_store_enqueued() {
    use std::time::Duration;

    use idem_core::outbox::{Emitter, OutboxStore, RelayStore};
    use idem_core::{ConsumerName, MessageId, TransactionalStore};

    let dir = std::env::temp_dir().join(unique_name("idem_sqlite_outbox", "any_store"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("any.db");
    let table = TableName::new("orders_outbox").expect("name");
    let typed = SqliteStore::open(&path, SqliteOptions::default())
        .await
        .expect("open")
        .with_outbox_table(table.clone())
        .expect("outbox table");
    typed.migrate().await.expect("migrate");
    let mut emitter = Emitter::for_message(
        &ConsumerName::new("billing").expect("name"),
        &MessageId::new("payment-1").expect("id"),
    );
    let sent = [
        emitter.message("receipts", b"one".to_vec()).expect("msg"),
        emitter.message("receipts", b"two".to_vec()).expect("msg"),
    ];
    let mut tx = typed.begin().await.expect("begin");
    typed.enqueue(&mut tx, &sent).await.expect("enqueue");
    typed.commit(tx).await.expect("commit");

    let url = format!("sqlite:{}", path.display());
    let any = idem_sql::AnyStore::connect(&url, TableName::default())
        .await
        .expect("connect")
        .with_outbox_table(table)
        .expect("outbox table");
    let rows = any
        .lease("relay-1", 10, Duration::from_secs(30))
        .await
        .expect("lease");
    let got: Vec<_> = rows.iter().map(|r| r.message.clone()).collect();
    assert_eq!(got, sent);
    any.mark_sent("relay-1", &rows.iter().map(|r| r.seq).collect::<Vec<_>>())
        .await
        .expect("mark");
    let backlog = any.backlog().await.expect("backlog");
    assert_eq!((backlog.unsent, backlog.sent), (0, 2), "{backlog:?}");
    assert_eq!(any.purge_sent(10).await.expect("purge"), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
