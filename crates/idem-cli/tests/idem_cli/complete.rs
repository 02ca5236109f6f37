//! `idem complete` through the real binary on SQLite: a stuck operation of phases (its
//! second phase failed, its first committed) is listed, released while it has attempts left,
//! given up with the `--result` every retry then replays; and the command without an action
//! says resuming is the application's completer.

use std::process::{Command, Output};
use std::time::Duration;

use idem_core::{BoxError, IdempotencyKey, Migrate, RequestScope};
use idem_request::{Idempotency, PhaseCtx, Step};
use idem_sql::{SqliteOptions, SqliteStore};
use idem_testkit::unique_name;

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

async fn step(
    phase: Phase,
    _: &mut PhaseCtx<SqliteStore>,
) -> Result<Step<Phase, String>, BoxError> {
    match phase {
        Phase::Reserve => Ok(Step::Next(Phase::Charge)),
        Phase::Charge => Err("the processor refuses".into()),
    }
}

fn engine(store: &SqliteStore) -> Idempotency<SqliteStore> {
    Idempotency::builder(store.clone())
        .lease(Duration::from_millis(200))
        .without_heartbeat()
        .build()
        .expect("idempotency")
}

async fn run(store: &SqliteStore) -> Result<String, idem_core::Error> {
    let key = IdempotencyKey::new("cli-order-1").expect("key");
    engine(store)
        .run_phases(
            RequestScope::new(["order"]),
            &key,
            &(),
            Phase::Reserve,
            step,
        )
        .await
}

#[test]
fn complete_lists_releases_and_gives_up_a_stuck_operation() {
    let dir = std::env::temp_dir().join(unique_name("idem_cli", "complete"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let db = dir.join("app.db");
    let url = format!("sqlite:{}", db.display());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = rt.block_on(async {
        let store = SqliteStore::open(&db, SqliteOptions::default())
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        assert!(
            run(&store).await.is_err(),
            "Charge fails: the operation is stuck"
        );
        store
    });
    std::thread::sleep(Duration::from_millis(300));

    let (stdout, stderr) = out(&idem(&["complete", "--store", &url, "--list"]));
    assert!(
        stdout.contains("cli-order-1") && stdout.contains("Charge"),
        "{stdout}{stderr}"
    );
    assert!(stdout.contains("1 stuck operations"), "{stdout}");

    // One execution so far: fewer than 2, released for the application's completer.
    let o = idem(&[
        "complete",
        "--store",
        &url,
        "--abandon-after",
        "2",
        "--result",
        "\"gave up\"",
    ]);
    let (stdout, stderr) = out(&o);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stdout.contains("gave up 0") && stdout.contains("released 1"),
        "{stdout}"
    );
    // That takeover was the second: now it is given up.
    let o = idem(&[
        "complete",
        "--store",
        &url,
        "--abandon-after",
        "2",
        "--result",
        "\"gave up\"",
    ]);
    let (stdout, stderr) = out(&o);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stdout.contains("gave up 1") && stdout.contains("released 0"),
        "{stdout}"
    );

    let (stdout, _) = out(&idem(&["complete", "--store", &url, "--list"]));
    assert!(stdout.contains("0 stuck operations"), "{stdout}");
    let replay = rt.block_on(run(&store)).expect("replays the stored result");
    assert_eq!(replay, "gave up");

    let o = idem(&["complete", "--store", &url]);
    let (_, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Completer"), "{stderr}");
    let o = idem(&[
        "complete",
        "--store",
        &url,
        "--abandon-after",
        "1",
        "--result",
        "not json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
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
