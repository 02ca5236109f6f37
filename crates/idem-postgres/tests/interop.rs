//! `idem-postgres` and `idem-sql`'s `PostgresStore` share tables: against the real server in
//! `IDEM_TEST_POSTGRES_URL`, tables migrated by either serve the other, a claim written by one
//! is a duplicate (or a conflict) to the other, pruning and statistics see both stores' rows,
//! and a request record begun by one is completed by it and replayed by the other. The same
//! for a table partitioned by the ID's time (both migrations make the same catalog; either
//! store's maintenance serves the other's claims), which is what proves the two copies of the
//! partition SQL agree.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::Conns;
use idem_core::partition::{Day, Partitioning};
use idem_core::store::RequestStore;
use idem_core::{
    Begin, BoxError, Fingerprint, IdempotencyKey, ManualClock, Message, MessageId, Migrate,
    Outcome, Processor, RequestKey, RequestScope, Retention, Stats, Timestamp, TransactionalStore,
};
use idem_postgres::PgStore;
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

// Partitioned claims: one schema, one set of statements, one maintenance lock for both stores.

const DAY: Duration = Duration::from_secs(86_400);

/// A UUIDv7 (text) made at `t`, distinct per `n`.
fn uuid_at(t: Timestamp, n: u16) -> MessageId {
    let ms = u64::try_from(t.as_micros() / 1000).expect("after the epoch");
    let hex = format!("{ms:012x}");
    let id = format!(
        "{}-{}-7{:03x}-8000-{:012x}",
        &hex[..8],
        &hex[8..],
        n & 0xfff,
        u64::from(n)
    );
    MessageId::new(id).expect("id")
}

fn partitioning() -> Partitioning {
    Partitioning::uuid_v7().retention(Retention::new(7 * DAY, 7 * DAY).expect("retention"))
}

/// Processes `id` with `payload`: `Some(true)` new, `Some(false)` a duplicate, `None` a
/// conflict.
async fn outcome<S>(
    p: &Processor<S, Arc<ManualClock>>,
    id: &MessageId,
    payload: &str,
) -> Option<bool>
where
    S: idem_core::ClaimStore,
{
    let msg = Message::new(id.clone(), payload.as_bytes().to_vec());
    match p.process(&msg, async |_tx| Ok::<_, BoxError>(())).await {
        Ok(Outcome::Processed(())) => Some(true),
        Ok(Outcome::Duplicate) => Some(false),
        Ok(Outcome::Conflict { .. }) => None,
        other => panic!("{id}: {other:?}"),
    }
}

/// Every claim in `ids` is a duplicate to both stores, by the single and the batch claim.
async fn duplicates_to_both(
    sqlx_p: &Processor<PostgresStore, Arc<ManualClock>>,
    pg_p: &Processor<PgStore, Arc<ManualClock>>,
    ids: &[&MessageId],
    when: &str,
) {
    for id in ids {
        assert_eq!(
            outcome(sqlx_p, id, "x").await,
            Some(false),
            "{id} to idem-sql {when}"
        );
        assert_eq!(
            outcome(pg_p, id, "x").await,
            Some(false),
            "{id} to idem-postgres {when}"
        );
    }
    let batch: Vec<_> = ids
        .iter()
        .map(|id| Message::new((*id).clone(), b"x".to_vec()))
        .collect();
    let sqlx_set = sqlx_p
        .process_batch_set(&batch, async |_, fresh| Ok::<_, BoxError>(fresh.len()))
        .await
        .expect("set batch");
    let pg_set = pg_p
        .process_batch_set(&batch, async |_, fresh| Ok::<_, BoxError>(fresh.len()))
        .await
        .expect("set batch");
    for set in [sqlx_set.outcomes, pg_set.outcomes] {
        assert!(
            set.iter().all(|o| matches!(o, Ok(Outcome::Duplicate))),
            "batch {when}: {set:?}"
        );
    }
}

/// A partitioned table migrated by one store (`sqlx_migrates`) and maintained by the other
/// serves both: claims made by either are duplicates (or conflicts) to the other before and
/// after every maintenance move, both stores' maintenance takes turns on one lock, and the
/// row-wise prune of one deletes the other's claims from the default and undated partitions.
async fn stores_share_partitioned_claims(test: &str, sqlx_migrates: bool) {
    let Some(schema) = PgSchema::create("idem_interop", test).await else {
        return;
    };
    let config = common::config(&schema);
    let sqlx_store = PostgresStore::from_pool(schema.pool(4).await)
        .partitioned(partitioning())
        .expect("partitioned");
    let pg_store = common::store(&config, Conns::Pool(4))
        .await
        .partitioned(partitioning())
        .expect("partitioned");
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
    assert_eq!(
        sqlx_store.partitions().await.expect("partitions"),
        pg_store.partitions().await.expect("partitions")
    );
    let admin = common::client(&config).await;
    let now: i64 = admin
        .query_one("SELECT (extract(epoch from now()) * 1000000)::bigint", &[])
        .await
        .expect("clock")
        .get(0);
    let now = Timestamp::from_micros(now);
    let ago = |days: u32| now.saturating_sub(DAY * days);

    // Both stores backfill the same days at once: each day is created once, by one of them.
    let days: Vec<Day> = (18..=22).rev().map(|d| Day::of(ago(d))).collect();
    let (by_sqlx, by_pg) = tokio::join!(
        sqlx_store.create_partitions(days.clone()),
        pg_store.create_partitions(days.clone())
    );
    let (by_sqlx, by_pg) = (
        by_sqlx.expect("idem-sql backfill"),
        by_pg.expect("backfill"),
    );
    let mut created = [by_sqlx.created, by_pg.created].concat();
    created.sort();
    assert_eq!(created, days, "each day created once");

    let clock = Arc::new(ManualClock::new(ago(20)));
    let sqlx_p = Processor::builder(sqlx_store.clone(), "shared")
        .clock(clock.clone())
        .build()
        .expect("p");
    let pg_p = Processor::builder(pg_store.clone(), "shared")
        .clock(clock.clone())
        .build()
        .expect("p");
    // Old claims, processed on their own day, by each store.
    let (old_s, old_p) = (uuid_at(ago(20), 1), uuid_at(ago(20), 2));
    assert_eq!(outcome(&sqlx_p, &old_s, "x").await, Some(true));
    assert_eq!(outcome(&pg_p, &old_p, "x").await, Some(true));
    // Today, by each store: an old ID processed late, an ID from a producer ten days ahead
    // (default partition), an ID without a time (undated), and a dated one.
    clock.advance(DAY * 20);
    let future = now.saturating_add(DAY * 10);
    let (late_s, late_p) = (uuid_at(ago(20), 3), uuid_at(ago(20), 4));
    let (future_s, future_p) = (uuid_at(future, 5), uuid_at(future, 6));
    let (undated_s, undated_p) = (
        MessageId::new("by-idem-sql").expect("id"),
        MessageId::new("by-idem-postgres").expect("id"),
    );
    let (today_s, today_p) = (uuid_at(now, 7), uuid_at(now, 8));
    for id in [&late_s, &future_s, &undated_s, &today_s] {
        assert_eq!(outcome(&sqlx_p, id, "x").await, Some(true), "{id}");
        assert_eq!(outcome(&pg_p, id, "y").await, None, "{id}: a conflict");
    }
    for id in [&late_p, &future_p, &undated_p, &today_p] {
        assert_eq!(outcome(&pg_p, id, "x").await, Some(true), "{id}");
        assert_eq!(outcome(&sqlx_p, id, "y").await, None, "{id}: a conflict");
    }
    let kept = [
        &late_s, &late_p, &future_s, &future_p, &undated_s, &undated_p, &today_s, &today_p,
    ];
    duplicates_to_both(&sqlx_p, &pg_p, &kept, "before maintenance").await;

    // Maintenance by the store that did not migrate: the old days dropped, the late claims of
    // both stores moved out of them first.
    let report = if sqlx_migrates {
        pg_store.maintain_partitions().await
    } else {
        sqlx_store.maintain_partitions().await
    }
    .expect("maintenance");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert_eq!(dropped, days, "{report:?}");
    assert_eq!(report.moved, 2, "both late claims: {report:?}");
    duplicates_to_both(&sqlx_p, &pg_p, &kept, "after the drop").await;
    assert_eq!(
        outcome(&sqlx_p, &old_p, "x").await,
        Some(true),
        "past retention"
    );
    assert_eq!(
        outcome(&pg_p, &old_s, "x").await,
        Some(true),
        "past retention"
    );

    // The future day created by the migrating store: both stores' claims move in.
    let created = if sqlx_migrates {
        sqlx_store.create_partitions([Day::of(future)]).await
    } else {
        pg_store.create_partitions([Day::of(future)]).await
    }
    .expect("create ahead");
    assert_eq!(created.moved, 2, "{created:?}");
    duplicates_to_both(&sqlx_p, &pg_p, &kept, "after the move into a new day").await;

    // A row-wise prune (as if a month had passed) by the migrating store deletes both stores'
    // claims from the default partition (the late ones) and the undated one, and no day's.
    let prune_at = idem_core::Stamp::At(now.saturating_add(DAY * 30));
    let pruned = if sqlx_migrates {
        idem_core::store::prune_all(&sqlx_store, None, prune_at, 7 * DAY, 3).await
    } else {
        idem_core::store::prune_all(&pg_store, None, prune_at, 7 * DAY, 3).await
    }
    .expect("prune");
    // Late: the two moved out of the dropped day, and the two old IDs processed again.
    assert_eq!(pruned, 6, "late and undated, of both stores");
    for id in [&late_s, &late_p, &old_s, &old_p, &undated_s, &undated_p] {
        assert_eq!(outcome(&pg_p, id, "x").await, Some(true), "{id} pruned");
    }
    duplicates_to_both(
        &sqlx_p,
        &pg_p,
        &[&future_s, &future_p, &today_s, &today_p],
        "after the prune",
    )
    .await;

    drop((sqlx_p, pg_p, pg_store, admin));
    sqlx_store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_migrated_by_idem_sql_serve_idem_postgres() {
    stores_share_partitioned_claims(
        "partitioned_tables_migrated_by_idem_sql_serve_idem_postgres",
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_migrated_by_idem_postgres_serve_idem_sql() {
    stores_share_partitioned_claims(
        "partitioned_tables_migrated_by_idem_postgres_serve_idem_sql",
        false,
    )
    .await;
}

/// Everything the catalog says about the tables in `schema` (each one's kind, partition key
/// and bounds, comment, columns, indexes and constraints), with the schema's name taken out.
async fn catalog(schema: &PgSchema) -> Vec<String> {
    let admin = common::client(&common::config(schema)).await;
    let rows = admin
        .query(
            "WITH s AS (SELECT oid FROM pg_namespace WHERE nspname = current_schema()), \
             c AS (SELECT c.* FROM pg_class c, s WHERE c.relnamespace = s.oid) \
             SELECT format('relation %s %s %s %s %s', relname, relkind, \
                    pg_get_expr(relpartbound, oid), \
                    CASE WHEN relkind = 'p' THEN pg_get_partkeydef(oid) END, \
                    obj_description(oid, 'pg_class')) FROM c \
             UNION ALL SELECT format('column %s %s %s %s %s', c.relname, a.attnum, a.attname, \
                    format_type(a.atttypid, a.atttypmod), a.attnotnull) \
             FROM pg_attribute a JOIN c ON c.oid = a.attrelid \
             WHERE a.attnum > 0 AND NOT a.attisdropped \
             UNION ALL SELECT format('index %s', pg_get_indexdef(i.indexrelid)) \
             FROM pg_index i JOIN c ON c.oid = i.indrelid \
             UNION ALL SELECT format('constraint %s %s %s', c.relname, k.conname, \
                    pg_get_constraintdef(k.oid)) FROM pg_constraint k JOIN c ON c.oid = k.conrelid \
             ORDER BY 1",
            &[],
        )
        .await
        .expect("catalog");
    rows.iter()
        .map(|r| r.get::<_, String>(0).replace(schema.name(), "<schema>"))
        .collect()
}

/// Both stores' migrations make the same schema, catalog entry for catalog entry: plain, and
/// partitioned (with the same day partitions, created by each store's maintenance).
async fn both_migrations_make_the_same_schema(test: &str, partitioned: bool) {
    let (Some(by_sqlx), Some(by_pg)) = (
        PgSchema::create("idem_interop_s", test).await,
        PgSchema::create("idem_interop_p", test).await,
    ) else {
        return;
    };
    let sqlx_store = PostgresStore::from_pool(by_sqlx.pool(2).await);
    let pg_store = common::store(&common::config(&by_pg), Conns::Pool(2)).await;
    let (sqlx_store, pg_store) = if partitioned {
        (
            sqlx_store.partitioned(partitioning()).expect("partitioned"),
            pg_store.partitioned(partitioning()).expect("partitioned"),
        )
    } else {
        (sqlx_store, pg_store)
    };
    sqlx_store.migrate().await.expect("idem-sql migrates");
    pg_store.migrate().await.expect("idem-postgres migrates");
    let (sqlx_catalog, pg_catalog) = (catalog(&by_sqlx).await, catalog(&by_pg).await);
    assert!(sqlx_catalog.len() > 10, "{sqlx_catalog:#?}");
    assert_eq!(sqlx_catalog, pg_catalog);
    if partitioned {
        let parent = sqlx_catalog
            .iter()
            .find(|l| l.starts_with("relation idem_processed p "))
            .expect("a partitioned parent");
        assert!(parent.contains("RANGE (id_time)"), "{parent}");
    }
    drop(pg_store);
    sqlx_store.pool().close().await;
    by_sqlx.drop().await;
    by_pg.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_migrations_make_the_same_plain_schema() {
    both_migrations_make_the_same_schema("both_migrations_make_the_same_plain_schema", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_migrations_make_the_same_partitioned_schema() {
    both_migrations_make_the_same_schema("both_migrations_make_the_same_partitioned_schema", true)
        .await;
}
