//! Claims partitioned by the ID's own time, against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`: retention drops whole days, and deduplication holds across every
//! move maintenance makes (a late claim out of a dropped day, a future day's claims out of the
//! default partition). Each test gets its own schema.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ErrorKind, ManualClock, Message, MessageId, Migrate, Outcome, Processor, Retention, Timestamp,
};
use idem_sql::PostgresStore;
use idem_sql::partition::{Day, PartitionKind, Partitioning, uuid_v7};
use idem_testkit::isolated::PgSchema;

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

async fn db_now(store: &PostgresStore) -> Timestamp {
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from now()) * 1000000)::bigint")
        .fetch_one(store.pool())
        .await
        .expect("clock");
    Timestamp::from_micros(now)
}

async fn setup(test: &str) -> Option<(PgSchema, PostgresStore)> {
    setup_as(test, false).await
}

/// [`setup`] on a table made as versions before the bounded layout made it (with PostgreSQL's
/// DEFAULT partition), which `migrate` keeps and maintenance keeps working on.
async fn setup_legacy(test: &str) -> Option<(PgSchema, PostgresStore)> {
    setup_as(test, true).await
}

async fn setup_as(test: &str, legacy: bool) -> Option<(PgSchema, PostgresStore)> {
    let schema = PgSchema::create("idem_part", test).await?;
    let retention = Retention::new(7 * DAY, 7 * DAY).expect("retention");
    let store = PostgresStore::from_pool(schema.pool(8).await)
        .partitioned(Partitioning::uuid_v7().retention(retention))
        .expect("partitioned");
    if legacy {
        make_legacy(store.pool(), &store).await;
    }
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (id bytea NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    Some((schema, store))
}

/// Creates `store`'s claims table as versions before the bounded layout did.
async fn make_legacy(pool: &sqlx::PgPool, store: &PostgresStore) {
    let p = store.partitioning().expect("partitioned");
    for sql in idem_dialect::postgres::maintenance::legacy_create_statements(store.table(), p) {
        sqlx::raw_sql(&sql)
            .execute(pool)
            .await
            .expect("legacy table");
    }
}

async fn process(p: &Processor<PostgresStore, Arc<ManualClock>>, id: &MessageId) -> bool {
    let outcome = p
        .process(&msg(id), async |tx| {
            sqlx::query("INSERT INTO effects (id) VALUES ($1)")
                .bind(id.as_bytes())
                .execute(&mut **tx)
                .await
        })
        .await
        .expect("process");
    match outcome {
        Outcome::Processed(_) => true,
        Outcome::Duplicate => false,
        other => panic!("{id}: {other:?}"),
    }
}

async fn located(store: &PostgresStore, id: &MessageId) -> Vec<String> {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM idem_processed WHERE message_id = $1")
        .bind(id.as_bytes())
        .fetch_all(store.pool())
        .await
        .expect("locate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_whole_days_and_every_move_keeps_deduplicating() {
    let Some((schema, store)) =
        setup_legacy("retention_drops_whole_days_and_every_move_keeps_deduplicating").await
    else {
        return;
    };
    let now = db_now(&store).await;
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
        located(&store, &future).await,
        vec!["idem_processed_default"]
    );
    assert_eq!(
        located(&store, &undated).await,
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
    assert_eq!(located(&store, &late).await, vec!["idem_processed_default"]);

    // Past retention: gone, so a redelivery is processed again (as without partitions).
    for id in &old {
        assert!(located(&store, id).await.is_empty(), "{id}");
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
        located(&store, &future).await,
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
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_drops_days_and_prunes_the_default_partition_row_by_row() {
    let Some((schema, store)) =
        setup("prune_drops_days_and_prunes_the_default_partition_row_by_row").await
    else {
        return;
    };
    let now = db_now(&store).await;
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
    assert!(process(&p, &dated).await);
    assert!(process(&p, &undated).await);
    clock.advance(DAY * 30);
    let fresh = MessageId::new("order-2").expect("id");
    assert!(process(&p, &fresh).await);

    // The dropped day counts by the planner's estimate (none before an ANALYZE); the undated
    // claim was deleted row by row.
    let pruned = p.prune().await.expect("prune");
    assert!(pruned >= 1, "the old undated claim: {pruned}");
    assert!(located(&store, &dated).await.is_empty());
    assert!(located(&store, &undated).await.is_empty());
    assert!(!process(&p, &fresh).await, "young claims are kept");
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_and_a_table_of_the_other_shape_are_refused() {
    let Some((schema, partitioned)) =
        setup("a_store_and_a_table_of_the_other_shape_are_refused").await
    else {
        return;
    };
    let plain = PostgresStore::from_pool(partitioned.pool().clone());
    let err = plain
        .migrate()
        .await
        .expect_err("plain store on a partitioned table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    let other = idem_sql::TableName::new("plain_claims").expect("name");
    let plain = plain.with_table(other.clone()).expect("table");
    plain.migrate().await.expect("a plain table");
    let err = plain
        .partitioned(Partitioning::ulid())
        .expect("partitioned")
        .migrate()
        .await
        .expect_err("partitioned store on a plain table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    schema.drop().await;
}

// Issue 18: a mixed-case table name, pruning through a store not configured partitioned,
// retention against the redelivery window, the recorded extractor, and lock order.

const MINUTE: Duration = Duration::from_secs(60);

/// A store on `pool` for `table`, partitioned by UUIDv7 with the default seven days.
fn partitioned_on(pool: &sqlx::PgPool, table: &str) -> PostgresStore {
    PostgresStore::from_pool(pool.clone())
        .with_table(idem_sql::TableName::new(table).expect("name"))
        .expect("table")
        .partitioned(
            Partitioning::uuid_v7().retention(Retention::new(7 * DAY, 7 * DAY).expect("r")),
        )
        .expect("partitioned")
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// Claims `ids` in one transaction, processed at `at`.
async fn claim_all(store: &PostgresStore, ids: &[MessageId], at: idem_core::Stamp) {
    use idem_core::{BatchClaimStore, ConsumerName, Fingerprint, TransactionalStore};
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
    consumer: &'a idem_core::ConsumerName,
    id: &'a MessageId,
    fingerprint: &'a idem_core::Fingerprint,
) -> idem_core::ClaimRequest<'a> {
    idem_core::ClaimRequest {
        consumer,
        id,
        fingerprint,
        at: idem_core::Stamp::StoreClock,
    }
}

/// Waits until some session waits for a lock on the relation `name` (or `done` says the
/// waiter finished first); false when none did within 1.5 s.
async fn lock_waited_on(pool: &sqlx::PgPool, name: &str, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    while tokio::time::Instant::now() < deadline && !done() {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)",
        )
        .bind(name)
        .fetch_one(pool)
        .await
        .expect("pg_locks");
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
    let Some(schema) = PgSchema::create("idem_part", test).await else {
        return;
    };
    let pool = schema.pool(6).await;
    let mixed = partitioned_on(&pool, "Claims");
    // Legacy: every backfill below creates the one day asked for.
    make_legacy(&pool, &mixed).await;
    mixed.migrate().await.expect("migrate");
    let now = db_now(&mixed).await;
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
    let mut holder = pool.begin().await.expect("begin");
    let key = format!("idem-partitions:{}.claims", schema.name());
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(&key)
        .execute(&mut *holder)
        .await
        .expect("hold the maintenance lock");
    let qualified = format!("{}.claims", schema.name());
    let shouting = qualified.to_uppercase();
    let spellings = ["Claims", "claims", qualified.as_str(), shouting.as_str()];
    let mut tasks = Vec::new();
    for (n, spelling) in spellings.iter().enumerate() {
        let store = partitioned_on(&pool, spelling);
        let day = Day::of(now.saturating_sub(DAY * (40 + n as u32)));
        tasks.push(tokio::spawn(
            async move { store.create_partitions([day]).await },
        ));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    let mut waiting = 0;
    while tokio::time::Instant::now() < deadline {
        waiting = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks w JOIN pg_locks h \
             USING (locktype, database, classid, objid, objsubid) \
             WHERE w.locktype = 'advisory' AND NOT w.granted AND h.granted \
             AND h.pid = pg_backend_pid()",
        )
        .fetch_one(&mut *holder)
        .await
        .expect("pg_locks");
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
    drop((mixed, pool));
    schema.drop().await;
}

/// The reproduction of issue 18: 50 claims processed 30 days ago in their day's partition and
/// 50 processed now in today's. A store not configured partitioned refuses to prune the table
/// (its row-wise delete by position would hit every partition: it deleted all 100), through
/// `prune_all` and a processor's `prune` alike; the partitioned store drops the old day only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_store_refuses_to_prune_a_partitioned_table() {
    let Some((schema, store)) = setup("a_plain_store_refuses_to_prune_a_partitioned_table").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let month_ago = now.saturating_sub(DAY * 30);
    store
        .create_partitions([Day::of(month_ago)])
        .await
        .expect("backfill");
    let old: Vec<_> = (0..50).map(|n| uuid_at(month_ago, n)).collect();
    let young: Vec<_> = (0..50).map(|n| uuid_at(now, n)).collect();
    claim_all(&store, &old, idem_core::Stamp::At(month_ago)).await;
    claim_all(&store, &young, idem_core::Stamp::StoreClock).await;
    let total = "SELECT count(*) FROM idem_processed";
    assert_eq!(count(store.pool(), total).await, 100);

    let plain = PostgresStore::from_pool(store.pool().clone());
    let now_stamp = idem_core::Stamp::StoreClock;
    let err = idem_core::store::prune_all(&plain, None, now_stamp, 14 * DAY, 10_000)
        .await
        .expect_err("a plain store must not prune a partitioned table");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("idem_processed"), "{err}");
    assert_eq!(count(store.pool(), total).await, 100, "nothing deleted");
    let p = Processor::builder(plain, "billing")
        .retention(Retention::new(14 * DAY, 7 * DAY).expect("retention"))
        .build()
        .expect("processor");
    let err = p.prune().await.expect_err("the processor's prune too");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert_eq!(count(store.pool(), total).await, 100, "nothing deleted");

    idem_core::store::prune_all(&store, None, now_stamp, 14 * DAY, 10_000)
        .await
        .expect("the partitioned store prunes");
    assert_eq!(count(store.pool(), total).await, 50, "the old day dropped");
    let young_left = format!(
        "SELECT count(*) FROM idem_processed WHERE id_time >= {}",
        Day::of(now).start()
    );
    assert_eq!(
        count(store.pool(), &young_left).await,
        50,
        "every young claim kept"
    );
    schema.drop().await;
}

/// A redelivery window longer than the partitioned table keeps claims (its retention, seven
/// days and an hour by default) is refused when the processor is built: the table would drop
/// a day's claims while the broker can still redeliver them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_window_longer_than_the_table_keeps_claims_is_refused() {
    let Some(schema) = PgSchema::create(
        "idem_part",
        "a_redelivery_window_longer_than_the_table_keeps_claims_is_refused",
    )
    .await
    else {
        return;
    };
    let pool = schema.pool(2).await;
    let store = PostgresStore::from_pool(pool.clone())
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
    Processor::builder(store, "billing")
        .build()
        .expect("the default window fits the default retention");
    let long = PostgresStore::from_pool(pool.clone())
        .partitioned(
            Partitioning::uuid_v7().retention(Retention::new(14 * DAY, 14 * DAY).expect("r")),
        )
        .expect("partitioned");
    Processor::builder(long, "billing")
        .redelivery_window(14 * DAY)
        .build()
        .expect("a table kept long enough");
    let plain = PostgresStore::from_pool(pool);
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
    let Some((schema, store)) =
        setup("a_store_reading_ids_otherwise_than_the_table_records_is_refused").await
    else {
        return;
    };
    let other = PostgresStore::from_pool(store.pool().clone())
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
    let err = idem_core::store::prune_all(&other, None, idem_core::Stamp::StoreClock, DAY, 100)
        .await
        .expect_err("and pruning");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");

    let comment = "SELECT obj_description('idem_processed'::regclass, 'pg_class')";
    sqlx::query("COMMENT ON TABLE idem_processed IS 'idem claims, from before the record'")
        .execute(store.pool())
        .await
        .expect("an older table's comment");
    store
        .migrate()
        .await
        .expect("migrate records the extractor");
    let recorded: String = sqlx::query_scalar(comment)
        .fetch_one(store.pool())
        .await
        .expect("comment");
    assert!(recorded.contains("extractor=uuid_v7"), "{recorded}");
    assert!(other.migrate().await.is_err(), "refused once recorded");
    schema.drop().await;
}

/// A claim routed to the day maintenance is creating, by a transaction that already holds the
/// claims table (an earlier claim), must not deadlock with it: maintenance locks the parent
/// table before the partition, as a claim does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_into_a_day_being_created_do_not_deadlock_with_maintenance() {
    use idem_core::{ClaimStore, ConsumerName, Fingerprint, TransactionalStore};
    let Some((schema, store)) =
        setup_legacy("claims_into_a_day_being_created_do_not_deadlock_with_maintenance").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let later = now.saturating_add(DAY * 10);
    let (today_id, later_id) = (uuid_at(now, 1), uuid_at(later, 2));
    let consumer = ConsumerName::new("billing").expect("consumer");
    let fp = Fingerprint::of(b"{}");
    let claim = |id| now_claim(&consumer, id, &fp);
    let mut tx = store.begin().await.expect("begin");
    store
        .claim(&mut tx, claim(&today_id))
        .await
        .expect("claim today");
    let maintenance = {
        let store = store.clone();
        tokio::spawn(async move { store.create_partitions([Day::of(later)]).await })
    };
    assert!(
        lock_waited_on(store.pool(), "idem_processed", || maintenance.is_finished()).await,
        "maintenance waits for the claims table"
    );
    // Into the default partition, where the new day's claims are moved out of.
    let claimed = store.claim(&mut tx, claim(&later_id)).await;
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
        located(&store, &later_id).await,
        vec![format!("idem_processed_p{}", Day::of(later).suffix())]
    );
    schema.drop().await;
}

/// The same for a day being dropped: an old ID processed late, by a transaction that holds the
/// claims table already, lands in the day maintenance is dropping without a deadlock, and is
/// moved to the default partition (it is younger than the retention).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_into_a_day_being_dropped_do_not_deadlock_with_maintenance() {
    use idem_core::{ClaimStore, ConsumerName, Fingerprint, Stamp, TransactionalStore};
    let Some((schema, store)) =
        setup_legacy("claims_into_a_day_being_dropped_do_not_deadlock_with_maintenance").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let old = now.saturating_sub(DAY * 20);
    store
        .create_partitions([Day::of(old)])
        .await
        .expect("backfill");
    claim_all(&store, &[uuid_at(old, 1)], Stamp::At(old)).await;
    let (today_id, late_id) = (uuid_at(now, 1), uuid_at(old, 2));
    let consumer = ConsumerName::new("billing").expect("consumer");
    let fp = Fingerprint::of(b"{}");
    let claim = |id| now_claim(&consumer, id, &fp);
    let mut tx = store.begin().await.expect("begin");
    store
        .claim(&mut tx, claim(&today_id))
        .await
        .expect("claim today");
    let maintenance = {
        let store = store.clone();
        tokio::spawn(async move { store.maintain_partitions().await })
    };
    assert!(
        lock_waited_on(store.pool(), "idem_processed", || maintenance.is_finished()).await,
        "maintenance waits for the claims table"
    );
    let claimed = store.claim(&mut tx, claim(&late_id)).await;
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
        located(&store, &late_id).await,
        vec!["idem_processed_default"]
    );
    schema.drop().await;
}

/// Start-up goes on when partition maintenance cannot get a lock in time: the table exists,
/// and the days ahead are created by a later round. Here another session reads the claims
/// table in a long transaction while a replica with a longer `ahead` starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_goes_on_while_a_conflicting_table_lock_is_held() {
    let Some((schema, store)) =
        setup("migrate_goes_on_while_a_conflicting_table_lock_is_held").await
    else {
        return;
    };
    let mut reader = store.pool().begin().await.expect("begin");
    sqlx::query("SELECT count(*) FROM idem_processed")
        .execute(&mut *reader)
        .await
        .expect("read");
    let replica = PostgresStore::from_pool(store.pool().clone())
        .partitioned(
            Partitioning::uuid_v7()
                .retention(Retention::new(7 * DAY, 7 * DAY).expect("r"))
                .ahead(3 * DAY),
        )
        .expect("partitioned");
    let started = tokio::time::timeout(MINUTE, replica.migrate()).await;
    reader.rollback().await.expect("end the read");
    started
        .expect("migrate returns")
        .expect("migrate goes on without its maintenance");
    schema.drop().await;
}

/// The same while another session holds the maintenance lock (another replica's maintenance,
/// long at work): migrate does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_goes_on_while_another_session_holds_the_maintenance_lock() {
    let Some((schema, store)) =
        setup("migrate_goes_on_while_another_session_holds_the_maintenance_lock").await
    else {
        return;
    };
    let mut holder = store.pool().begin().await.expect("begin");
    let key = format!("idem-partitions:{}.idem_processed", schema.name());
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(&key)
        .execute(&mut *holder)
        .await
        .expect("hold the maintenance lock");
    let replica = PostgresStore::from_pool(store.pool().clone())
        .partitioned(
            Partitioning::uuid_v7()
                .retention(Retention::new(7 * DAY, 7 * DAY).expect("r"))
                .ahead(3 * DAY),
        )
        .expect("partitioned");
    let started = tokio::time::timeout(Duration::from_secs(10), replica.migrate()).await;
    holder.rollback().await.expect("release");
    started
        .expect("migrate does not wait for another replica's maintenance")
        .expect("migrate goes on without its maintenance");
    schema.drop().await;
}

/// A store that did not create the table (`AnyStore`, and so `idem prune`) reads how it is
/// partitioned from the table's record: the extractor's name and the retention. A custom
/// extractor is maintained by its name, but such a store claims nothing: the extractor's code
/// is the application's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_takes_the_partitioning_the_table_records() {
    let test = "a_store_takes_the_partitioning_the_table_records";
    let Some(schema) = PgSchema::create("idem_part", test).await else {
        return;
    };
    let pool = schema.pool(4).await;
    let ten_days = Retention::new(10 * DAY, 10 * DAY).expect("retention");
    let custom = PostgresStore::from_pool(pool.clone())
        .partitioned(
            Partitioning::by("order-ids", uuid_v7)
                .expect("named")
                .retention(ten_days),
        )
        .expect("partitioned");
    custom.migrate().await.expect("migrate");

    let adopted = PostgresStore::from_pool(pool.clone())
        .with_table_partitioning()
        .await
        .expect("read the record");
    let p = adopted.partitioning().expect("partitioned as recorded");
    assert_eq!(p.extractor(), "order-ids");
    assert_eq!(p.kept_for(), ten_days.prune_age());
    adopted.migrate().await.expect("migrate as recorded");
    adopted
        .maintain_partitions()
        .await
        .expect("maintain as recorded");
    let now = db_now(&adopted).await;
    let processor = Processor::builder(adopted, "billing")
        .build()
        .expect("ten days cover the default window");
    let err = processor
        .process(&msg(&uuid_at(now, 1)), async |_tx| {
            Ok::<_, idem_core::BoxError>(())
        })
        .await
        .expect_err("no extractor to claim with");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");

    let plain = PostgresStore::from_pool(pool)
        .with_table(idem_sql::TableName::new("plain_claims").expect("name"))
        .expect("table");
    plain.migrate().await.expect("migrate");
    let plain = plain.with_table_partitioning().await.expect("read");
    assert!(plain.partitioning().is_none(), "a plain table stays plain");
    schema.drop().await;
}

// The bounded layout (every table `migrate` creates): no DEFAULT partition, days attached and
// detached concurrently, so that maintenance never makes a claim wait.

/// The relations of the claims table in the test's schema: (name, bound, detach pending), and
/// whether the table has a DEFAULT partition.
async fn layout(store: &PostgresStore) -> (Vec<(String, String, bool)>, bool) {
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT c.relname::text, coalesce(pg_get_expr(c.relpartbound, c.oid), ''), \
         i.inhdetachpending FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'idem_processed'::regclass ORDER BY 1",
    )
    .fetch_all(store.pool())
    .await
    .expect("layout");
    let has_default: bool = sqlx::query_scalar(
        "SELECT partdefid <> 0 FROM pg_partitioned_table \
         WHERE partrelid = 'idem_processed'::regclass",
    )
    .fetch_one(store.pool())
    .await
    .expect("default");
    (rows, has_default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_table_is_bounded_and_its_days_are_created_ahead() {
    let Some((schema, store)) =
        setup("a_new_table_is_bounded_and_its_days_are_created_ahead").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let (rows, has_default) = layout(&store).await;
    assert!(!has_default, "no DEFAULT partition: {rows:?}");
    let names: Vec<&str> = rows.iter().map(|(n, _, _)| n.as_str()).collect();
    for ahead in 0..=2 {
        let day = Day::of(now.saturating_add(DAY * ahead)).suffix();
        assert!(
            names.contains(&format!("idem_processed_p{day}").as_str()),
            "day +{ahead}: {rows:?}"
        );
    }
    let today = Day::of(now).start();
    let default = rows
        .iter()
        .find(|(n, _, _)| n == "idem_processed_default")
        .expect("default");
    assert_eq!(
        default.1,
        format!("FOR VALUES FROM ('1') TO ('{today}')"),
        "IDs before today's partition"
    );
    // A round with nothing to do changes nothing.
    let report = store.maintain_partitions().await.expect("maintenance");
    assert_eq!(report, Default::default());
    assert_eq!(layout(&store).await.0, rows);
    schema.drop().await;
}

/// An ID of a day with no partition (a producer's clock further ahead than the days created)
/// cannot be claimed: the store says the claims table is unavailable, the handler's effect
/// rolls back, nothing is recorded — the message waits, it is not dropped — and once its day is
/// created it is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_for_a_day_without_a_partition_is_unavailable_not_dropped() {
    let Some((schema, store)) =
        setup("a_claim_for_a_day_without_a_partition_is_unavailable_not_dropped").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let p = Processor::builder(store.clone(), "billing")
        .clock(Arc::new(ManualClock::new(now)))
        .build()
        .expect("processor");
    let future = uuid_at(now.saturating_add(DAY * 10), 3);
    let err = p
        .process(&msg(&future), async |tx| {
            sqlx::query("INSERT INTO effects (id) VALUES ($1)")
                .bind(future.as_bytes())
                .execute(&mut **tx)
                .await
        })
        .await
        .expect_err("no partition for the ID's day");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("no partition"), "{err}");
    assert_eq!(count(store.pool(), "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        count(store.pool(), "SELECT count(*) FROM idem_processed").await,
        0
    );
    let created = store
        .create_partitions([Day::of(now.saturating_add(DAY * 10))])
        .await
        .expect("create the day");
    assert_eq!(created.created.len(), 1, "{created:?}");
    assert!(process(&p, &future).await, "processed once its day exists");
    assert!(!process(&p, &future).await, "then a duplicate");
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_retention_detaches_whole_days_and_every_move_keeps_deduplicating() {
    let Some((schema, store)) =
        setup("bounded_retention_detaches_whole_days_and_every_move_keeps_deduplicating").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let ago = |days: u32| now.saturating_sub(DAY * days);
    // A backfill below the default partition's bound carves every day from there up to it.
    let created = store
        .create_partitions([Day::of(ago(20))])
        .await
        .expect("backfill");
    assert_eq!(created.created.len(), 20, "{created:?}");
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

    let report = store.maintain_partitions().await.expect("maintenance");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    let due: Vec<Day> = (8..=20).rev().map(|d| Day::of(ago(d))).collect();
    assert_eq!(dropped, due, "{report:?}");
    assert_eq!(report.moved, 1, "the late claim moved out of its day");
    assert_eq!(located(&store, &late).await, vec!["idem_processed_default"]);
    let (rows, has_default) = layout(&store).await;
    assert!(!has_default);
    let first_kept = Day::of(ago(7)).start();
    assert!(
        rows.iter()
            .any(|(n, b, pending)| n == "idem_processed_default"
                && *b == format!("FOR VALUES FROM ('1') TO ('{first_kept}')")
                && !pending),
        "the default partition holds what is older than the first day kept: {rows:?}"
    );
    for id in &old {
        assert!(located(&store, id).await.is_empty(), "{id}");
    }
    for id in [&recent, &late, &undated] {
        assert!(!process(&p, id).await, "{id} must stay a duplicate");
    }
    // An ID older than every day kept lands in the default partition.
    let older = uuid_at(ago(30), 5);
    assert!(process(&p, &older).await);
    assert_eq!(
        located(&store, &older).await,
        vec!["idem_processed_default"]
    );
    schema.drop().await;
}

/// Whether the claims table has a partition `DETACH … CONCURRENTLY` left half detached.
async fn pending(store: &PostgresStore) -> Vec<String> {
    layout(store)
        .await
        .0
        .into_iter()
        .filter(|(_, _, p)| *p)
        .map(|(n, _, _)| n)
        .collect()
}

/// A long reader holds a snapshot (a report, a backup) while a prune runs: the prune waits for
/// it, claims do not. Every claim issued while the prune runs finishes within a second; the
/// prune either finishes once the reader does or, cut short by its lock timeout, leaves the
/// day half detached for the next round, which finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_never_wait_for_a_prune_behind_a_long_reader() {
    use idem_core::{ClaimStore, ConsumerName, Fingerprint, TransactionalStore};
    let Some((schema, store)) = setup("claims_never_wait_for_a_prune_behind_a_long_reader").await
    else {
        return;
    };
    claims_never_wait_for_a_prune(&schema, &store).await;
    schema.drop().await;

    async fn claims_never_wait_for_a_prune(schema: &PgSchema, store: &PostgresStore) {
        let now = db_now(store).await;
        let old = Day::of(now.saturating_sub(DAY * 20));
        store.create_partitions([old]).await.expect("backfill");
        claim_all(
            store,
            &[uuid_at(now.saturating_sub(DAY * 20), 1)],
            idem_core::Stamp::At(now.saturating_sub(DAY * 20)),
        )
        .await;
        let mut reader = schema.pool(1).await.begin().await.expect("begin");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *reader)
            .await
            .expect("repeatable read");
        sqlx::query("SELECT count(*) FROM idem_processed")
            .execute(&mut *reader)
            .await
            .expect("read");
        let prune = {
            let store = store.clone();
            tokio::spawn(async move { store.maintain_partitions().await })
        };
        let consumer = ConsumerName::new("billing").expect("consumer");
        let fp = Fingerprint::of(b"{}");
        let mut slowest = Duration::ZERO;
        for n in 0..12 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let id = uuid_at(db_now(store).await, 100 + n);
            let started = std::time::Instant::now();
            let mut tx = store.begin().await.expect("begin");
            let found = store
                .claim(&mut tx, now_claim(&consumer, &id, &fp))
                .await
                .expect("claim");
            assert_eq!(found, None);
            store.commit(tx).await.expect("commit");
            slowest = slowest.max(started.elapsed());
        }
        let still_running = !prune.is_finished();
        reader.rollback().await.expect("end the read");
        let first = prune.await.expect("task");
        assert!(
            slowest < Duration::from_secs(1),
            "a claim waited {slowest:?} for the prune"
        );
        match &first {
            Ok(report) => assert!(still_running, "the prune waited for the reader: {report:?}"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::Transient, "{e}"),
        }
        let next = store.maintain_partitions().await.expect("the next round");
        let dropped: Vec<Day> = first
            .iter()
            .chain([&next])
            .flat_map(|r| r.dropped.iter().map(|(d, _)| *d))
            .collect();
        // The backfill carved every day from the old one up to today's: those past retention go.
        let due: Vec<Day> = (8..=20)
            .rev()
            .map(|d| Day::of(now.saturating_sub(DAY * d)))
            .collect();
        assert_eq!(dropped, due, "{first:?} then {next:?}");
        assert!(pending(store).await.is_empty());
    }
}

/// A `DETACH … CONCURRENTLY` cut short (here by its lock timeout behind a reader; a lost
/// connection leaves the same state) leaves the day half detached, and a default partition
/// detached for its new bound may be left detached: the next round finishes both, keeping the
/// claims younger than the retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_detach_is_finished_by_the_next_round() {
    let Some((schema, store)) = setup("an_interrupted_detach_is_finished_by_the_next_round").await
    else {
        return;
    };
    let now = db_now(&store).await;
    let old = now.saturating_sub(DAY * 20);
    store
        .create_partitions([Day::of(old)])
        .await
        .expect("backfill");
    let late = uuid_at(old, 2);
    claim_all(&store, &[uuid_at(old, 1)], idem_core::Stamp::At(old)).await;
    claim_all(
        &store,
        std::slice::from_ref(&late),
        idem_core::Stamp::StoreClock,
    )
    .await;
    let part = format!("idem_processed_p{}", Day::of(old).suffix());

    let mut reader = schema.pool(1).await.begin().await.expect("begin");
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *reader)
        .await
        .expect("repeatable read");
    sqlx::query("SELECT count(*) FROM idem_processed")
        .execute(&mut *reader)
        .await
        .expect("read");
    let mut detacher = store.pool().acquire().await.expect("connection");
    sqlx::raw_sql("SET lock_timeout = '300ms'")
        .execute(&mut *detacher)
        .await
        .expect("timeout");
    let cut = sqlx::raw_sql(&format!(
        "ALTER TABLE idem_processed DETACH PARTITION {part} CONCURRENTLY"
    ))
    .execute(&mut *detacher)
    .await
    .expect_err("cut short behind the reader");
    assert!(cut.to_string().contains("lock timeout"), "{cut}");
    reader.rollback().await.expect("end the read");
    assert_eq!(pending(&store).await, vec![part.clone()]);
    // Its day's claims are out of reach meanwhile: a redelivery waits, it is not processed.
    let p = Processor::builder(store.clone(), "billing")
        .build()
        .expect("processor");
    let err = p
        .process(&msg(&late), async |_| Ok::<_, sqlx::Error>(()))
        .await
        .expect_err("the day is half detached");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");

    let report = store.maintain_partitions().await.expect("the next round");
    let dropped: Vec<Day> = report.dropped.iter().map(|(d, _)| *d).collect();
    assert!(dropped.contains(&Day::of(old)), "{report:?}");
    assert_eq!(report.moved, 1, "the late claim kept: {report:?}");
    assert!(pending(&store).await.is_empty());
    assert!(!process_ok(&p, &late).await, "still a duplicate");

    // The default partition detached, as a round cut between its detach and its attach leaves it.
    sqlx::raw_sql(
        "ALTER TABLE idem_processed DETACH PARTITION idem_processed_default CONCURRENTLY",
    )
    .execute(&mut *detacher)
    .await
    .expect("detach the default partition");
    // Not back to the pool with its lock timeout.
    drop(detacher.detach());
    store.maintain_partitions().await.expect("the next round");
    let (rows, _) = layout(&store).await;
    assert!(
        rows.iter().any(|(n, _, _)| n == "idem_processed_default"),
        "attached again: {rows:?}"
    );
    assert!(!process_ok(&p, &late).await, "still a duplicate");
    schema.drop().await;
}

/// [`process`] for a processor on the store's clock.
async fn process_ok(p: &Processor<PostgresStore>, id: &MessageId) -> bool {
    let outcome = p
        .process(&msg(id), async |_| Ok::<_, sqlx::Error>(()))
        .await
        .expect("process");
    matches!(outcome, Outcome::Processed(_))
}

/// A table made before the bounded layout keeps working (above), and converts in one call:
/// its DEFAULT partition becomes the range below the first day, claims of days ahead of the
/// days created (a producer's clock ahead) move into days of their own, and every claim stays a
/// duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_table_converts_to_the_bounded_layout() {
    let Some((schema, store)) = setup_legacy("a_legacy_table_converts_to_the_bounded_layout").await
    else {
        return;
    };
    let now = db_now(&store).await;
    assert!(layout(&store).await.1, "legacy: a DEFAULT partition");
    let p = Processor::builder(store.clone(), "billing")
        .clock(Arc::new(ManualClock::new(now)))
        .build()
        .expect("processor");
    let ids = [
        uuid_at(now.saturating_sub(DAY * 30), 1),
        uuid_at(now, 2),
        uuid_at(now.saturating_add(DAY * 10), 3),
        MessageId::new("order-7").expect("id"),
    ];
    for id in &ids {
        assert!(process(&p, id).await);
    }
    assert!(store.bound_partitions().await.expect("convert"));
    assert!(!store.bound_partitions().await.expect("once"));
    let (rows, has_default) = layout(&store).await;
    assert!(!has_default, "{rows:?}");
    assert_eq!(
        located(&store, &ids[2]).await,
        vec![format!(
            "idem_processed_p{}",
            Day::of(now.saturating_add(DAY * 10)).suffix()
        )]
    );
    for id in &ids {
        assert!(!process(&p, id).await, "{id} must stay a duplicate");
    }
    // And maintenance now runs the bounded rounds.
    let report = store.maintain_partitions().await.expect("maintenance");
    assert!(report.dropped.is_empty(), "{report:?}");
    schema.drop().await;
}
