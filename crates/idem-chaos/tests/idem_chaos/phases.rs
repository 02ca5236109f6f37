//! The bounded `--phases` runs CI makes: operations of recovery points that charge idem's
//! fake card processor, on SQLite, PostgreSQL and MySQL, over 100 kills in all — SIGKILLs at
//! random and aborts at the phase driver's crash points (phase-returned: the processor
//! charged, nothing recorded; point-committed; response-committed: not answered yet). Each
//! run must find one processor charge and one charge row (with the processor's ID) per
//! operation, every record finished or abandoned, none stuck.
//!
//! `http_*`: three `http-payments --card-processor` servers behind clients that retry every
//! operation with the same Idempotency-Key (idem-client) until it is answered, but a tenth of
//! them, which give up after a failed first attempt: the servers' completers finish those.
//!
//! `consumer_*`: three `payments --card-processor` consumers behind the broker's redelivery
//! (NATS, Redis Streams, RabbitMQ), armed at the consumer's crash points as well, with the
//! one-hop ledger's check besides (nothing lost, doubled, dead-lettered, left on the broker).
//!
//! And the run that shows the checker can fail: the same HTTP run with a proxy that gives
//! each processor call a random key (a service whose foreign key changes between attempts)
//! must report doubled charges.
//!
//! They drive the binaries the workspace build puts next to `idem-chaos`, with crash points
//! compiled in; run them with `cargo test --workspace`.

use std::process::Command;

use idem_testkit::services::{self, service_url};
use serde_json::Value;

use super::chaos::{ONE_AT_A_TIME, tail};

/// Runs `idem-chaos --phases <service>` on `database` with `args`; its exit status and JSON
/// report. `service` is `http` (http-payments) or `consumer` (payments).
fn phases_run(test: &str, service: &str, database: &str, args: &[&str]) -> (bool, Value) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let exe = env!("CARGO_BIN_EXE_idem-chaos");
    let binary = match service {
        "http" => "http-payments",
        _ => "payments",
    };
    let server = std::path::Path::new(exe).with_file_name(binary);
    assert!(
        server.is_file(),
        "{test}: no {} — run the workspace's tests (`cargo test --workspace`) so the \
         {binary} binary is built next to idem-chaos",
        server.display()
    );
    let out = Command::new(exe)
        .args(["--phases", service, "--database", database])
        .args(args)
        .output()
        .expect("run idem-chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut lines = stdout.lines();
    let summary = lines.next().unwrap_or_default();
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{test}: {summary}");
    match lines.next().map(serde_json::from_str::<Value>) {
        Some(Ok(report)) => (out.status.success(), report),
        _ => panic!(
            "{test}: idem-chaos exited {} without a report\nstdout:\n{stdout}\nstderr (tail):\n{}",
            out.status,
            tail(&stderr, 60)
        ),
    }
}

fn count(v: &Value, field: &str) -> u64 {
    v[field].as_u64().unwrap_or(0)
}

/// An HTTP run that must prove the point: [`proven`], with every client answered.
fn proves(test: &str, database: &str, kills: u64, seed: &str) {
    let kills_arg = kills.to_string();
    let args = [
        "--messages",
        "300",
        "--servers",
        "3",
        "--clients",
        "6",
        "--kills",
        kills_arg.as_str(),
        "--kill-every",
        "250ms",
        "--crash-within",
        "12",
        "--spare-armed-for",
        "3s",
        "--give-up-share",
        "0.1",
        "--seed",
        seed,
    ];
    let (ok, r) = phases_run(test, "http", database, &args);
    proven(test, ok, &r, 300, kills);
    // Every client retried to an answer (its charge, or that the service gave it up), but
    // those that gave up: the servers' completers finished what they left.
    let p = &r["phases"];
    assert_eq!(
        count(p, "answered") + count(p, "answered_abandoned") + count(p, "given_up"),
        300,
        "{test}: {r:#}"
    );
    assert!(count(p, "given_up") > 0, "{test}: no client gave up: {r:#}");
}

/// A consumer run that must prove the point: [`proven`], and the one-hop ledger's figures
/// (nothing lost, doubled, dead-lettered or left on the broker).
fn consumer_proves(test: &str, database: &str, broker_var: &str, kills: u64, seed: &str) {
    let Some(broker) = service_url(broker_var, test) else {
        return;
    };
    let kills_arg = kills.to_string();
    let args = [
        "--broker",
        broker.as_str(),
        "--messages",
        "300",
        "--consumers",
        "3",
        "--kills",
        kills_arg.as_str(),
        "--kill-every",
        "300ms",
        "--crash-within",
        "12",
        "--spare-armed-for",
        "3s",
        "--redeliver-after",
        "2s",
        "--seed",
        seed,
    ];
    let (ok, r) = phases_run(test, "consumer", database, &args);
    proven(test, ok, &r, 300, kills);
    for zero in ["lost", "duplicated", "dead_lettered", "backlog"] {
        assert_eq!(r[zero], 0, "{test}: {zero} in {r:#}");
    }
}

/// What every proving run must show: no anomaly, one processor charge and one charge row per
/// operation, every record ended, kills as asked with some at the phase driver's crash points.
fn proven(test: &str, ok: bool, r: &Value, operations: u64, kills: u64) {
    let p = &r["phases"];
    assert!(
        ok && r["anomalies"].as_array().is_some_and(|a| a.is_empty()),
        "{test}: {r:#}"
    );
    for zero in [
        "doubled_effects",
        "doubled_rows",
        "rows_without_processor_charge",
        "answered_without_effect",
        "answers_mismatched",
        "unexpected",
        "stuck",
        "wrong_endings",
        "unanswered",
    ] {
        assert_eq!(p[zero], 0, "{test}: {zero} in {r:#}");
    }
    // Every operation ended: finished, charged once and recorded once; or (rarely, after as
    // many takeovers as the completer allows) given up, charged at most once, not recorded.
    assert_eq!(
        count(p, "finished")
            + count(p, "abandoned")
            + count(p, "in_progress_without_point")
            + count(p, "not_started"),
        operations,
        "{test}: {r:#}"
    );
    // Only a client that gave up leaves an operation unended (and then nothing happened).
    assert!(
        count(p, "in_progress_without_point") + count(p, "not_started") <= count(p, "given_up"),
        "{test}: {r:#}"
    );
    assert_eq!(
        count(p, "charge_rows"),
        count(p, "finished"),
        "{test}: {r:#}"
    );
    assert_eq!(
        count(p, "processor_effects"),
        count(p, "charge_rows") + count(p, "charged_unrecorded"),
        "{test}: {r:#}"
    );
    assert!(count(r, "kills") >= kills, "{test}: {r:#}");
    assert!(
        count(r, "crash_point_aborts") > 0,
        "{test}: no server aborted at a crash point (built without crash points?): {r:#}"
    );
}

#[test]
fn phases_http_sqlite_35_kills() {
    proves("phases_http_sqlite_35_kills", "sqlite:", 35, "301");
}

#[test]
fn phases_http_postgres_35_kills() {
    let test = "phases_http_postgres_35_kills";
    if let Some(pg) = service_url(services::POSTGRES, test) {
        proves(test, &pg, 35, "302");
    }
}

#[test]
fn phases_http_mysql_35_kills() {
    let test = "phases_http_mysql_35_kills";
    if let Some(mysql) = service_url(services::MYSQL, test) {
        proves(test, &mysql, 35, "303");
    }
}

#[test]
fn phases_consumer_sqlite_nats_25_kills() {
    consumer_proves(
        "phases_consumer_sqlite_nats_25_kills",
        "sqlite:",
        services::NATS,
        25,
        "311",
    );
}

#[test]
fn phases_consumer_postgres_redis_25_kills() {
    let test = "phases_consumer_postgres_redis_25_kills";
    if let Some(pg) = service_url(services::POSTGRES, test) {
        consumer_proves(test, &pg, services::REDIS, 25, "312");
    }
}

#[test]
fn phases_consumer_mysql_rabbitmq_25_kills() {
    let test = "phases_consumer_mysql_rabbitmq_25_kills";
    if let Some(mysql) = service_url(services::MYSQL, test) {
        consumer_proves(test, &mysql, services::AMQP, 25, "313");
    }
}

/// The checker catches a double: with the foreign key random per call, a charge repeated
/// after a crash at phase-returned (the processor charged, nothing recorded) or after a lost
/// answer lands a second time, and the run must say so and fail.
#[test]
fn phases_http_scrambled_foreign_keys_are_caught_doubling() {
    let test = "phases_http_scrambled_foreign_keys_are_caught_doubling";
    let args = [
        "--messages",
        "150",
        "--servers",
        "2",
        "--kills",
        "15",
        "--kill-every",
        "250ms",
        "--crash-share",
        "1",
        "--crash-within",
        "6",
        "--scramble-foreign-keys",
        "--seed",
        "304",
    ];
    let (ok, r) = phases_run(test, "http", "sqlite:", &args);
    assert!(!ok, "{test}: a run with scrambled keys passed: {r:#}");
    assert!(
        count(&r["phases"], "doubled_effects") > 0,
        "{test}: no doubled charge found: {r:#}"
    );
    assert!(
        r["anomalies"].as_array().is_some_and(|a| a.iter().any(|s| s
            .as_str()
            .is_some_and(|s| s.contains("processor charges doubled")))),
        "{test}: {r:#}"
    );
}
