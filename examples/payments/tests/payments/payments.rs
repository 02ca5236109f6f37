//! The payments service as its README runs it: the real binary against each real broker and a
//! SQLite file, messages published with its own `publish` command, stopped with SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idem_testkit::{service_url, services, unique_name};

const BIN: &str = env!("CARGO_BIN_EXE_payments");

pub(super) struct Service {
    child: Child,
    lines: mpsc::Receiver<String>,
    pub(super) log: Vec<String>,
}

impl Service {
    pub(super) fn start(args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            // Per-message outcomes are logged at debug (info is for starts, stops and outages).
            .env("RUST_LOG", "info,idem_consumer=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start payments");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            // Bytes, decoded lossily: one line that is not UTF-8 must not end the reading.
            let mut reader = BufReader::new(stderr);
            let mut line = Vec::new();
            while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&line).trim_end().to_owned();
                line.clear();
                if tx.send(text).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// Waits until `count` log lines contain `needle`.
    pub(super) fn wait_for(&mut self, needle: &str, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log.iter().filter(|l| l.contains(needle)).count() >= count {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(200)))
            {
                Ok(line) => self.log.push(line),
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => return false,
            }
        }
    }

    /// SIGKILL (a crash: nothing is cleaned up), then waits for the exit.
    pub(super) fn kill(&mut self) {
        self.child.kill().expect("kill");
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status and the whole log.
    pub(super) fn terminate(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        let status = self.child.wait().expect("wait");
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
            self.log.push(line);
        }
        (status, self.log)
    }
}

pub(super) fn publish(broker: &str, source: &str, id: &str, payload: &str) -> String {
    let out = Command::new(BIN)
        .args([
            "publish", "--broker", broker, "--source", source, "--id", id, payload,
        ])
        .output()
        .expect("run publish");
    assert!(
        out.status.success(),
        "publish failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Removes what the service created on the broker for `source` (streams, queues, topics,
/// sessions, dead letters), so shared brokers do not fill up run after run.
pub(super) fn teardown(broker: &str, source: &str, consumer: &str, instance: &str) {
    if broker.starts_with("kafka://") {
        // tansu 0.6.0's sqlite engine deletes every topic on one DeleteTopics call, under the
        // feet of the tests running beside this one: Kafka topics carry unique names and stay.
        return;
    }
    let out = Command::new(BIN)
        .args(["teardown", "--broker", broker, "--source", source])
        .args(["--consumer", consumer, "--instance", instance])
        .output()
        .expect("run teardown");
    assert!(
        out.status.success(),
        "teardown failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Rows of a two-column query as `a|b` lines, read straight from the service's SQLite file.
fn query(db: &std::path::Path, sql: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let url = format!("sqlite:{}", db.display());
        let pool = sqlx::SqlitePool::connect(&url)
            .await
            .expect("open the service's database");
        let rows: Vec<(String, i64)> = sqlx::query_as(sql).fetch_all(&pool).await.expect("query");
        pool.close().await;
        rows.iter()
            .map(|(a, b)| format!("{a}|{b}"))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Charges once per ID; a redelivery is a duplicate; a conflicting payload, undecodable JSON
/// and an invalid amount are dead-lettered; SIGTERM exits 0 after the in-flight work.
fn charges_exactly_once(test: &str, var: &str, to_url: impl Fn(String) -> String) {
    let Some(url) = service_url(var, test) else {
        return;
    };
    let broker = to_url(url);
    let source = unique_name("pay", test).replace('_', "-");
    let dir = std::env::temp_dir().join(&source);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let db = dir.join("payments.db");
    let database = format!("sqlite:{}", db.display());
    let instance = format!("{source}-1");

    // A consumer (group) of its own: a Kafka group shared with another run's topic would
    // rebalance under it.
    let mut svc = Service::start(&[
        "--broker",
        &broker,
        "--source",
        &source,
        "--database",
        &database,
        "--consumer",
        &source,
        "--instance",
        &instance,
    ]);
    assert!(
        svc.wait_for("consumer started", 1, Duration::from_secs(30)),
        "service starts: {:?}",
        svc.log
    );

    publish(
        &broker,
        &source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    // The service runs 4 messages at once: let the original commit first, or the conflicting
    // copy may win the claim (correctly, but not what this test describes).
    assert!(
        svc.wait_for("outcome=", 1, Duration::from_secs(60)),
        "first message settles: {:?}",
        svc.log
    );
    let second = publish(
        &broker,
        &source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    let conflict = publish(
        &broker,
        &source,
        "pay-1",
        r#"{"account":"alice","amount_cents":999}"#,
    );
    publish(&broker, &source, "pay-2", "not json");
    publish(
        &broker,
        &source,
        "pay-3",
        r#"{"account":"bob","amount_cents":-5}"#,
    );
    publish(
        &broker,
        &source,
        "pay-4",
        r#"{"account":"bob","amount_cents":300}"#,
    );

    // JetStream drops a repeated Nats-Msg-Id at publish time (its duplicate window), so on NATS
    // the repeat and the conflict never reach the consumer; everywhere else they must.
    let dropped_at_publish = second.contains("note:") && conflict.contains("note:");
    let (outcomes, dead) = if dropped_at_publish { (4, 2) } else { (6, 3) };
    let settled = svc.wait_for("outcome=", outcomes, Duration::from_secs(60));
    let (status, log) = svc.terminate();
    assert!(settled, "all messages settled: {log:#?}");
    assert!(status.success(), "exits 0 on SIGTERM: {status:?} {log:#?}");
    let count = |needle: &str| log.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count(r#"outcome="processed""#), 2, "{log:#?}");
    assert_eq!(count(r#"outcome="dead_lettered""#), dead, "{log:#?}");
    if !dropped_at_publish {
        assert_eq!(count(r#"outcome="duplicate""#), 1, "{log:#?}");
        assert_eq!(count("reason=conflict"), 1, "{log:#?}");
    }
    assert_eq!(count("reason=undecodable"), 1, "{log:#?}");
    assert_eq!(count("reason=rejected"), 1, "{log:#?}");
    assert!(
        log.iter().any(|l| l.contains("consumer stopped")),
        "{log:#?}"
    );

    assert_eq!(
        query(
            &db,
            "SELECT message_id, amount_cents FROM charges ORDER BY message_id"
        ),
        "pay-1|1250\npay-4|300"
    );
    assert_eq!(
        query(
            &db,
            "SELECT account, balance_cents FROM accounts ORDER BY account"
        ),
        "alice|1250\nbob|300"
    );
    teardown(&broker, &source, &source, &instance);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two hops, as the README runs them: `payments --emit` charges and relays a `PaymentCharged`
/// event per charge from its outbox; `payments --receipts` records each event once. A repeated
/// payment makes no second event, and each receipt carries the payment's ID and an event ID
/// derived from it (the same on every resend).
fn two_hops_exactly_once(test: &str, var: &str, to_url: impl Fn(String) -> String) {
    let Some(url) = service_url(var, test) else {
        return;
    };
    let broker = to_url(url);
    let source = unique_name("hop", test).replace('_', "-");
    let charged = format!("{source}-charged");
    let dir = std::env::temp_dir().join(&source);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (first_db, second_db) = (dir.join("payments.db"), dir.join("receipts.db"));
    let first_url = format!("sqlite:{}", first_db.display());
    let second_url = format!("sqlite:{}", second_db.display());

    // The second hop first: its source exists before the relay publishes (an MQTT broker drops
    // a message nobody subscribes to).
    let mut receipts = Service::start(&[
        "--receipts",
        "--broker",
        &broker,
        "--source",
        &charged,
        "--database",
        &second_url,
        "--consumer",
        &format!("{source}-receipts"),
        "--instance",
        &format!("{source}-r"),
    ]);
    assert!(
        receipts.wait_for("consumer started", 1, Duration::from_secs(30)),
        "receipts start: {:?}",
        receipts.log
    );
    // Consumer names of their own: a Kafka group shared with another test's topic rebalances
    // under it.
    let mut payments = Service::start(&[
        "--emit",
        &charged,
        "--broker",
        &broker,
        "--source",
        &source,
        "--database",
        &first_url,
        "--consumer",
        &source,
        "--instance",
        &format!("{source}-p"),
    ]);
    assert!(
        payments.wait_for("consumer started", 1, Duration::from_secs(30)),
        "payments start: {:?}",
        payments.log
    );
    publish(
        &broker,
        &source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    publish(
        &broker,
        &source,
        "pay-2",
        r#"{"account":"bob","amount_cents":300}"#,
    );
    publish(
        &broker,
        &source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    let recorded = receipts.wait_for(r#"outcome="processed""#, 2, Duration::from_secs(60));
    let (p_status, p_log) = payments.terminate();
    let (r_status, r_log) = receipts.terminate();
    assert!(recorded, "two receipts: {r_log:#?}\n{p_log:#?}");
    assert!(
        p_status.success() && r_status.success(),
        "{p_log:#?}\n{r_log:#?}"
    );
    assert_eq!(
        query(
            &second_db,
            "SELECT payment_id, amount_cents FROM receipts ORDER BY payment_id"
        ),
        "pay-1|1250\npay-2|300",
        "{r_log:#?}"
    );
    // The event IDs: derived, distinct, and what the outbox holds (each row marked sent).
    let events = query(
        &second_db,
        "SELECT event_id, count(*) FROM receipts GROUP BY event_id ORDER BY event_id",
    );
    let outbox = query(
        &first_db,
        "SELECT CAST(message_id AS TEXT), count(sent_at) FROM idem_outbox GROUP BY 1 ORDER BY 1",
    );
    assert_eq!(events.lines().count(), 2, "{events}");
    assert_eq!(
        events, outbox,
        "receipts' event IDs are the outbox's, each sent once"
    );
    teardown(&broker, &source, &source, &format!("{source}-p"));
    teardown(
        &broker,
        &charged,
        &format!("{source}-receipts"),
        &format!("{source}-r"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_hops_nats_jetstream() {
    two_hops_exactly_once("two_hops_nats_jetstream", services::NATS, |u| u);
}

#[test]
fn two_hops_rabbitmq() {
    two_hops_exactly_once("two_hops_rabbitmq", services::AMQP, |u| u);
}

#[test]
fn two_hops_kafka() {
    two_hops_exactly_once("two_hops_kafka", services::KAFKA, |hosts| {
        format!("kafka://{hosts}")
    });
}

#[test]
fn two_hops_redis_streams() {
    two_hops_exactly_once("two_hops_redis_streams", services::REDIS, |u| u);
}

#[test]
fn two_hops_mqtt() {
    two_hops_exactly_once("two_hops_mqtt", services::MQTT, |u| u);
}

#[test]
fn nats_jetstream() {
    charges_exactly_once("nats_jetstream", services::NATS, |u| u);
}

#[test]
fn rabbitmq() {
    charges_exactly_once("rabbitmq", services::AMQP, |u| u);
}

#[test]
fn kafka() {
    charges_exactly_once("kafka", services::KAFKA, |hosts| format!("kafka://{hosts}"));
}

#[test]
fn redis_streams() {
    charges_exactly_once("redis_streams", services::REDIS, |u| u);
}

#[test]
fn mqtt() {
    charges_exactly_once("mqtt", services::MQTT, |u| u);
}

#[test]
fn bad_broker_and_database_urls_are_one_line_errors() {
    for args in [
        &["--broker", "foo://x"][..],
        &["--broker", "kafka://"][..],
        &[
            "--broker",
            "redis://127.0.0.1:6379",
            "--database",
            "oracle://x",
        ][..],
    ] {
        let out = Command::new(BIN).args(args).output().expect("run");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: ") && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}
