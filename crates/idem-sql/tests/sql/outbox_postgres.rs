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

    type RowLock = sqlx::Transaction<'static, sqlx::Postgres>;

    async fn lock_row(&self, id: &idem_core::MessageId) -> Option<Self::RowLock> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        sqlx::query("SELECT 1 FROM idem_outbox WHERE message_id = $1 FOR UPDATE")
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

/// A database refusing writes (a failover onto a standby: SQLSTATE 25006) refuses the outbox
/// as an outage — enqueue, lease, mark — never as a message's fault; the backlog still reads.
#[tokio::test]
async fn a_read_only_database_is_an_outage_for_the_outbox() {
    use std::time::Duration;

    use idem_core::outbox::{Emitter, OutboxStore, RelayStore};
    use idem_core::{ConsumerName, ErrorKind, MessageId, TransactionalStore};

    let Some(fx) = PgFixture::setup("a_read_only_database_is_an_outage_for_the_outbox").await
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
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            fx.schema
                .options()
                .options([("default_transaction_read_only", "on")]),
        )
        .await
        .expect("connect");
    let ro = PostgresStore::from_pool(pool);
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

/// `outbox_wakeups` hears a commit that enqueued, from another connection, and nothing of a
/// transaction still open or rolled back (PostgreSQL delivers `NOTIFY` at commit only).
#[tokio::test]
async fn commits_that_enqueue_wake_listeners_and_rollbacks_do_not() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use futures_util::StreamExt;
    use idem_core::outbox::{Emitter, OutboxStore};
    use idem_core::{ConsumerName, MessageId, TransactionalStore};

    let test = "commits_that_enqueue_wake_listeners_and_rollbacks_do_not";
    let Some(fx) = PgFixture::setup(test).await else {
        return;
    };
    // Channels are database-wide: a table name of its own keeps other tests' commits out.
    let table = idem_testkit::unique_name("outbox", "wake");
    let store = fx
        .store
        .clone()
        .with_outbox_table(TableName::new(&table).expect("name"))
        .expect("name");
    store.migrate().await.expect("migrate");
    let heard = Arc::new(AtomicU64::new(0));
    let listener = {
        let (wakeups, heard) = (store.outbox_wakeups(), heard.clone());
        tokio::spawn(async move {
            let mut wakeups = std::pin::pin!(wakeups);
            while wakeups.next().await.is_some() {
                heard.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await; // listening by now
    let before = heard.load(Ordering::SeqCst);
    let mut emitter = Emitter::for_message(
        &ConsumerName::new("c").expect("consumer"),
        &MessageId::new("m").expect("id"),
    );

    let mut tx = store.begin().await.expect("begin");
    let rolled_back = emitter.message("orders", b"1".to_vec()).expect("message");
    store
        .enqueue(&mut tx, &[rolled_back])
        .await
        .expect("enqueue");
    store.rollback(tx).await.expect("rollback");
    let mut tx = store.begin().await.expect("begin");
    let kept = emitter.message("orders", b"2".to_vec()).expect("message");
    store.enqueue(&mut tx, &[kept]).await.expect("enqueue");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        heard.load(Ordering::SeqCst),
        before,
        "nothing heard of a rolled-back or still open transaction"
    );
    store.commit(tx).await.expect("commit");
    let deadline = Instant::now() + Duration::from_secs(5);
    while heard.load(Ordering::SeqCst) == before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        heard.load(Ordering::SeqCst) > before,
        "the commit was heard"
    );
    listener.abort();
    fx.teardown().await;
}

/// `migrate` gives an outbox table without a fillfactor of its own (one an earlier idem made)
/// fillfactor 50, so that leases find room in their rows' pages, and leaves one an operator
/// chose alone.
#[tokio::test]
async fn migrate_sets_the_outbox_fillfactor_unless_the_table_has_one() {
    let Some(fx) = PgFixture::setup("migrate_sets_the_outbox_fillfactor").await else {
        return;
    };
    let pool = fx.store.pool();
    let options = async || -> Option<Vec<String>> {
        sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = 'idem_outbox'::regclass")
            .fetch_one(pool)
            .await
            .expect("read the table's options")
    };
    let set = |sql: &'static str| async move {
        sqlx::raw_sql(sql).execute(pool).await.expect(sql);
    };
    let fifty = Some(vec!["fillfactor=50".to_owned()]);
    assert_eq!(options().await, fifty, "created without the fillfactor");
    set("ALTER TABLE idem_outbox RESET (fillfactor)").await;
    assert_eq!(options().await, None);
    fx.store.migrate().await.expect("migrate");
    assert_eq!(options().await, fifty, "migrate left the table without one");
    set("ALTER TABLE idem_outbox SET (fillfactor = 70)").await;
    fx.store.migrate().await.expect("migrate");
    assert_eq!(
        options().await,
        Some(vec!["fillfactor=70".to_owned()]),
        "migrate overrode the operator's fillfactor"
    );
    fx.teardown().await;
}
