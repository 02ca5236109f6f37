//! `idem relay`: settings and URLs refused before anything connects, and never a password in
//! what it prints.

use std::process::Command;

fn relay_error(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("relay")
        .args(args)
        .output()
        .expect("run idem");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("error: "), "{err}");
    err
}

#[test]
fn a_bad_batch_is_refused_before_connecting() {
    let err = relay_error(&[
        "--database",
        "postgres://app:hunter2@127.0.0.1:1/test",
        "--broker",
        "nats://127.0.0.1:1",
        "--batch",
        "0",
    ]);
    assert!(err.contains("relay batch 0 must be 1 to"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn an_unknown_broker_scheme_is_refused_without_its_password() {
    let err = relay_error(&[
        "--database",
        "sqlite::memory:",
        "--broker",
        "ftp://relay:hunter2@127.0.0.1:1",
    ]);
    assert!(err.contains("ftp"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn an_unreachable_broker_is_named_without_its_password() {
    let err = relay_error(&[
        "--database",
        "sqlite::memory:",
        "--broker",
        "amqp://guest:hunter2@127.0.0.1:1/%2f",
        "--poll",
        "200ms",
    ]);
    assert!(
        err.contains("connecting to the broker amqp://guest:***@127.0.0.1:1"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn a_bad_outbox_table_name_is_refused() {
    let err = relay_error(&[
        "--database",
        "sqlite::memory:",
        "--broker",
        "nats://127.0.0.1:1",
        "--outbox-table",
        "outbox; drop table x",
    ]);
    assert!(
        err.contains("invalid table name \"outbox; drop table x\""),
        "{err}"
    );
}
