//! Where the real services are, and the rule for when they are not configured.
//!
//! Unset variable: print `SKIPPING <test>: <VAR> not set` and let the test pass, so a plain
//! `cargo test` works on a laptop. With `IDEM_TEST_REQUIRE_SERVICES=1` (CI), unset is a failure.

/// PostgreSQL URL variable.
pub const POSTGRES: &str = "IDEM_TEST_POSTGRES_URL";
/// MySQL / MariaDB URL variable.
pub const MYSQL: &str = "IDEM_TEST_MYSQL_URL";
/// Redis URL variable.
pub const REDIS: &str = "IDEM_TEST_REDIS_URL";
/// NATS URL variable.
pub const NATS: &str = "IDEM_TEST_NATS_URL";
/// AMQP (RabbitMQ) URL variable.
pub const AMQP: &str = "IDEM_TEST_AMQP_URL";
/// Kafka bootstrap brokers variable.
pub const KAFKA: &str = "IDEM_TEST_KAFKA_BROKERS";
/// MQTT URL variable.
pub const MQTT: &str = "IDEM_TEST_MQTT_URL";
/// Set to `1` to turn a missing service variable into a test failure.
pub const REQUIRE: &str = "IDEM_TEST_REQUIRE_SERVICES";

/// The service URL in `var`, or `None` after printing why `test` is skipped.
///
/// # Panics
/// When `var` is unset and `IDEM_TEST_REQUIRE_SERVICES=1`: in CI a skipped real-service test
/// would hide a broken setup.
pub fn service_url(var: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ if std::env::var(REQUIRE).as_deref() == Ok("1") => {
            panic!("{test}: {var} is not set but {REQUIRE}=1; real-service tests must run")
        }
        _ => {
            // Straight to the stderr handle: libtest captures `eprintln!` of passing tests, and
            // a skip nobody sees is a silent skip.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPING {test}: {var} not set");
            None
        }
    }
}

/// A name unique to this test and process, usable as a table or stream name:
/// `<prefix>_<test>_<pid>_<n>`, lowercase, `[a-z0-9_]`, at most 48 bytes.
pub fn unique_name(prefix: &str, test: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let suffix = format!("_{}_{n}_{}", std::process::id(), nanos % 100_000);
    let test: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let room = 48usize.saturating_sub(prefix.len() + 1 + suffix.len());
    let test = &test[..test.len().min(room)];
    format!("{prefix}_{test}{suffix}")
}
