//! The bounded chaos runs CI makes against the real services: over 200 consumer kills spread
//! over NATS, RabbitMQ, Kafka and MQTT with PostgreSQL and three consumers each, then one run
//! each with a PostgreSQL restart, a read-only failover and connection cuts at COMMIT (the last
//! with the consumers' local cache of committed claims on, `--local-cache`). Each run
//! must report no anomaly: nothing lost, nothing doubled, nothing dead-lettered, nothing left
//! on the broker, balances equal to the charges.
//!
//! They drive the `payments` binary the workspace build puts next to `idem-chaos`, with crash
//! points compiled in (idem-chaos enables idem-consumer's `crash-points` feature, which the
//! workspace build unifies); run them with `cargo test --workspace`.
//!
//! Then the two-hop runs (`--two-hop`, over 200 kills in all, on the five brokers, then on
//! SQLite and MySQL): the consumers charge and write a `PaymentCharged` event into the
//! outbox; it is relayed either in process (each kill of a
//! consumer also kills a relay) or by standalone `idem relay` processes (`--relays`, killed at
//! random too); two second-hop idem consumers record receipts and are killed like the first.
//! Exactly one charge and one receipt per payment.
//!
//! The runs are serialised (with `phases`' too): one restarts the PostgreSQL server every other
//! run uses.

use std::process::Command;
use std::sync::Mutex;

use idem_testkit::services::{self, service_url};
use serde_json::Value;

pub(crate) static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs idem-chaos with `args` against the PostgreSQL server and returns its JSON report,
/// after asserting that it found no anomaly. `None` when a service is not configured.
fn chaos(test: &str, broker_var: &str, args: &[&str]) -> Option<Value> {
    let database = service_url(services::POSTGRES, test)?;
    chaos_on(test, &database, broker_var, args)
}

/// [`chaos`] on the database `database` (a server URL, or `sqlite:`).
fn chaos_on(test: &str, database: &str, broker_var: &str, args: &[&str]) -> Option<Value> {
    let broker = service_url(broker_var, test)?;
    let broker = if broker_var == services::KAFKA {
        format!("kafka://{broker}")
    } else {
        broker
    };
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let exe = env!("CARGO_BIN_EXE_idem-chaos");
    let payments = std::path::Path::new(exe).with_file_name("payments");
    assert!(
        payments.is_file(),
        "{test}: no {} — run the workspace's tests (`cargo test --workspace`) so the payments \
         binary is built next to idem-chaos",
        payments.display()
    );
    let out = Command::new(exe)
        .args(["--broker", &broker, "--database", database])
        .args(args)
        .output()
        .expect("run idem-chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut lines = stdout.lines();
    let summary = lines.next().unwrap_or_default();
    // The summary reaches the CI log even when the test passes.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{test}: {summary}");
    let report: Value = match lines.next().map(serde_json::from_str) {
        Some(Ok(v)) => v,
        _ => panic!(
            "{test}: idem-chaos exited {} without a report\nstdout:\n{stdout}\nstderr (tail):\n{}",
            out.status,
            tail(&stderr, 60)
        ),
    };
    assert!(
        out.status.success() && report["anomalies"].as_array().is_some_and(|a| a.is_empty()),
        "{test}: {summary}\n{report:#}\nconsumer logs (tail):\n{}",
        tail(&stderr, 80)
    );
    for zero in [
        "lost",
        "duplicated",
        "unexpected",
        "dead_lettered",
        "backlog",
    ] {
        assert_eq!(report[zero], 0, "{test}: {zero} in {report:#}");
    }
    assert_eq!(report["effects"], report["unique"], "{test}: {report:#}");
    assert_eq!(report["balance_matches"], true, "{test}: {report:#}");
    Some(report)
}

pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn count(report: &Value, field: &str) -> u64 {
    report[field].as_u64().unwrap_or(0)
}

/// Kills, of which some at crash points (proof that the payments binary has them compiled in
/// and that the armed consumers reached them).
fn assert_killed(test: &str, report: &Value, kills: u64) {
    assert!(count(report, "kills") >= kills, "{test}: {report:#}");
    assert!(
        count(report, "crash_point_aborts") > 0,
        "{test}: no consumer aborted at a crash point: {report:#}"
    );
}

#[test]
fn nats_80_kills_three_consumers() {
    let test = "nats_80_kills_three_consumers";
    let args = [
        "--messages",
        "3000",
        "--kills",
        "80",
        "--consumers",
        "3",
        "--seed",
        "101",
    ];
    if let Some(r) = chaos(test, services::NATS, &args) {
        assert_killed(test, &r, 80);
    }
}

#[test]
fn rabbitmq_70_kills_three_consumers_batched() {
    let test = "rabbitmq_70_kills_three_consumers_batched";
    let args = [
        "--messages",
        "3000",
        "--kills",
        "70",
        "--consumers",
        "3",
        "--batch",
        "4",
        "--seed",
        "102",
    ];
    if let Some(r) = chaos(test, services::AMQP, &args) {
        assert_killed(test, &r, 70);
    }
}

#[test]
fn kafka_60_kills_three_consumers() {
    let test = "kafka_60_kills_three_consumers";
    // Each kill costs the group a rebalance, so a Kafka consumer processes few messages
    // between kills: armed ones abort within a few visits to be sure some do.
    let args = [
        "--messages",
        "2000",
        "--kills",
        "60",
        "--consumers",
        "3",
        "--crash-within",
        "5",
        "--seed",
        "103",
    ];
    if let Some(r) = chaos(test, services::KAFKA, &args) {
        assert_killed(test, &r, 60);
    }
}

/// MQTT: the run starts a Mosquitto of its own (Mosquitto's default cap on what a
/// disconnected session keeps would drop messages while a consumer is down); the shared
/// broker's URL only gates the test, like every real-service test's.
#[test]
fn mqtt_40_kills_three_consumers() {
    let test = "mqtt_40_kills_three_consumers";
    let args = [
        "--messages",
        "2000",
        "--kills",
        "40",
        "--consumers",
        "3",
        "--seed",
        "107",
    ];
    if let Some(r) = chaos(test, services::MQTT, &args) {
        assert_killed(test, &r, 40);
    }
}

#[test]
fn postgres_restart_mid_run() {
    let test = "postgres_restart_mid_run";
    let args = [
        "--messages",
        "2000",
        "--kills",
        "10",
        "--restart-database",
        "1",
        "--seed",
        "104",
    ];
    if let Some(r) = chaos(test, services::NATS, &args) {
        assert_eq!(count(&r, "database_restarts"), 1, "{test}: {r:#}");
    }
}

#[test]
fn read_only_failover_mid_run() {
    let test = "read_only_failover_mid_run";
    let args = [
        "--messages",
        "2000",
        "--kills",
        "10",
        "--failover",
        "1",
        "--failover-for",
        "4s",
        "--seed",
        "105",
    ];
    if let Some(r) = chaos(test, services::AMQP, &args) {
        assert_eq!(count(&r, "failovers"), 1, "{test}: {r:#}");
    }
}

#[test]
fn connections_cut_around_commit() {
    let test = "connections_cut_around_commit";
    let args = [
        "--messages",
        "3000",
        "--kills",
        "10",
        "--cut-connections",
        "--cut-share",
        "0.05",
        "--min-fault-time",
        "6s",
        // The consumers' local cache of committed claims on: a commit whose connection was
        // cut has an unknown outcome and must never be cached; the ledger proves it was not.
        "--local-cache",
        "--seed",
        "106",
    ];
    if let Some(r) = chaos(test, services::REDIS, &args) {
        assert!(count(&r, "cuts_before_commit") > 0, "{test}: {r:#}");
        assert!(count(&r, "cuts_after_commit") > 0, "{test}: {r:#}");
    }
}

/// A two-hop run on `database` (PostgreSQL's when `None`): `chaos` with `--two-hop`, then one
/// receipt per payment, the kills asked, and kills on each kind of process the run has.
fn two_hop(test: &str, database: Option<&str>, broker_var: &str, kills: u64, extra: &[&str]) {
    let kills_arg = kills.to_string();
    let mut args = vec![
        "--two-hop",
        "--messages",
        "1000",
        "--kills",
        kills_arg.as_str(),
        "--consumers",
        "3",
        "--receipt-consumers",
        "2",
    ];
    args.extend_from_slice(extra);
    let report = match database {
        Some(db) => chaos_on(test, db, broker_var, &args),
        None => chaos(test, broker_var, &args),
    };
    let Some(r) = report else { return };
    assert_killed(test, &r, kills);
    assert_eq!(r["receipts"], r["unique"], "{test}: {r:#}");
    for zero in [
        "receipts_lost",
        "receipts_duplicated",
        "receipts_unexpected",
    ] {
        assert_eq!(r[zero], 0, "{test}: {zero} in {r:#}");
    }
    // Both hops were killed, and the relays when they ran apart.
    assert!(count(&r, "consumer_kills") > 0, "{test}: {r:#}");
    assert!(count(&r, "receipt_consumer_kills") > 0, "{test}: {r:#}");
    if count(&r, "relays") > 0 {
        assert!(count(&r, "relay_kills") > 0, "{test}: {r:#}");
    }
    // Some of the aborts at the relay's own crash points (around the publish and the mark),
    // in process or in `idem relay`. Not asked of Kafka, whose few aborts per run (each kill
    // costs a rebalance) may all land on the consumers' points.
    let relay_aborts: u64 = r["aborts_at"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(point, _)| point.starts_with("relay-"))
        .filter_map(|(_, n)| n.as_u64())
        .sum();
    assert!(
        relay_aborts > 0 || test.starts_with("kafka_"),
        "{test}: no abort at a relay crash point: {r:#}"
    );
}

#[test]
fn nats_two_hop_60_kills() {
    two_hop(
        "nats_two_hop_60_kills",
        None,
        services::NATS,
        60,
        &["--seed", "111"],
    );
}

#[test]
fn rabbitmq_two_hop_60_kills_relay_processes() {
    two_hop(
        "rabbitmq_two_hop_60_kills_relay_processes",
        None,
        services::AMQP,
        60,
        &["--relays", "2", "--seed", "112"],
    );
}

#[test]
fn redis_two_hop_60_kills_relay_processes() {
    two_hop(
        "redis_two_hop_60_kills_relay_processes",
        None,
        services::REDIS,
        60,
        &["--relays", "2", "--seed", "113"],
    );
}

/// On a Mosquitto of the run's own (see `mqtt_40_kills_three_consumers`); each consumer A
/// relays in process, so its kills land around the outbox commit, the publish and the mark.
#[test]
fn mqtt_two_hop_60_kills() {
    two_hop(
        "mqtt_two_hop_60_kills",
        None,
        services::MQTT,
        60,
        &["--seed", "117"],
    );
}

/// Named `kafka_…` so scripts/test runs it in the Kafka lane.
#[test]
fn kafka_two_hop_25_kills() {
    two_hop(
        "kafka_two_hop_25_kills",
        None,
        services::KAFKA,
        25,
        &["--crash-within", "5", "--seed", "114"],
    );
}

/// SQLite: one file every process shares (the harness's, in its work folder).
#[test]
fn sqlite_two_hop_25_kills() {
    two_hop(
        "sqlite_two_hop_25_kills",
        Some("sqlite:"),
        services::NATS,
        25,
        &["--relays", "1", "--seed", "115"],
    );
}

#[test]
fn mysql_two_hop_25_kills() {
    let test = "mysql_two_hop_25_kills";
    let Some(mysql) = service_url(services::MYSQL, test) else {
        return;
    };
    two_hop(
        test,
        Some(&mysql),
        services::REDIS,
        25,
        &["--relays", "2", "--seed", "116"],
    );
}
