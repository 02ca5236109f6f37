//! A store that is up but refusing: an outage (read-only, as after a failover) is waited out in
//! place — loudly, without spending attempts, never dead-lettered — and a misconfiguration (the
//! claims table missing) stops the consumer with a clear error. In-memory fake broker; real
//! SQLite files and, for the failover, the real PostgreSQL server in `IDEM_TEST_POSTGRES_URL`.
//! Its own test binary: the metrics recorder is process-wide.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_consumer::{
    CancellationToken, Consumer, Handler, InMemoryBroker, Json, RetryPolicy, RunStats,
};
use idem_core::{BoxError, ErrorKind, Message, Migrate, Processor};
use idem_sql::{PostgresStore, PostgresTx, SqliteOptions, SqliteStore, TableName, Tx};
use idem_testkit::{service_url, services, unique_name};

use crate::recorder::recorder;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

#[derive(Debug, serde::Deserialize)]
struct Ping {
    n: i64,
}

/// Writes one `pings` row per message.
struct Record;

impl Handler<Tx<sqlx::Sqlite>, Ping> for Record {
    type Output = ();
    async fn handle(&self, tx: &mut Tx<sqlx::Sqlite>, msg: &Message<Ping>) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO pings (n) VALUES (?)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl Handler<PostgresTx, Ping> for Record {
    type Output = ();
    async fn handle(&self, tx: &mut PostgresTx, msg: &Message<Ping>) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO pings (n) VALUES ($1)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Three attempts a message, quickly: an outage lasting longer would exhaust them many times.
fn quick() -> RetryPolicy {
    RetryPolicy::exponential(3, Duration::from_millis(5), Duration::from_millis(50))
}

/// The `idem_store_unavailable` gauge of `consumer`.
fn unavailable_gauge(consumer: &str) -> String {
    let text = recorder().render();
    let needle = format!(r#"consumer="{consumer}""#);
    text.lines()
        .find(|l| l.starts_with("idem_store_unavailable{") && l.contains(&needle))
        .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
        .unwrap_or_else(|| panic!("no idem_store_unavailable for {consumer} in\n{text}"))
}

fn publish(broker: &InMemoryBroker, n: i64) {
    for i in 0..n {
        let id = format!("m-{i}");
        broker.publish(&[("message-id", id.as_bytes())], format!(r#"{{"n":{i}}}"#));
    }
}

async fn sqlite_store(path: &std::path::Path) -> SqliteStore {
    let store = SqliteStore::open(path, SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE IF NOT EXISTS pings (n INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    store
}

#[tokio::test]
async fn a_read_only_database_waits_in_place_then_processes_everything_once() {
    recorder();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("ro.db");
    sqlite_store(&path).await.pool().close().await;
    let read_only = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(SqliteConnectOptions::new().filename(&path).read_only(true))
        .await
        .expect("open read-only");
    let consumer_name = "read-only-sqlite";
    let processor = Arc::new(
        Processor::builder(SqliteStore::from_pool(read_only), consumer_name)
            .build()
            .expect("p"),
    );
    let broker = InMemoryBroker::new();
    publish(&broker, 5);
    let stop = CancellationToken::new();
    let consumer = Consumer::new(processor, broker.source())
        .concurrency(4)
        .retry(quick());
    let observer = consumer.observer();
    let run = tokio::spawn(consumer.run(Json::<Ping>::new(), Record, stop.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = observer.snapshot();
    assert_eq!(
        unavailable_gauge(consumer_name),
        "1",
        "gauge during the outage"
    );
    stop.cancel();
    let stats = run.await.expect("task").expect("an outage is not fatal");
    assert_eq!(
        during.store_outages, 1,
        "one outage, reported once: {during:?}"
    );
    assert!(
        during.retries > 3 * 5,
        "the messages outlived their 3 attempts each: {during:?}"
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(stats.processed, 0, "{stats:?}");
    assert!(broker.settled().is_empty(), "{:?}", broker.settled());
    assert_eq!(broker.pending(), 5, "every message waits for the database");
    assert_eq!(unavailable_gauge(consumer_name), "0", "gauge after the run");

    // Writable again: every waiting message is processed, once.
    let store = sqlite_store(&path).await;
    let processor = Arc::new(
        Processor::builder(store.clone(), consumer_name)
            .build()
            .expect("p"),
    );
    broker.close();
    let stats = Consumer::new(processor, broker.source())
        .retry(quick())
        .run(Json::<Ping>::new(), Record, CancellationToken::new())
        .await
        .expect("run");
    assert_eq!((stats.processed, stats.dead_lettered), (5, 0), "{stats:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(DISTINCT n) FROM pings")
        .fetch_one(store.pool())
        .await
        .expect("rows");
    assert_eq!(rows, 5);
}

#[tokio::test]
async fn a_missing_claims_table_stops_the_consumer_without_dead_letters() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = sqlite_store(&dir.path().join("m.db"))
        .await
        .with_table(TableName::new("claims_never_migrated").expect("name"))
        .expect("plain name");
    let processor = Arc::new(Processor::builder(store, "unmigrated").build().expect("p"));
    let broker = InMemoryBroker::new();
    publish(&broker, 3);
    let err = Consumer::new(processor, broker.source())
        .retry(quick())
        .run(Json::<Ping>::new(), Record, CancellationToken::new())
        .await
        .expect_err("a consumer on a missing table must stop");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("claims_never_migrated"), "{err}");
    assert!(broker.settled().is_empty(), "{:?}", broker.settled());
    assert_eq!(broker.pending(), 3, "nothing was lost or dead-lettered");
}

/// A failover as the consumer sees it: its role's sessions turn read-only (SQLSTATE 25006, a
/// standby), then the sessions are cut and new ones are writable (the promoted primary).
#[tokio::test]
async fn a_postgres_failover_loses_nothing_and_dead_letters_nothing() {
    let test = "a_postgres_failover_loses_nothing_and_dead_letters_nothing";
    let Some(url) = service_url(services::POSTGRES, test) else {
        return;
    };
    recorder();
    let schema = unique_name("fo", test);
    let role = unique_name("fo", "role");
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect to IDEM_TEST_POSTGRES_URL");
    for sql in [
        format!("CREATE SCHEMA {schema}"),
        format!("CREATE TABLE {schema}.pings (n bigint NOT NULL)"),
        format!("CREATE ROLE {role} LOGIN SUPERUSER"),
        format!("ALTER ROLE {role} SET default_transaction_read_only = on"),
    ] {
        sqlx::query(&sql).execute(&admin).await.expect("setup");
    }
    let options = PgConnectOptions::from_str(&url)
        .expect("url")
        .options([("search_path", schema.as_str())]);
    let owner = PostgresStore::from_pool(
        PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .expect("connect"),
    );
    owner.migrate().await.expect("migrate");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.username(&role))
        .await
        .expect("connect as the consumer's role");
    let processor = Arc::new(
        Processor::builder(PostgresStore::from_pool(pool), test)
            .build()
            .expect("p"),
    );
    let broker = InMemoryBroker::new();
    publish(&broker, 20);
    let stop = CancellationToken::new();
    let consumer = Consumer::new(processor, broker.source())
        .concurrency(4)
        .retry(quick());
    let observer = consumer.observer();
    let run = tokio::spawn(consumer.run(Json::<Ping>::new(), Record, stop.clone()));

    // Before the fix every message was dead-lettered within 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during: RunStats = observer.snapshot();
    assert_eq!(
        (during.processed, during.dead_lettered),
        (0, 0),
        "{during:?}"
    );
    assert!(during.store_outages >= 1, "{during:?}");
    assert_eq!(unavailable_gauge(test), "1");

    for sql in [
        format!("ALTER ROLE {role} RESET default_transaction_read_only"),
        format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"),
    ] {
        sqlx::query(&sql).execute(&admin).await.expect("promote");
    }
    // The promotion terminates the consumer's connections, possibly inside a COMMIT that went
    // through: that message's outcome is unknown to the consumer, it runs again and is found a
    // duplicate (its effect is in once). So a message is handled when it was processed or found
    // a duplicate; the rows below say each effect happened once. (Waiting for 20 processed
    // timed out in CI under load: processed 19, duplicates 1.)
    let promoted = Instant::now();
    let handled = |s: &RunStats| s.processed + s.duplicates;
    while handled(&observer.snapshot()) < 20 {
        assert!(
            promoted.elapsed() < Duration::from_secs(30),
            "timed out waiting for every message after the failover: {:?}, {} pending on the broker",
            observer.snapshot(),
            broker.pending()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!((handled(&stats), stats.dead_lettered), (20, 0), "{stats:?}");
    let (rows, distinct): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT n) FROM {schema}.pings"
    ))
    .fetch_one(&admin)
    .await
    .expect("rows");
    assert_eq!((rows, distinct), (20, 20), "one effect per message");
    assert_eq!(unavailable_gauge(test), "0");

    owner.pool().close().await;
    let _ = sqlx::query(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .execute(&admin)
    .await;
    let _ = sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await;
    let _ = sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await;
}

// ---- errors that belong to one message, not to the store ------------------------------------

/// A message as the tests below publish it.
fn publish_one(broker: &InMemoryBroker, id: &str, n: i64) {
    broker.publish(&[("message-id", id.as_bytes())], format!(r#"{{"n":{n}}}"#));
}

/// How the in-memory broker settled the message published as `id` (its payload is `{"n":N}`,
/// so the tests find it by `n`).
fn settled_n(broker: &InMemoryBroker, n: i64) -> Vec<idem_consumer::Settled> {
    let payload = format!(r#"{{"n":{n}}}"#);
    broker
        .settled()
        .into_iter()
        .filter(|(_, p, _)| p.as_slice() == payload.as_bytes())
        .map(|(_, _, s)| s)
        .collect()
}

/// The dead-letter reason of a settlement, if it was one.
fn reason(settled: &idem_consumer::Settled) -> Option<&str> {
    match settled {
        idem_consumer::Settled::DeadLettered(headers) => headers
            .iter()
            .find(|(name, _)| *name == idem_consumer::REASON_HEADER)
            .map(|(_, v)| v.as_str()),
        idem_consumer::Settled::Acked => None,
    }
}

/// Writes one `pings` row per message; the message with a negative `n` terminates its own
/// database session first, as a statement that gets its backend killed (out of memory, a
/// crash) does.
struct KillsItsSession;

impl Handler<PostgresTx, Ping> for KillsItsSession {
    type Output = ();
    async fn handle(&self, tx: &mut PostgresTx, msg: &Message<Ping>) -> Result<(), BoxError> {
        if msg.payload().n < 0 {
            sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                .execute(&mut **tx)
                .await?;
        }
        sqlx::query("INSERT INTO pings (n) VALUES ($1)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Runs `consumer` to the end of its (closed) broker, failing the test instead of hanging if
/// it waits for ever.
async fn run_to_end<F>(what: &str, run: F) -> Result<RunStats, idem_core::Error>
where
    F: std::future::Future<Output = Result<RunStats, idem_core::Error>>,
{
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap_or_else(|_| panic!("{what}: the consumer was still waiting after 60 s"))
}

/// Issue 18, point 4: a message whose statements end their own database session (here
/// `pg_terminate_backend(pg_backend_pid())`, in production an out-of-memory kill) used to be
/// an outage for ever — waited out in place, never an attempt spent, the queue behind it stuck.
/// The database answers a probe right after, so it is the message's: it spends its attempts and
/// is dead-lettered as `connection-lost`, and the next message is processed.
#[tokio::test]
async fn a_message_that_kills_its_session_is_dead_lettered_and_the_next_one_runs() {
    let test = "a_message_that_kills_its_session_is_dead_lettered_and_the_next_one_runs";
    let Some(schema) = idem_testkit::isolated::PgSchema::create("kill", test).await else {
        return;
    };
    let store = PostgresStore::from_pool(schema.pool(4).await);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n bigint NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    for batch in [1, 4] {
        let processor = Arc::new(
            Processor::builder(store.clone(), format!("kills-{batch}"))
                .build()
                .expect("p"),
        );
        let broker = InMemoryBroker::new();
        publish_one(&broker, "killer", -batch);
        publish_one(&broker, "healthy-1", 10 * batch);
        publish_one(&broker, "healthy-2", 10 * batch + 1);
        broker.close();
        let consumer = Consumer::new(processor, broker.source()).retry(quick());
        let stats = if batch > 1 {
            let run = consumer.batch(batch as usize).run(
                Json::<Ping>::new(),
                KillsItsSession,
                CancellationToken::new(),
            );
            run_to_end(test, run).await
        } else {
            let run = consumer.run(
                Json::<Ping>::new(),
                KillsItsSession,
                CancellationToken::new(),
            );
            run_to_end(test, run).await
        }
        .expect("a message's lost connection does not stop the consumer");
        assert_eq!(
            (stats.processed, stats.dead_lettered),
            (2, 1),
            "batch {batch}: {stats:?}"
        );
        let killer = settled_n(&broker, -batch);
        assert_eq!(killer.len(), 1, "batch {batch}: {killer:?}");
        assert_eq!(reason(&killer[0]), Some("connection-lost"), "{killer:?}");
        let idem_consumer::Settled::DeadLettered(headers) = &killer[0] else {
            unreachable!()
        };
        assert!(
            headers.contains(&(idem_consumer::ATTEMPTS_HEADER, "3".to_owned())),
            "after its 3 attempts: {headers:?}"
        );
        for n in [10 * batch, 10 * batch + 1] {
            assert_eq!(
                settled_n(&broker, n),
                vec![idem_consumer::Settled::Acked],
                "batch {batch}"
            );
        }
    }
    let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM pings ORDER BY n")
        .fetch_all(store.pool())
        .await
        .expect("rows");
    assert_eq!(rows, vec![10, 11, 40, 41], "the killer wrote nothing");
    store.pool().close().await;
    schema.drop().await;
}

/// Writes `n` into `ledger`, which a row-level-security policy keeps non-negative.
struct Ledger;

impl Handler<PostgresTx, Ping> for Ledger {
    type Output = ();
    async fn handle(&self, tx: &mut PostgresTx, msg: &Message<Ping>) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO ledger (n) VALUES ($1)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Issue 18, point 6: SQLSTATE 42501 raised by the handler's own statement — here a
/// row-level-security `WITH CHECK` refusing one row — used to be `Misconfigured` and stop the
/// consumer (and every replica the message was redelivered to). It says something about this
/// message only: retried, then dead-lettered; the next message is processed; the run goes on.
#[tokio::test]
async fn a_row_level_security_refusal_dead_letters_its_message_and_the_consumer_goes_on() {
    let test = "a_row_level_security_refusal_dead_letters_its_message_and_the_consumer_goes_on";
    let Some(schema) = idem_testkit::isolated::PgSchema::create("rls", test).await else {
        return;
    };
    // Superusers bypass row-level security: the consumer runs as a role of its own, which owns
    // the schema (and so migrates it) and is held to the policy by FORCE.
    let role = unique_name("rls", "role");
    let admin = schema.pool(1).await;
    for sql in [
        format!("CREATE ROLE {role} LOGIN NOSUPERUSER NOBYPASSRLS"),
        format!("ALTER SCHEMA {} OWNER TO {role}", schema.name()),
    ] {
        sqlx::query(&sql).execute(&admin).await.expect("role");
    }
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(schema.options().username(&role))
        .await
        .expect("connect as the role");
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    for sql in [
        "CREATE TABLE ledger (n bigint NOT NULL)",
        "ALTER TABLE ledger ENABLE ROW LEVEL SECURITY",
        "ALTER TABLE ledger FORCE ROW LEVEL SECURITY",
        "CREATE POLICY non_negative ON ledger USING (true) WITH CHECK (n >= 0)",
    ] {
        sqlx::query(sql).execute(store.pool()).await.expect(sql);
    }
    let processor = Arc::new(Processor::builder(store.clone(), test).build().expect("p"));
    let broker = InMemoryBroker::new();
    publish_one(&broker, "m-1", 1);
    publish_one(&broker, "m-refused", -1);
    publish_one(&broker, "m-2", 2);
    broker.close();
    let run = Consumer::new(processor, broker.source())
        .retry(quick())
        .run(Json::<Ping>::new(), Ledger, CancellationToken::new());
    let stats = run_to_end(test, run)
        .await
        .expect("a refused row does not stop the consumer");
    assert_eq!((stats.processed, stats.dead_lettered), (2, 1), "{stats:?}");
    let refused = settled_n(&broker, -1);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        reason(&refused[0]),
        Some("retries-exhausted"),
        "{refused:?}"
    );
    let idem_consumer::Settled::DeadLettered(headers) = &refused[0] else {
        unreachable!()
    };
    assert!(
        headers
            .iter()
            .any(|(_, v)| v.contains("row-level security")),
        "the detail says why: {headers:?}"
    );
    let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM ledger ORDER BY n")
        .fetch_all(store.pool())
        .await
        .expect("rows");
    assert_eq!(rows, vec![1, 2]);

    store.pool().close().await;
    schema.drop().await;
    let _ = sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await;
}

/// The other side of point 6: idem's own claims table gone (dropped after the migration, as a
/// botched deployment would) is still a misconfiguration: the consumer stops with
/// `Misconfigured` and dead-letters nothing.
#[tokio::test]
async fn idem_s_own_table_dropped_after_migrate_stops_the_consumer_without_dead_letters() {
    let test = "idem_s_own_table_dropped_after_migrate_stops_the_consumer_without_dead_letters";
    let Some(schema) = idem_testkit::isolated::PgSchema::create("gone", test).await else {
        return;
    };
    let store = PostgresStore::from_pool(schema.pool(2).await);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n bigint NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    sqlx::query("DROP TABLE idem_processed")
        .execute(store.pool())
        .await
        .expect("drop idem's table");
    let processor = Arc::new(Processor::builder(store.clone(), test).build().expect("p"));
    let broker = InMemoryBroker::new();
    publish(&broker, 3);
    broker.close();
    let run = Consumer::new(processor, broker.source())
        .retry(quick())
        .run(Json::<Ping>::new(), Record, CancellationToken::new());
    let err = run_to_end(test, run)
        .await
        .expect_err("a consumer whose claims table is gone must stop");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    assert!(err.to_string().contains("idem_processed"), "{err}");
    assert!(broker.settled().is_empty(), "{:?}", broker.settled());
    assert_eq!(broker.pending(), 3, "nothing was lost or dead-lettered");
    store.pool().close().await;
    schema.drop().await;
}

/// Inserts into a table named after the message: `missing` for the message with `n` = -1.
struct WritesNamedTable;

impl Handler<idem_sql::MySqlTx, Ping> for WritesNamedTable {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut idem_sql::MySqlTx,
        msg: &Message<Ping>,
    ) -> Result<(), BoxError> {
        let table = if msg.payload().n < 0 {
            "missing"
        } else {
            "pings"
        };
        sqlx::query(&format!("INSERT INTO {table} (n) VALUES (?)"))
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Point 6 on MySQL: a table missing under the handler's own statement (error 1146, as after an
/// application migration that swapped it) is that message's failure, not the fleet's:
/// dead-lettered after its attempts, and the consumer goes on.
#[tokio::test]
async fn a_table_missing_under_the_handler_on_mysql_dead_letters_only_its_message() {
    let test = "a_table_missing_under_the_handler_on_mysql_dead_letters_only_its_message";
    let Some(db) = idem_testkit::isolated::MySqlDatabase::create("miss", test).await else {
        return;
    };
    let store = idem_sql::MySqlStore::from_pool(db.pool(2).await);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n BIGINT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    let processor = Arc::new(Processor::builder(store.clone(), test).build().expect("p"));
    let broker = InMemoryBroker::new();
    publish_one(&broker, "m-1", 1);
    publish_one(&broker, "m-missing", -1);
    publish_one(&broker, "m-2", 2);
    broker.close();
    let run = Consumer::new(processor, broker.source())
        .retry(quick())
        .run(
            Json::<Ping>::new(),
            WritesNamedTable,
            CancellationToken::new(),
        );
    let stats = run_to_end(test, run)
        .await
        .expect("a table missing under one message does not stop the consumer");
    assert_eq!((stats.processed, stats.dead_lettered), (2, 1), "{stats:?}");
    let missing = settled_n(&broker, -1);
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert_eq!(
        reason(&missing[0]),
        Some("retries-exhausted"),
        "{missing:?}"
    );
    let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM pings ORDER BY n")
        .fetch_all(store.pool())
        .await
        .expect("rows");
    assert_eq!(rows, vec![1, 2]);
    store.pool().close().await;
    db.drop().await;
}
