//! Claims partitioned by the ID's own time, against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`: retention drops whole days, and deduplication holds across every
//! move maintenance makes (a late claim out of a dropped day, a future day's claims out of the
//! default partition); the same scenarios as `idem-sql`'s `tests/sql/partitions_postgres.rs`.
//! Each test gets its own schema.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimRequest, ConsumerName, ErrorKind, Fingerprint, ManualClock, Message, MessageId, Migrate,
    Outcome, Processor, Retention, Stamp, Timestamp,
};
use idem_postgres::partition::{Day, PartitionKind, Partitioning, uuid_v7};
use idem_postgres::tokio_postgres::Client;
use idem_postgres::{PgStore, TableName};
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
    let id = MessageId::new(id).expect("id");
    assert_eq!(
        uuid_v7(&id).map(|x| x.as_micros() / 1000),
        Some(t.as_micros() / 1000)
    );
    id
}

fn msg(id: &MessageId) -> Message<Vec<u8>> {
    Message::new(id.clone(), b"{}".to_vec())
}

async fn db_now(admin: &Client) -> Timestamp {
    let now: i64 = admin
        .query_one("SELECT (extract(epoch from now()) * 1000000)::bigint", &[])
        .await
        .expect("clock")
        .get(0);
    Timestamp::from_micros(now)
}

struct Setup {
    schema: PgSchema,
    store: PgStore,
    admin: Client,
}

async fn setup(test: &str, conns: Conns) -> Option<Setup> {
    setup_as(test, conns, false).await
}

/// [`setup`] on a table made as versions before the bounded layout made it (with PostgreSQL's
/// DEFAULT partition), which `migrate` keeps and maintenance keeps working on.
async fn setup_legacy(test: &str, conns: Conns) -> Option<Setup> {
    setup_as(test, conns, true).await
}

async fn setup_as(test: &str, conns: Conns, legacy: bool) -> Option<Setup> {
    let schema = PgSchema::create("idem_pg_part", test).await?;
    let config = common::config(&schema);
    let retention = Retention::new(7 * DAY, 7 * DAY).expect("retention");
    let store = common::store(&config, conns)
        .await
        .partitioned(Partitioning::uuid_v7().retention(retention))
        .expect("partitioned");
    let admin = common::client(&config).await;
    if legacy {
        make_legacy(&admin, &store).await;
    }
    store.migrate().await.expect("migrate");
    admin
        .batch_execute("CREATE TABLE effects (id bytea NOT NULL)")
        .await
        .expect("effects");
    Some(Setup {
        schema,
        store,
        admin,
    })
}

/// Creates `store`'s claims table as versions before the bounded layout did.
async fn make_legacy(admin: &Client, store: &PgStore) {
    let p = store.partitioning().expect("partitioned");
    for sql in idem_dialect::postgres::maintenance::legacy_create_statements(store.table(), p) {
        admin.batch_execute(&sql).await.expect("legacy table");
    }
}

async fn process(p: &Processor<PgStore, Arc<ManualClock>>, id: &MessageId) -> bool {
    let outcome = p
        .process(&msg(id), async |tx| {
            let insert = tx
                .prepare_cached("INSERT INTO effects (id) VALUES ($1)")
                .await?;
            tx.execute(&insert, &[&id.as_bytes()]).await
        })
        .await
        .expect("process");
    match outcome {
        Outcome::Processed(_) => true,
        Outcome::Duplicate => false,
        other => panic!("{id}: {other:?}"),
    }
}

async fn located(admin: &Client, id: &MessageId) -> Vec<String> {
    admin
        .query(
            "SELECT tableoid::regclass::text FROM idem_processed WHERE message_id = $1",
            &[&id.as_bytes()],
        )
        .await
        .expect("locate")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn retention_drops_whole_days_and_every_move_keeps_deduplicating(test: &str, conns: Conns) {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup_legacy(test, conns).await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let ago = |days: u32| now.saturating_sub(DAY * days);
    // migrate created today and two days ahead; a backfill makes the past days.
    let created = store
        .create_partitions([20, 19, 1].map(|d| Day::of(ago(d))))
        .await
        .expect("backfill");
    assert_eq!(created.created.len(), 3, "{created:?}");

    // Claims stamped by a clock at their own day, as a consumer would have written them.
    let clock = Arc::new(ManualClock::new(ago(20)));
    let p = Processor::builder(store.clone(), "billing")
        .clock(clock.clone())
        .build()
        .expect("processor");
    let old: Vec<_> = (0..5).map(|n| uuid_at(ago(20), n)).collect();
    for id in &old {
        assert!(process(&p, id).await);
    }
    clock.advance(DAY * 19);
    let recent = uuid_at(ago(1), 1);
    assert!(process(&p, &recent).await);
    // An old ID processed late: its day is past retention, its claim is not.
    clock.advance(DAY);
    let late = uuid_at(ago(19), 7);
    assert!(process(&p, &late).await);
    let undated = MessageId::new("payment-42").expect("id");
    assert!(process(&p, &undated).await);
    let future = uuid_at(now.saturating_add(DAY * 10), 3);
    assert!(process(&p, &future).await);
    assert_eq!(
        located(&admin, &future).await,
        vec!["idem_processed_default"]
    );
    assert_eq!(
        located(&admin, &undated).await,
        vec!["idem_processed_undated"]
    );

    let report = store.maintain_partitions().await.expect("maintenance");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert_eq!(
        dropped,
        vec![Day::of(ago(20)), Day::of(ago(19))],
        "{report:?}"
    );
    assert_eq!(
        report.moved, 1,
        "the late claim moved out of its dropped day"
    );
    assert_eq!(located(&admin, &late).await, vec!["idem_processed_default"]);

    // Past retention: gone, so a redelivery is processed again (as without partitions).
    for id in &old {
        assert!(located(&admin, id).await.is_empty(), "{id}");
    }
    // Inside retention: still duplicates, wherever maintenance moved them.
    for id in [&recent, &late, &undated, &future] {
        assert!(!process(&p, id).await, "{id} must stay a duplicate");
    }

    // The future day's partition, once created, takes its claim out of the default one.
    let moved = store
        .create_partitions([Day::of(now.saturating_add(DAY * 10))])
        .await
        .expect("create ahead");
    assert_eq!(moved.moved, 1);
    let day = Day::of(now.saturating_add(DAY * 10)).suffix();
    assert_eq!(
        located(&admin, &future).await,
        vec![format!("idem_processed_p{day}")]
    );
    assert!(
        !process(&p, &future).await,
        "still a duplicate after the move"
    );

    // The batch claim finds claims in every kind of partition too.
    let batch: Vec<_> = [&recent, &late, &undated, &future]
        .into_iter()
        .chain([&uuid_at(now, 9)])
        .map(msg)
        .collect();
    let set = p
        .process_batch_set(&batch, async |_, _| Ok::<_, idem_core::BoxError>(()))
        .await
        .expect("batch");
    let fresh = set
        .outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Outcome::Processed(_))))
        .count();
    assert_eq!(fresh, 1, "{:?}", set.outcomes);

    let kinds: Vec<PartitionKind> = store
        .partitions()
        .await
        .expect("partitions")
        .into_iter()
        .map(|p| p.kind)
        .collect();
    assert!(kinds.contains(&PartitionKind::Default) && kinds.contains(&PartitionKind::Undated));
    assert!(!kinds.contains(&PartitionKind::Day(Day::of(ago(20)))));
    assert!(kinds.contains(&PartitionKind::Day(Day::of(now))));
    drop((p, store, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_whole_days_and_every_move_keeps_deduplicating_pooled() {
    retention_drops_whole_days_and_every_move_keeps_deduplicating(
        "retention_drops_whole_days_and_every_move_keeps_deduplicating_pooled",
        Conns::Pool(8),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_whole_days_and_every_move_keeps_deduplicating_on_clients() {
    retention_drops_whole_days_and_every_move_keeps_deduplicating(
        "retention_drops_whole_days_and_every_move_keeps_deduplicating_on_clients",
        Conns::Clients(2),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_drops_days_and_prunes_the_default_partition_row_by_row() {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup_legacy(
        "prune_drops_days_and_prunes_the_default_partition_row_by_row",
        Conns::Pool(8),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    store
        .create_partitions([Day::of(now.saturating_sub(DAY * 30))])
        .await
        .expect("backfill");
    let clock = Arc::new(ManualClock::new(now.saturating_sub(DAY * 30)));
    let p = Processor::builder(store.clone(), "billing")
        .clock(clock.clone())
        .build()
        .expect("processor");
    let dated = uuid_at(now.saturating_sub(DAY * 30), 1);
    let undated = MessageId::new("order-1").expect("id");
    let future = uuid_at(now.saturating_add(DAY * 30), 2);
    assert!(process(&p, &dated).await);
    assert!(process(&p, &undated).await);
    assert!(process(&p, &future).await);
    clock.advance(DAY * 30);
    let fresh = MessageId::new("order-2").expect("id");
    assert!(process(&p, &fresh).await);

    // The dropped day counts by the planner's estimate (none before an ANALYZE); the old
    // undated claim and the old claim in the default partition were deleted row by row.
    let pruned = p.prune().await.expect("prune");
    assert!(pruned >= 2, "the old undated and default claims: {pruned}");
    assert!(located(&admin, &dated).await.is_empty());
    assert!(located(&admin, &undated).await.is_empty());
    assert!(located(&admin, &future).await.is_empty());
    assert!(!process(&p, &fresh).await, "young claims are kept");
    drop((p, store, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_and_a_table_of_the_other_shape_are_refused() {
    let Some(Setup {
        schema,
        store: partitioned,
        admin,
    }) = setup(
        "a_store_and_a_table_of_the_other_shape_are_refused",
        Conns::Pool(4),
    )
    .await
    else {
        return;
    };
    let config = common::config(&schema);
    let plain = common::store(&config, Conns::Pool(2)).await;
    let err = plain
        .migrate()
        .await
        .expect_err("plain store on a partitioned table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    // The catalog read works unconfigured; maintenance does not.
    let parts = plain.partitions().await.expect("partitions");
    assert_eq!(parts, partitioned.partitions().await.expect("partitions"));
    assert!(parts.len() >= 5, "undated, default, today and two ahead");
    let err = plain
        .maintain_partitions()
        .await
        .expect_err("not partitioned");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");

    let plain = plain
        .with_table(TableName::new("plain_claims").expect("name"))
        .expect("table");
    plain.migrate().await.expect("a plain table");
    assert_eq!(plain.partitions().await.expect("none"), vec![]);
    let err = plain
        .partitioned(Partitioning::ulid())
        .expect("partitioned")
        .migrate()
        .await
        .expect_err("partitioned store on a plain table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");

    drop((partitioned, admin));
    schema.drop().await;
}

/// The low-level claim inside a caller's own `tokio_postgres::Transaction` binds the key too:
/// new once, then the stored fingerprint, in the ID's day partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_on_a_partitioned_table_finds_the_claim_by_its_key() {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup(
        "claim_on_a_partitioned_table_finds_the_claim_by_its_key",
        Conns::Pool(2),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let mut own = common::client(&common::config(&schema)).await;
    let consumer = ConsumerName::new("own").expect("consumer");
    let fp = Fingerprint::of(b"x");
    let id = uuid_at(now, 1);
    for expected in [None, Some(fp)] {
        let tx = own.transaction().await.expect("begin");
        let claim = ClaimRequest {
            consumer: &consumer,
            id: &id,
            fingerprint: &fp,
            at: Stamp::StoreClock,
        };
        let found = store.claim_on(&tx, claim).await.expect("claim");
        assert_eq!(found, expected);
        tx.commit().await.expect("commit");
    }
    assert_eq!(
        located(&admin, &id).await,
        vec![format!("idem_processed_p{}", Day::of(now).suffix())]
    );
    drop((store, own, admin));
    schema.drop().await;
}

// Issue 18: a mixed-case table name, pruning through a store not configured partitioned,
// retention against the redelivery window, the recorded extractor, and lock order; the same
// scenarios as idem-sql's `tests/sql/partitions_postgres.rs`.

fn retention_7d() -> Partitioning {
    Partitioning::uuid_v7().retention(Retention::new(7 * DAY, 7 * DAY).expect("retention"))
}

async fn count(admin: &Client, sql: &str) -> i64 {
    common::count(admin, sql, &[]).await
}

/// Claims `ids` in one transaction, processed at `at`.
async fn claim_all(store: &PgStore, ids: &[MessageId], at: Stamp) {
    use idem_core::{BatchClaimStore, TransactionalStore};
    let consumer = ConsumerName::new("billing").expect("consumer");
    let items: Vec<_> = ids.iter().map(|id| (id, Fingerprint::of(b"{}"))).collect();
    let mut tx = store.begin().await.expect("begin");
    let found = store
        .claim_many(&mut tx, &consumer, &items, at)
        .await
        .expect("claim");
    assert!(found.iter().all(Option::is_none), "{found:?}");
    store.commit(tx).await.expect("commit");
}

/// A claim of `id` processed now, by the store's clock.
fn now_claim<'a>(
    consumer: &'a ConsumerName,
    id: &'a MessageId,
    fingerprint: &'a Fingerprint,
) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer,
        id,
        fingerprint,
        at: Stamp::StoreClock,
    }
}

/// Waits until some session waits for a lock on the relation `name` (or `done` says the
/// waiter finished first); false when none did within 1.5 s.
async fn lock_waited_on(admin: &Client, name: &str, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    while tokio::time::Instant::now() < deadline && !done() {
        let waiting = common::count(
            admin,
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)",
            &[&name],
        )
        .await;
        if waiting > 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// PostgreSQL folds unquoted names to lower case, so `Claims`, `claims` and `<schema>.claims`
/// are one table: a store given any of them finds its partitions (`partitions` lists them,
/// retention drops days) and takes the one maintenance lock, `idem-partitions:<schema>.claims`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_in_any_case_or_qualification_is_one_table() {
    let test = "a_table_name_in_any_case_or_qualification_is_one_table";
    let Some(schema) = PgSchema::create("idem_pg_part", test).await else {
        return;
    };
    let config = common::config(&schema);
    let pool = common::pool(&config, 6);
    let store = |table: &str| {
        PgStore::from_pool(pool.clone())
            .with_table(TableName::new(table).expect("name"))
            .expect("table")
            .partitioned(retention_7d())
            .expect("partitioned")
    };
    let mixed = store("Claims");
    let mut admin = common::client(&config).await;
    // Legacy: every backfill below creates the one day asked for.
    make_legacy(&admin, &mixed).await;
    mixed.migrate().await.expect("migrate");
    let now = db_now(&admin).await;
    let old = Day::of(now.saturating_sub(DAY * 20));
    let created = mixed.create_partitions([old]).await.expect("backfill");
    assert_eq!(created.created, vec![old]);
    let kinds: Vec<PartitionKind> = mixed
        .partitions()
        .await
        .expect("partitions")
        .into_iter()
        .map(|p| p.kind)
        .collect();
    assert!(kinds.contains(&PartitionKind::Day(old)), "{kinds:?}");
    assert!(kinds.contains(&PartitionKind::Default), "{kinds:?}");
    let report = mixed.maintain_partitions().await.expect("maintenance");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert_eq!(dropped, vec![old], "{report:?}");

    // Every spelling waits for the lock held under the canonical key.
    let holder = admin.transaction().await.expect("begin");
    let key = format!("idem-partitions:{}.claims", schema.name());
    holder
        .execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&key])
        .await
        .expect("hold the maintenance lock");
    let qualified = format!("{}.claims", schema.name());
    let shouting = qualified.to_uppercase();
    let spellings = ["Claims", "claims", qualified.as_str(), shouting.as_str()];
    let mut tasks = Vec::new();
    for (n, spelling) in spellings.iter().enumerate() {
        let store = store(spelling);
        let day = Day::of(now.saturating_sub(DAY * (40 + n as u32)));
        tasks.push(tokio::spawn(
            async move { store.create_partitions([day]).await },
        ));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    let mut waiting = 0;
    while tokio::time::Instant::now() < deadline {
        waiting = holder
            .query_one(
                "SELECT count(*) FROM pg_locks w JOIN pg_locks h \
                 USING (locktype, database, classid, objid, objsubid) \
                 WHERE w.locktype = 'advisory' AND NOT w.granted AND h.granted \
                 AND h.pid = pg_backend_pid()",
                &[],
            )
            .await
            .expect("pg_locks")
            .get::<_, i64>(0);
        if waiting == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.commit().await.expect("release");
    assert_eq!(waiting, 4, "every spelling waits for {key}");
    for task in tasks {
        let report = task.await.expect("task").expect("create");
        assert_eq!(report.created.len(), 1, "{report:?}");
    }
    drop((mixed, admin));
    schema.drop().await;
}

/// The reproduction of issue 18: 50 claims processed 30 days ago in their day's partition and
/// 50 processed now in today's. A store not configured partitioned refuses to prune the table
/// (its row-wise delete by position would hit every partition: it deleted all 100), through
/// `prune_all` and a processor's `prune` alike; the partitioned store drops the old day only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_store_refuses_to_prune_a_partitioned_table() {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup(
        "a_plain_store_refuses_to_prune_a_partitioned_table",
        Conns::Pool(4),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let month_ago = now.saturating_sub(DAY * 30);
    store
        .create_partitions([Day::of(month_ago)])
        .await
        .expect("backfill");
    let old: Vec<_> = (0..50).map(|n| uuid_at(month_ago, n)).collect();
    let young: Vec<_> = (0..50).map(|n| uuid_at(now, n)).collect();
    claim_all(&store, &old, Stamp::At(month_ago)).await;
    claim_all(&store, &young, Stamp::StoreClock).await;
    let total = "SELECT count(*) FROM idem_processed";
    assert_eq!(count(&admin, total).await, 100);

    let plain = common::store(&common::config(&schema), Conns::Pool(2)).await;
    let err = idem_core::store::prune_all(&plain, None, Stamp::StoreClock, 14 * DAY, 10_000)
        .await
        .expect_err("a plain store must not prune a partitioned table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("idem_processed"), "{err}");
    assert_eq!(count(&admin, total).await, 100, "nothing deleted");
    let p = Processor::builder(plain, "billing")
        .retention(Retention::new(14 * DAY, 7 * DAY).expect("retention"))
        .build()
        .expect("processor");
    let err = p.prune().await.expect_err("the processor's prune too");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert_eq!(count(&admin, total).await, 100, "nothing deleted");

    idem_core::store::prune_all(&store, None, Stamp::StoreClock, 14 * DAY, 10_000)
        .await
        .expect("the partitioned store prunes");
    assert_eq!(count(&admin, total).await, 50, "the old day dropped");
    let young_left = format!(
        "SELECT count(*) FROM idem_processed WHERE id_time >= {}",
        Day::of(now).start()
    );
    assert_eq!(
        count(&admin, &young_left).await,
        50,
        "every young claim kept"
    );
    drop((p, store, admin));
    schema.drop().await;
}

/// A redelivery window longer than the partitioned table keeps claims (its retention, seven
/// days and an hour by default) is refused when the processor is built: the table would drop
/// a day's claims while the broker can still redeliver them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_window_longer_than_the_table_keeps_claims_is_refused() {
    let Some(schema) = PgSchema::create(
        "idem_pg_part",
        "a_redelivery_window_longer_than_the_table_keeps_claims_is_refused",
    )
    .await
    else {
        return;
    };
    let config = common::config(&schema);
    let store = common::store(&config, Conns::Pool(2))
        .await
        .partitioned(Partitioning::uuid_v7())
        .expect("partitioned");
    let err = Processor::builder(store.clone(), "billing")
        .redelivery_window(14 * DAY)
        .build()
        .expect_err("14 days of redelivery against 7 of retention");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("14d"), "{err}");
    Processor::builder(store.clone(), "billing")
        .redelivery_window(14 * DAY)
        .naturally_idempotent()
        .build()
        .expect("no claims, nothing dropped too early");
    Processor::builder(store.clone(), "billing")
        .build()
        .expect("the default window fits the default retention");
    let long = store
        .partitioned(
            Partitioning::uuid_v7().retention(Retention::new(14 * DAY, 14 * DAY).expect("r")),
        )
        .expect("partitioned");
    Processor::builder(long, "billing")
        .redelivery_window(14 * DAY)
        .build()
        .expect("a table kept long enough");
    let plain = common::store(&config, Conns::Pool(1)).await;
    Processor::builder(plain, "billing")
        .redelivery_window(30 * DAY)
        .build()
        .expect("a plain table keeps claims until pruned");
    schema.drop().await;
}

/// The table records the extractor it was created with; a store reading IDs' times with
/// another (a rolling deploy that changed it) is refused at migrate and at maintenance, before
/// an old claim could be looked for in the wrong partition. A table made before the record
/// existed gets it at the next migrate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_reading_ids_otherwise_than_the_table_records_is_refused() {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup(
        "a_store_reading_ids_otherwise_than_the_table_records_is_refused",
        Conns::Pool(2),
    )
    .await
    else {
        return;
    };
    let other = common::store(&common::config(&schema), Conns::Pool(2))
        .await
        .partitioned(Partitioning::ulid())
        .expect("partitioned");
    let err = other.migrate().await.expect_err("another extractor");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(
        err.to_string().contains("uuid_v7") && err.to_string().contains("ulid"),
        "{err}"
    );
    let err = other
        .maintain_partitions()
        .await
        .expect_err("maintenance too");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    let err = idem_core::store::prune_all(&other, None, Stamp::StoreClock, DAY, 100)
        .await
        .expect_err("and pruning");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");

    admin
        .batch_execute("COMMENT ON TABLE idem_processed IS 'idem claims, from before the record'")
        .await
        .expect("an older table's comment");
    store
        .migrate()
        .await
        .expect("migrate records the extractor");
    let recorded: String = admin
        .query_one(
            "SELECT obj_description('idem_processed'::regclass, 'pg_class')",
            &[],
        )
        .await
        .expect("comment")
        .get(0);
    assert!(recorded.contains("extractor=uuid_v7"), "{recorded}");
    assert!(other.migrate().await.is_err(), "refused once recorded");
    drop((store, other, admin));
    schema.drop().await;
}

/// A claim routed to the day maintenance is creating, by a transaction that already holds the
/// claims table (an earlier claim), must not deadlock with it: maintenance locks the parent
/// table before the partition, as a claim does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_into_a_day_being_created_do_not_deadlock_with_maintenance() {
    use idem_core::{ClaimStore, TransactionalStore};
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup_legacy(
        "claims_into_a_day_being_created_do_not_deadlock_with_maintenance",
        Conns::Pool(6),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let later = now.saturating_add(DAY * 10);
    let (today_id, later_id) = (uuid_at(now, 1), uuid_at(later, 2));
    let consumer = ConsumerName::new("billing").expect("consumer");
    let fp = Fingerprint::of(b"{}");
    let mut tx = store.begin().await.expect("begin");
    store
        .claim(&mut tx, now_claim(&consumer, &today_id, &fp))
        .await
        .expect("claim today");
    let maintenance = {
        let store = store.clone();
        tokio::spawn(async move { store.create_partitions([Day::of(later)]).await })
    };
    assert!(
        lock_waited_on(&admin, "idem_processed", || maintenance.is_finished()).await,
        "maintenance waits for the claims table"
    );
    // Into the default partition, where the new day's claims are moved out of.
    let claimed = store
        .claim(&mut tx, now_claim(&consumer, &later_id, &fp))
        .await;
    let committed = match claimed {
        Ok(found) => {
            assert_eq!(found, None);
            store.commit(tx).await
        }
        Err(e) => Err(e),
    };
    let report = maintenance.await.expect("task");
    committed.expect("the claims commit");
    let report = report.expect("maintenance");
    assert_eq!(report.created, vec![Day::of(later)]);
    assert_eq!(report.moved, 1, "{report:?}");
    assert_eq!(
        located(&admin, &later_id).await,
        vec![format!("idem_processed_p{}", Day::of(later).suffix())]
    );
    drop((store, admin));
    schema.drop().await;
}

/// The same for a day being dropped: an old ID processed late, by a transaction that holds the
/// claims table already, lands in the day maintenance is dropping without a deadlock, and is
/// moved to the default partition (it is younger than the retention).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_into_a_day_being_dropped_do_not_deadlock_with_maintenance() {
    use idem_core::{ClaimStore, TransactionalStore};
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup_legacy(
        "claims_into_a_day_being_dropped_do_not_deadlock_with_maintenance",
        Conns::Pool(6),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let old = now.saturating_sub(DAY * 20);
    store
        .create_partitions([Day::of(old)])
        .await
        .expect("backfill");
    claim_all(&store, &[uuid_at(old, 1)], Stamp::At(old)).await;
    let (today_id, late_id) = (uuid_at(now, 1), uuid_at(old, 2));
    let consumer = ConsumerName::new("billing").expect("consumer");
    let fp = Fingerprint::of(b"{}");
    let mut tx = store.begin().await.expect("begin");
    store
        .claim(&mut tx, now_claim(&consumer, &today_id, &fp))
        .await
        .expect("claim today");
    let maintenance = {
        let store = store.clone();
        tokio::spawn(async move { store.maintain_partitions().await })
    };
    assert!(
        lock_waited_on(&admin, "idem_processed", || maintenance.is_finished()).await,
        "maintenance waits for the claims table"
    );
    let claimed = store
        .claim(&mut tx, now_claim(&consumer, &late_id, &fp))
        .await;
    let committed = match claimed {
        Ok(found) => {
            assert_eq!(found, None);
            store.commit(tx).await
        }
        Err(e) => Err(e),
    };
    let report = maintenance.await.expect("task");
    committed.expect("the claims commit");
    let report = report.expect("maintenance");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert_eq!(dropped, vec![Day::of(old)], "{report:?}");
    assert_eq!(report.moved, 1, "the late claim: {report:?}");
    assert_eq!(
        located(&admin, &late_id).await,
        vec!["idem_processed_default"]
    );
    drop((store, admin));
    schema.drop().await;
}

/// A replica of `store`'s table whose maintenance wants a day more ahead than exists.
async fn replica_ahead(schema: &PgSchema) -> PgStore {
    common::store(&common::config(schema), Conns::Pool(2))
        .await
        .partitioned(retention_7d().ahead(3 * DAY))
        .expect("partitioned")
}

/// Start-up goes on when partition maintenance cannot get a lock in time: the table exists,
/// and the days ahead are created by a later round. Here another session reads the claims
/// table in a long transaction while a replica with a longer `ahead` starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_goes_on_while_a_conflicting_table_lock_is_held() {
    let Some(Setup {
        schema,
        store,
        mut admin,
    }) = setup(
        "migrate_goes_on_while_a_conflicting_table_lock_is_held",
        Conns::Pool(2),
    )
    .await
    else {
        return;
    };
    let reader = admin.transaction().await.expect("begin");
    reader
        .execute("SELECT count(*) FROM idem_processed", &[])
        .await
        .expect("read");
    let replica = replica_ahead(&schema).await;
    let started = tokio::time::timeout(Duration::from_secs(60), replica.migrate()).await;
    reader.rollback().await.expect("end the read");
    started
        .expect("migrate returns")
        .expect("migrate goes on without its maintenance");
    drop((store, replica, admin));
    schema.drop().await;
}

/// The same while another session holds the maintenance lock (another replica's maintenance,
/// long at work): migrate does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_goes_on_while_another_session_holds_the_maintenance_lock() {
    let Some(Setup {
        schema,
        store,
        mut admin,
    }) = setup(
        "migrate_goes_on_while_another_session_holds_the_maintenance_lock",
        Conns::Pool(2),
    )
    .await
    else {
        return;
    };
    let holder = admin.transaction().await.expect("begin");
    let key = format!("idem-partitions:{}.idem_processed", schema.name());
    holder
        .execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&key])
        .await
        .expect("hold the maintenance lock");
    let replica = replica_ahead(&schema).await;
    let started = tokio::time::timeout(Duration::from_secs(10), replica.migrate()).await;
    holder.rollback().await.expect("release");
    started
        .expect("migrate does not wait for another replica's maintenance")
        .expect("migrate goes on without its maintenance");
    drop((store, replica, admin));
    schema.drop().await;
}

// The bounded layout (every table `migrate` creates), on tokio-postgres: the same rounds as
// `idem-sql`'s (`tests/sql/partitions_postgres.rs` has the full set), run by this store.

/// The claims table's partitions: (name, detach pending), and whether it has a DEFAULT one.
async fn layout(admin: &Client) -> (Vec<(String, bool)>, bool) {
    let rows = admin
        .query(
            "SELECT c.relname::text, i.inhdetachpending FROM pg_inherits i \
             JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'idem_processed'::regclass ORDER BY 1",
            &[],
        )
        .await
        .expect("layout");
    let has_default: bool = admin
        .query_one(
            "SELECT partdefid <> 0 FROM pg_partitioned_table \
             WHERE partrelid = 'idem_processed'::regclass",
            &[],
        )
        .await
        .expect("default")
        .get(0);
    (
        rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        has_default,
    )
}

/// An ID of a day with no partition is [`ErrorKind::Unavailable`] through tokio-postgres too:
/// nothing recorded, the handler's effect rolled back, processed once the day exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_for_a_day_without_a_partition_is_unavailable_not_dropped() {
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup(
        "a_claim_for_a_day_without_a_partition_is_unavailable_not_dropped",
        Conns::Pool(4),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    assert!(!layout(&admin).await.1, "bounded: no DEFAULT partition");
    let p = Processor::builder(store.clone(), "billing")
        .clock(Arc::new(ManualClock::new(now)))
        .build()
        .expect("processor");
    let future = uuid_at(now.saturating_add(DAY * 10), 3);
    let err = p
        .process(&msg(&future), async |tx| {
            let insert = tx
                .prepare_cached("INSERT INTO effects (id) VALUES ($1)")
                .await?;
            tx.execute(&insert, &[&future.as_bytes()]).await
        })
        .await
        .expect_err("no partition for the ID's day");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(count(&admin, "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        count(&admin, "SELECT count(*) FROM idem_processed").await,
        0
    );
    store
        .create_partitions([Day::of(now.saturating_add(DAY * 10))])
        .await
        .expect("create the day");
    assert!(process(&p, &future).await, "processed once its day exists");
    assert!(!process(&p, &future).await, "then a duplicate");
    drop((store, admin));
    schema.drop().await;
}

/// A day whose `DETACH … CONCURRENTLY` was cut short behind a long reader is half detached;
/// the next round finishes it, keeps its claim younger than the retention, and attaches the
/// default partition with its new bound. A claim issued while a round waits behind the reader
/// does not wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_detach_is_finished_by_the_next_round() {
    use idem_core::{ClaimStore, TransactionalStore};
    let Some(Setup {
        schema,
        store,
        admin,
    }) = setup(
        "an_interrupted_detach_is_finished_by_the_next_round",
        Conns::Pool(4),
    )
    .await
    else {
        return;
    };
    let now = db_now(&admin).await;
    let old = now.saturating_sub(DAY * 20);
    store
        .create_partitions([Day::of(old)])
        .await
        .expect("backfill");
    let late = uuid_at(old, 2);
    claim_all(&store, &[uuid_at(old, 1)], Stamp::At(old)).await;
    claim_all(&store, std::slice::from_ref(&late), Stamp::StoreClock).await;

    let mut reader = common::client(&common::config(&schema)).await;
    let tx = reader.transaction().await.expect("begin");
    tx.batch_execute(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM idem_processed",
    )
    .await
    .expect("read");
    let round = {
        let store = store.clone();
        tokio::spawn(async move { store.maintain_partitions().await })
    };
    let consumer = ConsumerName::new("billing").expect("consumer");
    let fp = Fingerprint::of(b"{}");
    let mut slowest = Duration::ZERO;
    for n in 0..10 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let id = uuid_at(db_now(&admin).await, 100 + n);
        let started = std::time::Instant::now();
        let mut claim_tx = store.begin().await.expect("begin");
        let found = store
            .claim(
                &mut claim_tx,
                ClaimRequest {
                    consumer: &consumer,
                    id: &id,
                    fingerprint: &fp,
                    at: Stamp::StoreClock,
                },
            )
            .await
            .expect("claim");
        assert_eq!(found, None);
        store.commit(claim_tx).await.expect("commit");
        slowest = slowest.max(started.elapsed());
    }
    let cut = round
        .await
        .expect("task")
        .expect_err("cut short behind the reader");
    assert_eq!(cut.kind(), ErrorKind::Transient, "{cut}");
    assert!(
        slowest < Duration::from_secs(1),
        "a claim waited {slowest:?} for the round"
    );
    let pending: Vec<String> = layout(&admin)
        .await
        .0
        .into_iter()
        .filter(|(_, p)| *p)
        .map(|(n, _)| n)
        .collect();
    assert_eq!(pending.len(), 1, "one day half detached: {pending:?}");
    tx.rollback().await.expect("end the read");

    let report = store.maintain_partitions().await.expect("the next round");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert!(dropped.contains(&Day::of(old)), "{report:?}");
    assert_eq!(report.moved, 1, "the late claim kept: {report:?}");
    let (rows, has_default) = layout(&admin).await;
    assert!(!has_default && rows.iter().all(|(_, p)| !p), "{rows:?}");
    assert_eq!(located(&admin, &late).await, vec!["idem_processed_default"]);
    drop((store, admin, reader));
    schema.drop().await;
}
