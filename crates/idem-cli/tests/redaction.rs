//! Connection URLs in `idem`'s errors go through `idem_redact::redact_url`: a password is never
//! printed, wherever the URL carries it.

use std::process::Command;

/// Runs `idem stats --store url`, expecting the one-line error of an unreachable server.
fn stats_error(url: &str) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["stats", "--store", url])
        .output()
        .expect("run idem");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

#[test]
fn password_in_the_query_is_redacted() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let err = stats_error("postgres://app@127.0.0.1:1/test?password=hunter2&sslmode=disable");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        err.contains("postgres://app@127.0.0.1:1/test?password=***&sslmode=disable"),
        "{err}"
    );
}

#[test]
fn at_sign_in_a_query_value_does_not_hide_the_host() {
    let err = stats_error("postgres://app:hunter2@127.0.0.1:1/test?application_name=svc@prod");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        err.contains("postgres://app:***@127.0.0.1:1/test?application_name=svc@prod"),
        "{err}"
    );
}

#[test]
fn unsupported_scheme_with_credentials_is_redacted() {
    let err = stats_error("oracle://app:hunter2@db/pay?token=hunter2");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.contains("unsupported store URL"), "{err}");
}
