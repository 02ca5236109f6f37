//! `payments bench`'s bare consumer: the denominator of the end-to-end table must do the work
//! idem's leg does. Each test runs a short bench on a real broker into PostgreSQL and checks
//! that the bare consumer charged every message of its backlog exactly once, like the idem
//! leg beside it, and that the table row carries its rate.

use std::process::Command;

use idem_testkit::{service_url, services, unique_name};

const BIN: &str = env!("CARGO_BIN_EXE_payments");
const MESSAGES: usize = 300;

/// Count, distinct IDs and total amount of the charges whose message ID starts with `prefix`.
fn charges(database: &str, prefix: &str) -> (i64, i64, i64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let pool = sqlx::PgPool::connect(database)
            .await
            .expect("connect to PostgreSQL");
        let row: (i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT message_id), sum(amount_cents)::bigint
             FROM charges WHERE message_id LIKE $1",
        )
        .bind(format!("{prefix}%"))
        .fetch_one(&pool)
        .await
        .expect("query charges");
        pool.close().await;
        (row.0, row.1, row.2.unwrap_or(0))
    })
}

fn bare_consumer_charges_each_message_once(test: &str, var: &str, mode: &[&str]) {
    let Some(broker) = service_url(var, test) else {
        return;
    };
    let Some(database) = service_url(services::POSTGRES, test) else {
        return;
    };
    let source = unique_name("bench", test).replace('_', "-");
    let messages = MESSAGES.to_string();
    let child = Command::new(BIN)
        .args(["bench", "--broker", &broker, "--source", &source])
        .args(["--database", &database, "--messages", &messages])
        .args(["--concurrency", "4", "--markdown"])
        .args(mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start payments bench");
    let pid = child.id();
    let out = child.wait_with_output().expect("run payments bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with('|'))
        .unwrap_or_else(|| panic!("no table row in {stdout:?}"));
    let cols: Vec<&str> = row.split('|').map(str::trim).collect();
    let rate: f64 = cols[7]
        .parse()
        .unwrap_or_else(|_| panic!("no bare consumer rate in column 7 of {row}"));
    assert!(rate > 0.0, "{row}");
    let ratio: f64 = cols[11]
        .parse()
        .unwrap_or_else(|_| panic!("no idem ÷ bare consumer in column 11 of {row}"));
    assert!(ratio > 0.0, "{row}");

    // The backlog's amounts: 100 + i % 50 cents for message i.
    let total: i64 = (0..MESSAGES as i64).map(|i| 100 + i % 50).sum();
    let n = MESSAGES as i64;
    // The bench tags a run's message IDs `<leg>-<pid>-<nanos>-<i>`.
    assert_eq!(
        charges(&database, &format!("consumer-{pid}-")),
        (n, n, total),
        "the bare consumer charges each of its messages once"
    );
    assert_eq!(
        charges(&database, &format!("idem-{pid}-")),
        (n, n, total),
        "the idem leg beside it does the same"
    );
}

const SET: &[&str] = &["--batch", "50", "--set"];

#[test]
fn bench_bare_consumer_nats_jetstream() {
    bare_consumer_charges_each_message_once(
        "bench_bare_consumer_nats_jetstream",
        services::NATS,
        SET,
    );
}

#[test]
fn bench_bare_consumer_nats_jetstream_per_message() {
    bare_consumer_charges_each_message_once(
        "bench_bare_consumer_nats_jetstream_per_message",
        services::NATS,
        &["--batch", "1"],
    );
}

#[test]
fn bench_bare_consumer_rabbitmq_batch() {
    bare_consumer_charges_each_message_once(
        "bench_bare_consumer_rabbitmq_batch",
        services::AMQP,
        &["--batch", "50"],
    );
}

#[test]
fn bench_bare_consumer_redis_streams() {
    bare_consumer_charges_each_message_once(
        "bench_bare_consumer_redis_streams",
        services::REDIS,
        SET,
    );
}

// No Kafka test: the bench deletes its topics when done, and tansu 0.6.0's sqlite engine deletes
// every topic on one DeleteTopics call, under the feet of the Kafka tests running beside it.
