//! `idem complete` through the real binary on SQLite (and PostgreSQL and MariaDB when
//! configured): a stuck operation of phases (its
//! second phase failed, its first committed) is listed, released while it has attempts left,
//! given up with the `--result` every retry then replays; and the command without an action
//! says resuming is the application's completer.

use std::process::{Command, Output};
use std::time::Duration;

use idem_core::store::RecoveryStore;
use idem_core::{BoxError, IdempotencyKey, Migrate, RequestScope, TableName};
use idem_request::{Idempotency, PhaseCtx, Step};
use idem_sql::{SqliteOptions, SqliteStore};
use idem_testkit::{service_url, services, unique_name};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .expect("run idem")
}

fn out(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[derive(serde::Serialize, serde::Deserialize)]
enum Phase {
    Reserve,
    Charge,
}

async fn step<S: RecoveryStore + Clone + 'static>(
    phase: Phase,
    _: &mut PhaseCtx<S>,
) -> Result<Step<Phase, String>, BoxError> {
    match phase {
        Phase::Reserve => Ok(Step::Next(Phase::Charge)),
        Phase::Charge => Err("the processor refuses".into()),
    }
}

async fn run<S: RecoveryStore + Clone + Send + Sync + 'static>(
    store: &S,
) -> Result<String, idem_core::Error> {
    let key = IdempotencyKey::new("cli-order-1").expect("key");
    Idempotency::builder(store.clone())
        .lease(Duration::from_millis(200))
        .without_heartbeat()
        .build()
        .expect("idempotency")
        .run_phases(
            RequestScope::new(["order"]),
            &key,
            &(),
            Phase::Reserve,
            step::<S>,
        )
        .await
}

/// The round trip on `store` (migrated, its requests table `table`), reached by the binary
/// at `url`.
async fn round_trip<S: RecoveryStore + Clone + Send + Sync + 'static>(
    store: S,
    url: &str,
    table: &str,
) {
    assert!(
        run(&store).await.is_err(),
        "Charge fails: the operation is stuck"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cli = |extra: &[&str]| {
        let mut args = vec!["complete", "--store", url, "--table", table];
        args.extend_from_slice(extra);
        idem(&args)
    };

    let (stdout, stderr) = out(&cli(&["--list"]));
    assert!(
        stdout.contains("cli-order-1") && stdout.contains("Charge"),
        "{stdout}{stderr}"
    );
    assert!(stdout.contains("1 stuck operations"), "{stdout}");

    // One execution so far: fewer than 2, released for the application's completer.
    let o = cli(&["--abandon-after", "2", "--result", "\"gave up\""]);
    let (stdout, stderr) = out(&o);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stdout.contains("gave up 0") && stdout.contains("released 1"),
        "{stdout}"
    );
    // That takeover was the second: now it is given up.
    let o = cli(&["--abandon-after", "2", "--result", "\"gave up\""]);
    let (stdout, stderr) = out(&o);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stdout.contains("gave up 1") && stdout.contains("released 0"),
        "{stdout}"
    );

    // `--database` is the same option as `--store`.
    let (stdout, _) = out(&idem(&[
        "complete",
        "--database",
        url,
        "--table",
        table,
        "--list",
    ]));
    assert!(stdout.contains("0 stuck operations"), "{stdout}");
    let replay = run(&store).await.expect("replays the stored result");
    assert_eq!(replay, "gave up");

    let o = cli(&[]);
    let (_, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Completer"), "{stderr}");
    let o = cli(&["--abandon-after", "1", "--result", "not json"]);
    assert_eq!(o.status.code(), Some(2));
}

#[tokio::test]
async fn complete_lists_releases_and_gives_up_a_stuck_operation_on_sqlite() {
    let dir = std::env::temp_dir().join(unique_name("idem_cli", "complete"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let db = dir.join("app.db");
    let store = SqliteStore::open(&db, SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    round_trip(
        store,
        &format!("sqlite:{}", db.display()),
        idem_sql::DEFAULT_REQUESTS_TABLE,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Names of its own for the three tables `migrate` creates on a shared server.
fn tables(test: &str) -> [String; 3] {
    ["cmpc", "cmpr", "cmpo"].map(|p| unique_name(p, test))
}

async fn drop_tables(url: &str, tables: &[String; 3]) {
    use sqlx::Connection;
    for t in tables {
        let sql = format!("DROP TABLE IF EXISTS {t}");
        if url.starts_with("postgres") {
            let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
            sqlx::query(&sql).execute(&mut c).await.expect("drop");
        } else {
            let mut c = sqlx::MySqlConnection::connect(url).await.expect("connect");
            sqlx::query(&sql).execute(&mut c).await.expect("drop");
        }
    }
}

fn name(t: &str) -> TableName {
    TableName::new(t).expect("table name")
}

#[tokio::test]
async fn complete_round_trip_on_postgres() {
    let Some(url) = service_url(services::POSTGRES, "complete_round_trip_on_postgres") else {
        return;
    };
    let t = tables("complete_pg");
    let store = idem_sql::PostgresStore::connect(&url)
        .await
        .expect("connect")
        .with_table(name(&t[0]))
        .and_then(|s| s.with_requests_table(name(&t[1])))
        .and_then(|s| s.with_outbox_table(name(&t[2])))
        .expect("tables");
    store.migrate().await.expect("migrate");
    round_trip(store, &url, &t[1]).await;
    drop_tables(&url, &t).await;
}

#[tokio::test]
async fn complete_round_trip_on_mysql() {
    let Some(url) = service_url(services::MYSQL, "complete_round_trip_on_mysql") else {
        return;
    };
    let t = tables("complete_my");
    let store = idem_sql::MySqlStore::connect(&url)
        .await
        .expect("connect")
        .with_table(name(&t[0]))
        .and_then(|s| s.with_requests_table(name(&t[1])))
        .and_then(|s| s.with_outbox_table(name(&t[2])))
        .expect("tables");
    store.migrate().await.expect("migrate");
    round_trip(store, &url, &t[1]).await;
    drop_tables(&url, &t).await;
}

#[test]
fn complete_keeps_a_password_out_of_its_errors() {
    let o = idem(&[
        "complete",
        "--store",
        "postgres://app:s3cret-pw@127.0.0.1:1/test",
        "--list",
    ]);
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        !stderr.contains("s3cret-pw") && !stdout.contains("s3cret-pw"),
        "{stderr}"
    );
}
