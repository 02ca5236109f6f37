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

    type RowLock = sqlx::Transaction<'static, sqlx::MySql>;

    async fn lock_row(&self, id: &idem_core::MessageId) -> Option<Self::RowLock> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        sqlx::query("SELECT 1 FROM idem_outbox WHERE message_id = ? FOR UPDATE")
            .bind(id.as_bytes())
            .execute(&mut *tx)
            .await
            .expect("lock the row");
        Some(tx)
    }

    async fn unlock_row(&self, lock: Self::RowLock) {
        lock.rollback().await.expect("rollback");
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

/// A database refusing writes (a read-only transaction, what `--read-only` or a replica
/// gives a writer: 1792) refuses the outbox as an outage — enqueue, lease, mark — never as a
/// message's fault; the backlog still reads.
#[tokio::test]
async fn a_read_only_database_is_an_outage_for_the_outbox() {
    use std::time::Duration;

    use idem_core::outbox::{Emitter, OutboxStore, RelayStore};
    use idem_core::{ConsumerName, ErrorKind, MessageId, TransactionalStore};
    use sqlx::Executor;

    let Some(fx) = MySqlFixture::setup("a_read_only_database_is_an_outage_for_the_outbox").await
    else {
        return;
    };
    let mut e = Emitter::for_message(
        &ConsumerName::new("c").expect("consumer"),
        &MessageId::new("m").expect("id"),
    );
    let first = e.message("orders", b"x".to_vec()).expect("message");
    let mut tx = fx.store.begin().await.expect("tx");
    fx.store.enqueue(&mut tx, &[first]).await.expect("enqueue");
    fx.store.commit(tx).await.expect("commit");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION READ ONLY").await?;
                Ok(())
            })
        })
        .connect_with(fx.database.options())
        .await
        .expect("connect");
    let ro = MySqlStore::from_pool(pool);
    let mut tx = ro.begin().await.expect("tx");
    let refused = ro
        .enqueue(
            &mut tx,
            &[e.message("orders", b"y".to_vec()).expect("message")],
        )
        .await
        .expect_err("enqueued on a read-only database");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    drop(tx);
    let refused = ro
        .lease("relay", 10, Duration::from_secs(30))
        .await
        .expect_err("leased on a read-only database");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    let refused = ro.mark_sent("relay", &[1]).await.expect_err("marked");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    assert_eq!(ro.backlog().await.expect("backlog reads").unsent, 1);
    ro.pool().close().await;
    fx.teardown().await;
}
