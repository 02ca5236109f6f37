//! `idem-postgres` and `idem-sql`'s `PostgresStore` share tables: against the real server in
//! `IDEM_TEST_POSTGRES_URL`, tables migrated by either serve the other, a claim written by one
//! is a duplicate (or a conflict) to the other, pruning and statistics see both stores' rows,
//! and a request record begun by one is completed by it and replayed by the other.

mod common;

use std::time::Duration;

use common::Conns;
use idem_core::store::RequestStore;
use idem_core::{
    Begin, BoxError, Fingerprint, IdempotencyKey, Message, MessageId, Migrate, Outcome, Processor,
    RequestKey, RequestScope, Stats, TransactionalStore,
};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;

fn msg(id: &str, payload: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), payload.as_bytes().to_vec())
}

/// Migrated by `first`, then used by both stores in turn.
async fn stores_share_claims(test: &str, sqlx_migrates: bool) {
    let Some(schema) = PgSchema::create("idem_interop", test).await else {
        return;
    };
    let sqlx_store = PostgresStore::from_pool(schema.pool(4).await);
    let pg_store = common::store(&common::config(&schema), Conns::Pool(4)).await;
    if sqlx_migrates {
        sqlx_store.migrate().await.expect("idem-sql migrates");
        pg_store
            .migrate()
            .await
            .expect("idem-postgres migrates again");
    } else {
        pg_store.migrate().await.expect("idem-postgres migrates");
        sqlx_store.migrate().await.expect("idem-sql migrates again");
    }
    let sqlx_p = Processor::builder(sqlx_store.clone(), "shared")
        .build()
        .expect("p");
    let pg_p = Processor::builder(pg_store.clone(), "shared")
        .build()
        .expect("p");

    let sqlx_first = sqlx_p
        .process(&msg("a", "x"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    assert!(
        matches!(sqlx_first, Ok(Outcome::Processed(()))),
        "{sqlx_first:?}"
    );
    let pg_dup = pg_p
        .process(&msg("a", "x"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    assert!(matches!(pg_dup, Ok(Outcome::Duplicate)), "{pg_dup:?}");
    let pg_conflict = pg_p
        .process(&msg("a", "y"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    assert!(
        matches!(pg_conflict, Ok(Outcome::Conflict { .. })),
        "{pg_conflict:?}"
    );

    let pg_first = pg_p
        .process(&msg("b", "x"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    assert!(
        matches!(pg_first, Ok(Outcome::Processed(()))),
        "{pg_first:?}"
    );
    let sqlx_dup = sqlx_p
        .process(&msg("b", "x"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    assert!(matches!(sqlx_dup, Ok(Outcome::Duplicate)), "{sqlx_dup:?}");
    // The batch claim reads the other store's rows too.
    let set = pg_p
        .process_batch_set(&[msg("a", "x"), msg("c", "x")], async |_tx, fresh| {
            Ok::<_, BoxError>(fresh.len())
        })
        .await
        .expect("set batch");
    assert_eq!(set.output, Some(1));

    let (sqlx_stats, pg_stats) = (
        sqlx_store.stats().await.expect("stats"),
        pg_store.stats().await.expect("stats"),
    );
    assert_eq!(sqlx_stats, pg_stats);
    assert_eq!(pg_stats[0].claims, 3, "{pg_stats:?}");
    // Both stamped on the server's clock: a prune of everything older than an hour keeps all.
    let kept = idem_core::store::prune_all(
        &pg_store,
        None,
        idem_core::Stamp::StoreClock,
        Duration::from_secs(3600),
        10,
    )
    .await
    .expect("prune");
    assert_eq!(kept, 0);
    drop((sqlx_p, pg_p, pg_store));
    sqlx_store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_migrated_by_idem_sql_serve_idem_postgres() {
    stores_share_claims("tables_migrated_by_idem_sql_serve_idem_postgres", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_migrated_by_idem_postgres_serve_idem_sql() {
    stores_share_claims("tables_migrated_by_idem_postgres_serve_idem_sql", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_records_are_shared() {
    let test = "request_records_are_shared";
    let Some(schema) = PgSchema::create("idem_interop", test).await else {
        return;
    };
    let sqlx_store = PostgresStore::from_pool(schema.pool(4).await);
    let pg_store = common::store(&common::config(&schema), Conns::Pool(4)).await;
    pg_store.migrate().await.expect("migrate");
    let key = RequestKey::new(
        RequestScope::new(["alice", "POST", "/charges"]),
        IdempotencyKey::new("k-1").expect("key"),
    );
    let fp = Fingerprint::of(b"body");
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(3600));
    let Begin::Acquired { fence, .. } = pg_store
        .begin_request(&key, &fp, lease, ttl)
        .await
        .expect("begin")
    else {
        panic!("a fresh key was not acquired");
    };
    let seen = sqlx_store
        .begin_request(&key, &fp, lease, ttl)
        .await
        .expect("lookup");
    assert!(matches!(seen, Begin::InProgress { .. }), "{seen:?}");
    let mut tx = pg_store.begin().await.expect("tx");
    pg_store
        .complete_in(&mut tx, &key, fence, b"201 created", ttl)
        .await
        .expect("complete");
    pg_store.commit(tx).await.expect("commit");
    let replay = sqlx_store
        .begin_request(&key, &fp, lease, ttl)
        .await
        .expect("replay");
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"201 created".to_vec()
        }
    );
    drop(pg_store);
    sqlx_store.pool().close().await;
    schema.drop().await;
}
