//! `idem migrate/prune/stats/reap-requests` through the real binary: happy paths on SQLite (and
//! PostgreSQL and MariaDB when configured), and every bad input giving one clear line and exit
//! code 2.

use std::path::PathBuf;
use std::process::{Command, Output};

use idem_testkit::{service_url, services, unique_name};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .expect("run idem")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Exit code 2, a single `error:` line mentioning `needle`, and no panic.
fn assert_clear_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    assert!(err.contains(needle), "expected {needle:?} in {err}");
}

fn temp_db(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique_name("idem_cli", test));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("claims.db")
}

#[test]
fn unknown_url_scheme_is_one_clear_line() {
    let o = idem(&["migrate", "--store", "ftp://example.com/db"]);
    assert_clear_error(&o, "unsupported store URL");
    assert!(
        stderr(&o).contains("postgres://"),
        "lists the supported schemes"
    );
}

#[test]
fn unreachable_postgres_and_mysql_are_one_clear_line() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let o = idem(&["stats", "--store", "postgres://postgres@127.0.0.1:1/test"]);
    assert_clear_error(&o, "Connection refused");
    let o = idem(&["stats", "--store", "mysql://root@127.0.0.1:1/test"]);
    assert_clear_error(&o, "Connection refused");
}

#[test]
fn missing_sqlite_file_is_not_created_by_stats() {
    let db = temp_db("missing_sqlite");
    let url = format!("sqlite:{}", db.display());
    let o = idem(&["stats", "--store", &url]);
    assert_clear_error(&o, "unable to open database file");
    assert!(!db.exists(), "stats must not create a database");
}

#[test]
fn passwords_are_redacted_in_errors() {
    let o = idem(&[
        "stats",
        "--store",
        "postgres://app:hunter2@127.0.0.1:1/test",
    ]);
    assert_clear_error(&o, "app:***@");
    assert!(!stderr(&o).contains("hunter2"));
}

#[test]
fn bad_table_name_and_bad_duration_are_rejected() {
    let db = temp_db("bad_inputs");
    let url = format!("sqlite:{}", db.display());
    let o = idem(&[
        "migrate",
        "--store",
        &url,
        "--table",
        "claims; DROP TABLE x",
    ]);
    assert_clear_error(&o, "invalid table name");
    let o = idem(&["prune", "--store", &url, "--older-than", "7 days"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("invalid duration"), "{}", stderr(&o));
}

#[test]
fn prune_refuses_to_cut_inside_the_redelivery_window() {
    let db = temp_db("prune_window");
    let url = format!("sqlite:{}", db.display());
    assert!(idem(&["migrate", "--store", &url]).status.success());
    let o = idem(&[
        "prune",
        "--store",
        &url,
        "--older-than",
        "1d",
        "--redelivery-window",
        "7d",
    ]);
    assert_clear_error(
        &o,
        "retention of 1d is shorter than the broker's redelivery window of 7d",
    );
}

/// migrate → claims written by the library → stats → prune, on one store URL.
async fn round_trip(url: &str, table: &str, requests: &str) {
    let migrate = ["migrate", "--store", url, "--table", table];
    let o = idem(&[&migrate[..], &["--requests-table", requests]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = idem(&[&migrate[..], &["--requests-table", requests]].concat());
    assert!(o.status.success(), "migrate twice: {}", stderr(&o));

    let o = idem(&["stats", "--store", url, "--table", table, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "[]");

    // Three claims from 2020 and one fresh, written through the store itself.
    let table_name = idem_sql::TableName::new(table).expect("valid");
    let store = idem_sql::AnyStore::connect(url, table_name)
        .await
        .expect("connect");
    insert_claims(&store).await;

    let o = idem(&["stats", "--store", url, "--table", table, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("json");
    assert_eq!(stats[0]["consumer"], "billing");
    assert_eq!(stats[0]["claims"], 4);
    assert_eq!(stats[0]["oldest"], "2020-09-13T12:26:40.000000Z");

    // No declared window: the processor's default (7d) applies, so a cut at 1ms is refused
    // instead of deleting the claim made a moment ago.
    let o = idem(&[
        "prune",
        "--store",
        url,
        "--table",
        table,
        "--older-than",
        "1ms",
    ]);
    assert_clear_error(
        &o,
        "retention of 1ms is shorter than the broker's redelivery window of 7d",
    );
    let o = idem(&["stats", "--store", url, "--table", table, "--json"]);
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("json");
    assert_eq!(stats[0]["claims"], 4, "a refused prune deleted claims");
    // A declared 1ms window still keeps the clock margin (1h by default) on top: the 2020
    // claims go, the fresh one stays.
    let o = idem(&[
        "prune",
        "--store",
        url,
        "--table",
        table,
        "--older-than",
        "1ms",
        "--redelivery-window",
        "1ms",
        "--batch",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("deleted 3 claims"), "{}", stdout(&o));
    let o = idem(&["stats", "--store", url, "--table", table, "--json"]);
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("json");
    assert_eq!(stats[0]["claims"], 1);
}

async fn insert_claims(store: &idem_sql::AnyStore) {
    use idem_core::{
        ClaimRequest, ClaimStore, ConsumerName, Fingerprint, MessageId, Stamp, Timestamp,
    };
    async fn put<S: ClaimStore>(s: &S, at: Stamp, n: u8) {
        let consumer = ConsumerName::new("billing").expect("valid");
        let mut tx = s.begin().await.expect("begin");
        let id = MessageId::new(format!("m-{n}")).expect("valid");
        let fingerprint = Fingerprint::of([n]);
        let req = ClaimRequest {
            consumer: &consumer,
            id: &id,
            fingerprint: &fingerprint,
            at,
        };
        assert_eq!(s.claim(&mut tx, req).await.expect("claim"), None);
        s.commit(tx).await.expect("commit");
    }
    let old = 1_600_000_000_000_000i64;
    for n in 0..4u8 {
        let at = if n < 3 {
            Stamp::At(Timestamp::from_micros(old + i64::from(n)))
        } else {
            Stamp::StoreClock
        };
        match store {
            idem_sql::AnyStore::Sqlite(s) => put(s, at, n).await,
            idem_sql::AnyStore::Postgres(s) => put(s, at, n).await,
            idem_sql::AnyStore::MySql(s) => put(s, at, n).await,
            _ => unreachable!("all stores are compiled into the CLI"),
        }
    }
}

#[tokio::test]
async fn sqlite_round_trip() {
    let db = temp_db("sqlite_round_trip");
    let url = format!("sqlite:{}", db.display());
    round_trip(&url, "idem_processed", "idem_requests").await;
}

#[tokio::test]
async fn postgres_round_trip() {
    let Some(url) = service_url(services::POSTGRES, "postgres_round_trip") else {
        return;
    };
    let table = unique_name("cli", "postgres_round_trip");
    let requests = unique_name("clireq", "postgres_round_trip");
    round_trip(&url, &table, &requests).await;
    drop_table(&url, &table).await;
    drop_table(&url, &requests).await;
}

#[tokio::test]
async fn mysql_round_trip() {
    let Some(url) = service_url(services::MYSQL, "mysql_round_trip") else {
        return;
    };
    let table = unique_name("cli", "mysql_round_trip");
    let requests = unique_name("clireq", "mysql_round_trip");
    round_trip(&url, &table, &requests).await;
    drop_table(&url, &table).await;
    drop_table(&url, &requests).await;
}

/// migrate → request records written by the library (two expired, one live) → reap-requests
/// in batches of one deletes the expired two and keeps the live one.
async fn reap_round_trip(url: &str, claims: &str, requests: &str) {
    use idem_core::store::RequestStore;
    use idem_core::{Begin, Fingerprint, IdempotencyKey, RequestKey, RequestScope};
    use std::time::Duration;

    async fn put<S: RequestStore>(s: &S, key: &str, ttl: Duration) {
        let k = RequestKey::new(
            RequestScope::new(["cli"]),
            IdempotencyKey::new(key).expect("valid"),
        );
        let fp = Fingerprint::of(b"body");
        let Begin::Acquired { fence, .. } =
            s.begin_request(&k, &fp, ttl, ttl).await.expect("begin")
        else {
            panic!("fresh key not acquired");
        };
        let mut tx = s.begin().await.expect("tx");
        s.complete_in(&mut tx, &k, fence, b"r", ttl)
            .await
            .expect("complete");
        s.commit(tx).await.expect("commit");
    }

    let o = idem(&[
        "migrate",
        "--store",
        url,
        "--table",
        claims,
        "--requests-table",
        requests,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let store = idem_sql::AnyStore::connect(url, idem_sql::TableName::new(claims).expect("valid"))
        .await
        .expect("connect")
        .with_requests_table(idem_sql::TableName::new(requests).expect("valid"))
        .expect("requests table");
    let (short, day) = (Duration::from_millis(1), Duration::from_secs(86_400));
    for (key, ttl) in [("expired-1", short), ("expired-2", short), ("live", day)] {
        match &store {
            idem_sql::AnyStore::Sqlite(s) => put(s, key, ttl).await,
            idem_sql::AnyStore::Postgres(s) => put(s, key, ttl).await,
            idem_sql::AnyStore::MySql(s) => put(s, key, ttl).await,
            _ => unreachable!("all stores are compiled into the CLI"),
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let reap = ["reap-requests", "--store", url, "--table", requests];
    let o = idem(&[&reap[..], &["--batch", "1"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("deleted 2 expired request records"),
        "{}",
        stdout(&o)
    );
    let o = idem(&reap);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("deleted 0 "), "{}", stdout(&o));
    let o = idem(&[&reap[..], &["--batch", "0"]].concat());
    assert_clear_error(&o, "--batch must be at least 1");
}

#[tokio::test]
async fn sqlite_reap_requests() {
    let db = temp_db("sqlite_reap_requests");
    let url = format!("sqlite:{}", db.display());
    reap_round_trip(&url, "idem_processed", "idem_requests").await;
}

#[tokio::test]
async fn postgres_reap_requests() {
    let Some(url) = service_url(services::POSTGRES, "postgres_reap_requests") else {
        return;
    };
    let claims = unique_name("cli", "postgres_reap_requests");
    let requests = unique_name("clireq", "postgres_reap_requests");
    reap_round_trip(&url, &claims, &requests).await;
    drop_table(&url, &claims).await;
    drop_table(&url, &requests).await;
}

#[tokio::test]
async fn mysql_reap_requests() {
    let Some(url) = service_url(services::MYSQL, "mysql_reap_requests") else {
        return;
    };
    let claims = unique_name("cli", "mysql_reap_requests");
    let requests = unique_name("clireq", "mysql_reap_requests");
    reap_round_trip(&url, &claims, &requests).await;
    drop_table(&url, &claims).await;
    drop_table(&url, &requests).await;
}

#[test]
fn reap_requests_rejects_bad_input_in_one_line() {
    let db = temp_db("reap_bad_inputs");
    let url = format!("sqlite:{}", db.display());
    let o = idem(&[
        "reap-requests",
        "--store",
        &url,
        "--table",
        "r; DROP TABLE x",
    ]);
    assert_clear_error(&o, "invalid table name");
    let o = idem(&["reap-requests", "--store", "ftp://example.com/db"]);
    assert_clear_error(&o, "unsupported store URL");
    // Never migrated: the table is missing, said on one line.
    assert!(idem(&["migrate", "--store", &url]).status.success());
    let o = idem(&[
        "reap-requests",
        "--store",
        &url,
        "--table",
        "no_such_requests",
    ]);
    assert_clear_error(&o, "no such table");
}

async fn drop_table(url: &str, table: &str) {
    use sqlx::Connection;
    let sql = format!("DROP TABLE IF EXISTS {table}");
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
        sqlx::query(&sql).execute(&mut c).await.expect("drop");
    } else {
        let mut c = sqlx::MySqlConnection::connect(url).await.expect("connect");
        sqlx::query(&sql).execute(&mut c).await.expect("drop");
    }
}

/// A UUIDv7 (text) made at `t`, distinct per `n`.
fn uuid_at(t: idem_core::Timestamp, n: u16) -> idem_core::MessageId {
    let ms = u64::try_from(t.as_micros() / 1000).expect("after the epoch");
    let hex = format!("{ms:012x}");
    let id = format!(
        "{}-{}-7{:03x}-8000-{:012x}",
        &hex[..8],
        &hex[8..],
        n & 0xfff,
        u64::from(n)
    );
    idem_core::MessageId::new(id).expect("id")
}

/// Issue 18's reproduction through the binary: a table partitioned by the ID's time with 50
/// claims processed 30 days ago (in their day's partition) and 50 processed now. `idem prune
/// --older-than 14d` used to delete all 100 (a row-wise delete by position on the parent hits
/// the same positions in every partition); it reads the table's partitioning and drops the old
/// day only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_prune_of_a_partitioned_table_drops_old_days_only() {
    use idem_core::{BatchClaimStore, ConsumerName, Fingerprint, Migrate, Stamp};
    use idem_core::{Timestamp, TransactionalStore};
    use idem_sql::partition::{Day, Partitioning};
    let test = "postgres_prune_of_a_partitioned_table_drops_old_days_only";
    let Some(schema) = idem_testkit::isolated::PgSchema::create("cli_part", test).await else {
        return;
    };
    let pool = schema.pool(2).await;
    let table = format!("{}.claims", schema.name());
    let store = idem_sql::PostgresStore::from_pool(pool.clone())
        .with_table(idem_sql::TableName::new(&table).expect("name"))
        .expect("table")
        .partitioned(Partitioning::uuid_v7())
        .expect("partitioned");
    store.migrate().await.expect("migrate");
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from now()) * 1000000)::bigint")
        .fetch_one(&pool)
        .await
        .expect("clock");
    let now = Timestamp::from_micros(now);
    let month_ago = now.saturating_sub(std::time::Duration::from_secs(30 * 86_400));
    store
        .create_partitions([Day::of(month_ago)])
        .await
        .expect("backfill");
    let consumer = ConsumerName::new("billing").expect("consumer");
    for (t, at) in [(month_ago, Stamp::At(month_ago)), (now, Stamp::StoreClock)] {
        let ids: Vec<_> = (0..50).map(|n| uuid_at(t, n)).collect();
        let items: Vec<_> = ids.iter().map(|id| (id, Fingerprint::of(b"{}"))).collect();
        let mut tx = store.begin().await.expect("begin");
        store
            .claim_many(&mut tx, &consumer, &items, at)
            .await
            .expect("claim");
        store.commit(tx).await.expect("commit");
    }
    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    assert_eq!(count(format!("SELECT count(*) FROM {table}")).await, 100);

    let o = idem(&[
        "prune",
        "--store",
        schema.url(),
        "--table",
        &table,
        "--older-than",
        "14d",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        // The backfill carved every day from a month ago up to today's partition (the
        // bounded layout's default partition holds one range): those past retention go.
        stdout(&o).contains("day partitions past the table's retention")
            && stdout(&o).contains(&Day::of(month_ago).to_string()),
        "{}",
        stdout(&o)
    );
    assert_eq!(count(format!("SELECT count(*) FROM {table}")).await, 50);
    let young = format!(
        "SELECT count(*) FROM {table} WHERE id_time >= {}",
        Day::of(now).start()
    );
    assert_eq!(count(young).await, 50, "every young claim kept");
    pool.close().await;
    schema.drop().await;
}
