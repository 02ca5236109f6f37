//! The `idem-fake-processor` binary: it starts, says where it listens, and charges once per key.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

/// Kills the process when the test ends, passed or not.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn post(addr: &str, path: &str, key: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         idempotency-key: {key}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn the_binary_charges_once_per_key() {
    let child = Command::new(env!("CARGO_BIN_EXE_idem-fake-processor"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn idem-fake-processor");
    let mut running = Running(child);
    let stdout = running.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .expect("an address")
        .to_owned();
    let body = r#"{"account":"acct_1","amount_cents":500}"#;
    let first = post(&addr, "/v1/charges", "bin-1", body);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(
        !first.to_ascii_lowercase().contains("idempotent-replayed"),
        "{first}"
    );
    let again = post(&addr, "/v1/charges", "bin-1", body);
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    assert!(
        again
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{again}"
    );
    let other = post(
        &addr,
        "/v1/charges",
        "bin-1",
        r#"{"account":"acct_1","amount_cents":7}"#,
    );
    assert!(other.starts_with("HTTP/1.1 422"), "{other}");
}
