//! `idem demo` end to end: the real binary, a real SQLite file, and the ledger checked with
//! SQL afterwards rather than trusting the report.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A database path of its own for each test, removed (with its WAL files) on drop.
struct TempDb {
    dir: PathBuf,
}

impl TempDb {
    fn new(name: &str) -> std::io::Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-demo-test-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    fn path(&self) -> PathBuf {
        self.dir.join("demo.db")
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn idem(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output()
}

/// Runs `idem demo --json` with `args` on `db` and parses its one JSON object.
fn demo_json(db: &Path, args: &[&str]) -> Result<Value, Box<dyn std::error::Error>> {
    let db = db.to_str().ok_or("temp path is not UTF-8")?;
    let mut all = vec!["demo", "--json", "--db", db];
    all.extend_from_slice(args);
    let out = idem(&all)?;
    let stdout = String::from_utf8(out.stdout)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "idem {all:?} failed ({}):\n{stderr}\n{stdout}",
        out.status
    );
    Ok(serde_json::from_str(stdout.trim())?)
}

fn field(report: &Value, name: &str) -> Result<u64, String> {
    report[name]
        .as_u64()
        .ok_or_else(|| format!("report has no integer {name:?}: {report}"))
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// (charges, distinct message IDs charged), straight from the file.
fn ledger_counts(db: &Path) -> Result<(i64, i64), Box<dyn std::error::Error>> {
    runtime()?.block_on(async {
        let mut conn = SqliteConnectOptions::new()
            .filename(db)
            .read_only(true)
            .connect()
            .await?;
        let counts: (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM charges")
                .fetch_one(&mut conn)
                .await?;
        conn.close().await?;
        Ok(counts)
    })
}

#[test]
fn idem_charges_every_payment_exactly_once() -> TestResult {
    let db = TempDb::new("idem")?;
    let report = demo_json(
        &db.path(),
        &["--messages", "300", "--workers", "4", "--seed", "7"],
    )?;
    assert_eq!(report["mode"], "idem");
    assert_eq!(field(&report, "messages")?, 300);
    assert_eq!(field(&report, "double_charges")?, 0, "{report}");
    assert_eq!(field(&report, "lost")?, 0, "{report}");
    assert_eq!(field(&report, "charges")?, 300, "{report}");
    assert!(field(&report, "deliveries")? > 300, "{report}");
    assert!(field(&report, "duplicates_skipped")? > 0, "{report}");
    assert_eq!(report["balances_match"], true, "{report}");

    let (charges, distinct) = ledger_counts(&db.path())?;
    assert_eq!(charges - distinct, 0, "double charges in the ledger");
    assert_eq!(distinct, 300);
    Ok(())
}

#[test]
fn a_rerun_on_the_same_file_starts_clean() -> TestResult {
    let db = TempDb::new("rerun")?;
    let args = ["--messages", "50", "--seed", "3"];
    demo_json(&db.path(), &args)?;
    // Same IDs again: last run's claims and charges must not leak into this one.
    let report = demo_json(&db.path(), &args)?;
    assert_eq!(field(&report, "charges")?, 50, "{report}");
    assert_eq!(field(&report, "lost")?, 0, "{report}");
    Ok(())
}

#[test]
fn naive_consumer_double_charges_on_the_same_traffic() -> TestResult {
    let db = TempDb::new("naive")?;
    let report = demo_json(
        &db.path(),
        &[
            "--naive",
            "--messages",
            "300",
            "--workers",
            "4",
            "--seed",
            "7",
            "--crash-rate",
            "0.2",
        ],
    )?;
    assert_eq!(report["mode"], "naive");
    // Every crash after the charge's commit leaves the message unmarked; its redelivery passes
    // the check and charges again. At 0.2 over 300 messages that is dozens of double charges.
    assert!(field(&report, "simulated_crashes")? > 0, "{report}");
    assert!(field(&report, "double_charges")? > 0, "{report}");
    assert_eq!(report["exactly_once"], false, "{report}");

    let (charges, distinct) = ledger_counts(&db.path())?;
    assert!(charges > distinct, "the ledger shows no double charge");
    assert_eq!(
        u64::try_from(charges - distinct)?,
        field(&report, "double_charges")?
    );
    Ok(())
}

#[test]
fn bad_flags_are_refused_with_exit_code_2() -> TestResult {
    let db = TempDb::new("flags")?;
    let db = db.path();
    let db = db.to_str().ok_or("temp path is not UTF-8")?;
    for bad in [
        &["--crash-rate", "1.5"][..],
        &["--duplicate-rate", "-0.1"],
        &["--crash-rate", "NaN"],
        &["--workers", "0"],
        &["--messages", "0"],
    ] {
        let mut args = vec!["demo", "--db", db];
        args.extend_from_slice(bad);
        let out = idem(&args)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.starts_with("error:"), "{bad:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{bad:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{bad:?} printed a report");
    }
    Ok(())
}
