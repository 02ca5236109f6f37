//! The prune scenario, test-sized, against the real PostgreSQL: `idem-bench --only prune` on
//! 20 000 claims with one-second windows. The binary checks what pruning must do and fails if
//! it did not (the old half gone — row by row on the plain table, by whole days on the
//! partitioned one —, the young half and every claim the consumer made still there, a
//! redelivered young ID a duplicate); this test asserts it ran both tables and passed those
//! checks on all three tables (plain, legacy and bounded partitioned). Speed is the recorded run's business (BENCHMARKS.md), not CI's.

use std::process::Command;

use idem_testkit::services::{self, service_url};

#[test]
fn prune_under_load_removes_the_old_half_and_keeps_the_rest() {
    let test = "prune_under_load_removes_the_old_half_and_keeps_the_rest";
    let Some(url) = service_url(services::POSTGRES, test) else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_idem-bench"))
        .args(["--postgres", &url, "--only", "prune", "--markdown"])
        .args([
            "--claims",
            "20000",
            "--seconds",
            "1",
            "--prune-workers",
            "4",
        ])
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
        "| plain | before |",
        "| plain | during |",
        "| plain | after |",
        "| partitioned | before |",
        "| partitioned | during |",
        "| partitioned | after |",
        "- plain: after: no claim older than the prune age; all ",
        "- plain: sample: ",
        "- plain: redelivery: 4 filled IDs younger than the prune age, processed again, are \
         `Duplicate`",
        "| legacy | during |",
        "- legacy: after: no claim of a day wholly past the retention, and no such day's \
         partition; all ",
        "- partitioned: fill: 20,000 claims in ",
        "- partitioned: after: no claim of a day wholly past the retention, and no such day's \
         partition; all ",
        "- partitioned: sample: ",
        "- partitioned: redelivery: 4 filled IDs younger than the prune age, processed again, \
         are `Duplicate`",
    ] {
        assert!(
            stdout.contains(line),
            "{test}: no line {line:?} in the report:\n{stdout}"
        );
    }
    // The report reaches the CI log even when the test passes.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{stdout}");
}
