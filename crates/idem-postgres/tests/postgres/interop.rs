//! `idem-postgres` and `idem-sql`'s `PostgresStore` execute the same SQL (`idem_dialect`'s),
//! so they share tables: against the real server in `IDEM_TEST_POSTGRES_URL`, tables migrated
//! by either serve the other — a claim written by one is a duplicate (or a conflict) to the
//! other, by the single and the batch claim, plain and partitioned by the ID's time, where one
//! store's maintenance moves the other's claims — and a request record begun by one is
//! completed by it and replayed by the other.

use std::sync::Arc;
use std::time::Duration;

use idem_core::store::RequestStore;
use idem_core::{
    Begin, BoxError, ClaimStore, Fingerprint, IdempotencyKey, ManualClock, Message, MessageId,
    Migrate, Outcome, Processor, RequestKey, RequestScope, Retention, Stats, Timestamp,
    TransactionalStore,
};
use idem_postgres::partition::{Day, Partitioning};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;

use crate::common::{self, Conns};

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

/// Processes `id` with `payload`: `Some(true)` new, `Some(false)` a duplicate, `None` a
/// conflict.
async fn outcome<S: ClaimStore>(
    p: &Processor<S, Arc<ManualClock>>,
    id: &MessageId,
    payload: &str,
) -> Option<bool> {
    let msg = Message::new(id.clone(), payload.as_bytes().to_vec());
    match p.process(&msg, async |_tx| Ok::<_, BoxError>(())).await {
        Ok(Outcome::Processed(())) => Some(true),
        Ok(Outcome::Duplicate) => Some(false),
        Ok(Outcome::Conflict { .. }) => None,
        other => panic!("{id}: {other:?}"),
    }
}

/// Every claim in `ids` is a duplicate to `p`, by the single and the batch claim.
async fn duplicates<S>(p: &Processor<S, Arc<ManualClock>>, ids: &[&MessageId], to: &str)
where
    S: idem_core::BatchClaimStore,
{
    for id in ids {
        assert_eq!(outcome(p, id, "x").await, Some(false), "{id} to {to}");
    }
    let batch: Vec<_> = ids
        .iter()
        .map(|id| Message::new((*id).clone(), b"x".to_vec()))
        .collect();
    let set = p
        .process_batch_set(&batch, async |_, fresh| Ok::<_, BoxError>(fresh.len()))
        .await
        .expect("set batch");
    assert!(
        set.outcomes
            .iter()
            .all(|o| matches!(o, Ok(Outcome::Duplicate))),
        "batch to {to}: {:?}",
        set.outcomes
    );
}

/// Migrated by one store (`sqlx_migrates`) and again by the other, then claimed in by both:
/// each store's claims are duplicates, or conflicts, to the other. Partitioned, with IDs in
/// today's partition, the default one (IDs older than every day's partition) and the undated
/// one, and a backfilled day created by the store that did not migrate, which carves both
/// stores' claims out of the default partition into it.
async fn stores_share_claims(test: &str, sqlx_migrates: bool, partitioned: bool) {
    let Some(schema) = PgSchema::create("idem_interop", test).await else {
        return;
    };
    let mut sqlx_store = PostgresStore::from_pool(schema.pool(4).await);
    let mut pg_store = common::store(&common::config(&schema), Conns::Pool(4)).await;
    if partitioned {
        let p = Partitioning::uuid_v7().retention(Retention::new(7 * DAY, 7 * DAY).expect("r"));
        sqlx_store = sqlx_store.partitioned(p.clone()).expect("partitioned");
        pg_store = pg_store.partitioned(p).expect("partitioned");
    }
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
    let admin = common::client(&common::config(&schema)).await;
    let now: i64 = admin
        .query_one(idem_dialect::postgres::READ_CLOCK, &[])
        .await
        .expect("clock")
        .get(0);
    let now = Timestamp::from_micros(now);
    let clock = Arc::new(ManualClock::new(now));
    let sqlx_p = Processor::builder(sqlx_store.clone(), "shared")
        .clock(clock.clone())
        .build()
        .expect("p");
    let pg_p = Processor::builder(pg_store.clone(), "shared")
        .clock(clock)
        .build()
        .expect("p");

    let old = now.saturating_sub(DAY * 30);
    let by_sqlx = [
        uuid_at(now, 1),
        uuid_at(old, 2),
        MessageId::new("by-idem-sql").expect("id"),
    ];
    let by_pg = [
        uuid_at(now, 3),
        uuid_at(old, 4),
        MessageId::new("by-idem-postgres").expect("id"),
    ];
    for id in &by_sqlx {
        assert_eq!(outcome(&sqlx_p, id, "x").await, Some(true), "{id}");
        assert_eq!(outcome(&pg_p, id, "y").await, None, "{id}: a conflict");
    }
    for id in &by_pg {
        assert_eq!(outcome(&pg_p, id, "x").await, Some(true), "{id}");
        assert_eq!(outcome(&sqlx_p, id, "y").await, None, "{id}: a conflict");
    }
    let all: Vec<&MessageId> = by_sqlx.iter().chain(&by_pg).collect();
    duplicates(&sqlx_p, &all, "idem-sql").await;
    duplicates(&pg_p, &all, "idem-postgres").await;

    let (sqlx_stats, pg_stats) = (
        sqlx_store.stats().await.expect("stats"),
        pg_store.stats().await.expect("stats"),
    );
    assert_eq!(sqlx_stats, pg_stats);
    assert_eq!(pg_stats[0].claims, 6, "{pg_stats:?}");
    // Both stamped on the server's clock: a prune of everything older than an hour keeps all.
    let hour = Duration::from_secs(3600);
    let stamp = idem_core::Stamp::StoreClock;
    let pruned = if sqlx_migrates {
        idem_core::store::prune_all(&pg_store, None, stamp, hour, 10).await
    } else {
        idem_core::store::prune_all(&sqlx_store, None, stamp, hour, 10).await
    };
    assert_eq!(pruned.expect("prune"), 0);

    if partitioned {
        assert_eq!(
            sqlx_store.partitions().await.expect("partitions"),
            pg_store.partitions().await.expect("partitions")
        );
        // The old day, backfilled by the store that did not migrate: both stores' claims
        // move in out of the default partition, and still deduplicate.
        let created = if sqlx_migrates {
            pg_store.create_partitions([Day::of(old)]).await
        } else {
            sqlx_store.create_partitions([Day::of(old)]).await
        }
        .expect("backfill");
        assert_eq!(created.moved, 2, "{created:?}");
        duplicates(&sqlx_p, &all, "idem-sql after the move").await;
        duplicates(&pg_p, &all, "idem-postgres after the move").await;
    }

    drop((sqlx_p, pg_p, pg_store, admin));
    sqlx_store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_migrated_by_idem_sql_serve_idem_postgres() {
    stores_share_claims(
        "tables_migrated_by_idem_sql_serve_idem_postgres",
        true,
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_migrated_by_idem_postgres_serve_idem_sql() {
    stores_share_claims(
        "tables_migrated_by_idem_postgres_serve_idem_sql",
        false,
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_migrated_by_idem_sql_serve_idem_postgres() {
    let test = "partitioned_tables_migrated_by_idem_sql_serve_idem_postgres";
    stores_share_claims(test, true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_migrated_by_idem_postgres_serve_idem_sql() {
    let test = "partitioned_tables_migrated_by_idem_postgres_serve_idem_sql";
    stores_share_claims(test, false, true).await;
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

/// Each store's relay leases what the other's handlers enqueued, byte for byte, and marks,
/// releases and dead-letters rows the other leased to the same relay name — and not rows
/// leased to another relay. Tables migrated by one store, migrated again by the other.
async fn stores_share_the_outbox(test: &str, sqlx_migrates: bool) {
    use idem_core::outbox::{Emitter, OutboxStore, RelayStore};
    use idem_core::{ConsumerName, TableName};

    let Some(schema) = PgSchema::create("idem_interop", test).await else {
        return;
    };
    // A table name of its own, spelled in capitals: both stores fold it alike.
    let outbox = TableName::new("Shared_Outbox").expect("name");
    let sqlx_store = PostgresStore::from_pool(schema.pool(4).await)
        .with_outbox_table(outbox.clone())
        .expect("outbox table");
    let pg_store = common::store(&common::config(&schema), Conns::Pool(4))
        .await
        .with_outbox_table(outbox)
        .expect("outbox table");
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
    let consumer = ConsumerName::new("billing").expect("consumer");
    let mut e = Emitter::for_message(&consumer, &MessageId::new("payment-1").expect("id"));
    let by_sqlx = e
        .message("payments.charged", vec![0u8, 255, 10, 13])
        .and_then(|m| m.header("kind", "Charged \"x\"\n"))
        .and_then(|m| m.ordering_key("account-1"))
        .expect("message");
    let by_pg = e
        .message("payments.charged", b"second".to_vec())
        .and_then(|m| m.ordering_key("account-1"))
        .expect("message");
    let mut tx = sqlx_store.begin().await.expect("tx");
    sqlx_store
        .enqueue(&mut tx, std::slice::from_ref(&by_sqlx))
        .await
        .expect("enqueue");
    sqlx_store.commit(tx).await.expect("commit");
    let mut tx = pg_store.begin().await.expect("tx");
    // The first message again (a re-run) adds nothing beside the second.
    pg_store
        .enqueue(&mut tx, &[by_sqlx.clone(), by_pg.clone()])
        .await
        .expect("enqueue");
    pg_store.commit(tx).await.expect("commit");

    let long = Duration::from_secs(30);
    let leased = pg_store.lease("relay-1", 1, long).await.expect("lease");
    assert_eq!(leased.len(), 1);
    assert!(leased[0].message == by_sqlx, "{:?}", leased[0].message);
    // The key's next row is not another relay's while relay-1 holds its head, on either store.
    assert!(
        sqlx_store
            .lease("relay-2", 10, long)
            .await
            .expect("lease")
            .is_empty()
    );
    let both = sqlx_store.lease("relay-1", 10, long).await.expect("lease");
    assert_eq!(both.len(), 2);
    assert!(both[1].message == by_pg, "{:?}", both[1].message);
    sqlx_store
        .mark_sent("relay-2", &[both[0].seq])
        .await
        .expect("no error");
    sqlx_store
        .mark_sent("relay-1", &[both[0].seq])
        .await
        .expect("mark");
    pg_store
        .dead_letter("relay-1", both[1].seq, "refused")
        .await
        .expect("dead letter");
    for backlog in [
        sqlx_store.backlog().await.expect("backlog"),
        pg_store.backlog().await.expect("backlog"),
    ] {
        assert_eq!(
            (backlog.unsent, backlog.sent, backlog.dead_lettered),
            (0, 1, 1),
            "{backlog:?}"
        );
    }
    assert_eq!(pg_store.purge_sent(10).await.expect("purge"), 1);
    assert_eq!(sqlx_store.backlog().await.expect("backlog").sent, 0);
    drop(pg_store);
    sqlx_store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_migrated_by_idem_sql_serves_idem_postgres() {
    stores_share_the_outbox("an_outbox_migrated_by_idem_sql_serves_idem_postgres", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_migrated_by_idem_postgres_serves_idem_sql() {
    stores_share_the_outbox("an_outbox_migrated_by_idem_postgres_serves_idem_sql", false).await;
}
