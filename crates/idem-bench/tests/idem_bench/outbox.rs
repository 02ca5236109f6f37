//! The outbox scenario, test-sized, against the real PostgreSQL and NATS: `idem-bench --only
//! outbox` with 500 rows to drain, short windows and a 2-second latency run. The binary fails
//! if the relay does not drain the backlog, publishes other than every row, or a fresh batch
//! is not processed; this test asserts every part ran and no committed row went unpublished.
//! Speed is the recorded run's business (BENCHMARKS.md), not CI's.

use std::process::Command;

use idem_testkit::services::{self, service_url};

#[test]
fn outbox_scenario_drains_enqueues_and_times_every_row() {
    let test = "outbox_scenario_drains_enqueues_and_times_every_row";
    let Some(pg) = service_url(services::POSTGRES, test) else {
        return;
    };
    let Some(nats) = service_url(services::NATS, test) else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_idem-bench"))
        .args(["--postgres", &pg, "--only", "outbox", "--markdown"])
        .args(["--outbox-brokers", &nats, "--outbox-rows", "500"])
        .args(["--rounds", "1", "--seconds", "0.3", "--outbox-workers", "1"])
        .args(["--outbox-latency-seconds", "2", "--outbox-rate", "200"])
        .output()
        .expect("run idem-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{test}: idem-bench exited {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for line in [
        "### Outbox relay throughput, PostgreSQL → nats: 500 committed rows drained",
        "| `Relay`, batch 500, concurrency 64 |",
        "### Outbox enqueue cost: set batch of 100, PostgreSQL, 1 worker",
        "| idem `process_batch_set` + enqueue 1 per message |",
        "### Outbox commit → nats confirm latency",
        "0 not published by the end",
    ] {
        assert!(
            stdout.contains(line),
            "{test}: no line {line:?} in the report:\n{stdout}"
        );
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{stdout}");
}
