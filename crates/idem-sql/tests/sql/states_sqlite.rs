//! How SQLite's refusals are classified, on real database files: opened read-only or full
//! (`max_page_count` reached) is `Unavailable`; a missing claims table is `Misconfigured`; a
//! table missing under the handler is that message's `Store` failure.

use idem_core::{BoxError, ErrorKind, Migrate, Processor};
use idem_sql::{SqliteOptions, SqliteStore, TableName};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::states::{self, assert_state, failure};

async fn migrated(path: &std::path::Path) -> SqliteStore {
    let store = SqliteStore::open(path, SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (body BLOB NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    store
}

async fn pool(options: SqliteConnectOptions) -> SqliteStore {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("open");
    SqliteStore::from_pool(pool)
}

async fn claims(path: &std::path::Path) -> i64 {
    let store = pool(SqliteConnectOptions::new().filename(path)).await;
    sqlx::query_scalar("SELECT count(*) FROM idem_processed")
        .fetch_one(store.pool())
        .await
        .expect("count")
}

#[tokio::test]
async fn a_read_only_database_is_an_outage() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("ro.db");
    migrated(&path).await.pool().close().await;
    let store = pool(SqliteConnectOptions::new().filename(&path).read_only(true)).await;
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-ro", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("read-only", &err, ErrorKind::Unavailable);
    assert_eq!(claims(&path).await, 0);
}

#[tokio::test]
async fn a_full_database_is_an_outage() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("full.db");
    let store = migrated(&path).await;
    let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
        .fetch_one(store.pool())
        .await
        .expect("page count");
    store.pool().close().await;
    // No room to grow: the next write that needs a page fails with SQLITE_FULL, as on a
    // full disk.
    let full = pool(
        SqliteConnectOptions::new()
            .filename(&path)
            .pragma("max_page_count", (pages + 1).to_string()),
    )
    .await;
    let p = Processor::builder(full, "states").build().expect("p");
    let err = failure(&p, "m-full", async |tx| {
        sqlx::query("INSERT INTO effects (body) VALUES (zeroblob(1000000))")
            .execute(&mut **tx)
            .await?;
        Ok::<_, BoxError>(())
    })
    .await;
    assert_state("database full", &err, ErrorKind::Unavailable);
    assert_eq!(claims(&path).await, 0);
}

#[tokio::test]
async fn a_store_whose_migration_never_ran_is_misconfigured() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("bare.db");
    let store = SqliteStore::open(&path, SqliteOptions::default())
        .await
        .expect("open")
        .with_table(TableName::new("never_migrated").expect("name"))
        .expect("plain name");
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-1", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("missing table", &err, ErrorKind::Misconfigured);
    assert!(err.to_string().contains("never_migrated"), "{err}");
}

/// The same missing table under the handler's own statement is that message's failure
/// (`Store`: retried, then dead-lettered), not a misconfiguration that stops the consumer; the
/// next message is processed.
#[tokio::test]
async fn a_table_missing_under_the_handler_is_the_message_s_failure() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("handler.db");
    let p = Processor::builder(migrated(&path).await, "states")
        .build()
        .expect("p");
    let err = failure(&p, "m-missing", async |tx| {
        sqlx::query("INSERT INTO no_such_table (body) VALUES (x'00')")
            .execute(&mut **tx)
            .await?;
        Ok::<_, BoxError>(())
    })
    .await;
    assert_state("missing table under the handler", &err, ErrorKind::Store);
    assert!(err.to_string().contains("no such table"), "{err}");
    let next = p
        .process(&states::msg("m-next"), async |tx| {
            sqlx::query("INSERT INTO effects (body) VALUES (x'00')")
                .execute(&mut **tx)
                .await?;
            Ok::<_, BoxError>(())
        })
        .await
        .expect("the next message");
    assert!(
        matches!(next, idem_core::Outcome::Processed(())),
        "{next:?}"
    );
    assert_eq!(claims(&path).await, 1, "only the next message's claim");
}
