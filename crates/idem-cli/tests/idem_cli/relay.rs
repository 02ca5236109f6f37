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
fn a_pipeline_past_its_bound_is_refused_before_connecting() {
    let err = relay_error(&[
        "--database",
        "postgres://app:hunter2@127.0.0.1:1/test",
        "--broker",
        "nats://127.0.0.1:1",
        "--pipeline",
        "17",
    ]);
    assert!(err.contains("pipeline 17"), "{err}");
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

/// `idem relay --database sqlite:FILE --broker redis://…` publishes what a handler committed to
/// the file's outbox, with the derived ID where idem's consumers read it, marks the rows sent,
/// and stops on SIGTERM.
#[test]
fn relays_a_sqlite_outbox_to_redis_streams_until_sigterm() {
    use std::time::{Duration, Instant};

    use idem_any::{BrokerUrl, SourceSpec, WithSource};
    use idem_consumer::{Delivery, Source};
    use idem_core::outbox::{Emitter, OutboxStore};
    use idem_core::{ConsumerName, MessageId, Migrate, TransactionalStore};
    use idem_sql::{SqliteOptions, SqliteStore};

    let test = "relays_a_sqlite_outbox_to_redis_streams_until_sigterm";
    let Some(redis) = idem_testkit::service_url(idem_testkit::services::REDIS, test) else {
        return;
    };
    let stream = idem_testkit::unique_name("cli_relay", "stream");
    let dir = std::env::temp_dir().join(&stream);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let db = dir.join("outbox.db");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let sent = rt.block_on(async {
        let store = SqliteStore::open(&db, SqliteOptions::default())
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        let mut emitter = Emitter::for_message(
            &ConsumerName::new("orders").expect("name"),
            &MessageId::new("order-7").expect("id"),
        );
        let sent = vec![
            emitter
                .message(stream.as_str(), b"first".to_vec())
                .expect("msg"),
            emitter
                .message(stream.as_str(), b"second".to_vec())
                .expect("msg"),
        ];
        let mut tx = store.begin().await.expect("begin");
        store.enqueue(&mut tx, &sent).await.expect("enqueue");
        store.commit(tx).await.expect("commit");
        store.pool().close().await;
        sent
    });

    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--database", &format!("sqlite:{}", db.display())])
        .args(["--broker", &redis, "--poll", "100ms"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start idem relay");

    /// Reads `n` messages: (ID, payload).
    struct Read(usize);
    impl WithSource for Read {
        type Output = Vec<(Vec<u8>, Vec<u8>)>;
        async fn run<S: Source>(self, mut source: S) -> Self::Output {
            let ids = source.default_id_source();
            let mut got = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while got.len() < self.0 && Instant::now() < deadline {
                // Never cancelled mid-fetch: a Redis Streams entry a cancelled call fetched
                // would stay pending to this reader for the claim idle time.
                let Ok(batch) = source.next(8).await else {
                    continue;
                };
                for d in batch {
                    let id = ids
                        .extract(&d)
                        .expect("an ID where idem reads it")
                        .into_owned();
                    got.push((id, d.payload().to_vec()));
                    d.ack().await.expect("ack");
                }
            }
            let _ = source.close().await;
            got
        }
    }
    let url = BrokerUrl::parse(&redis).expect("url");
    let spec = SourceSpec::new(&stream, format!("{stream}_c"), "reader");
    let got = rt
        .block_on(url.with_source(&spec, Read(sent.len())))
        .expect("read back");
    // Marked sent shortly after the broker confirmed.
    let marked = rt.block_on(async {
        let store = SqliteStore::open(&db, SqliteOptions::default())
            .await
            .expect("open");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let b = idem_core::outbox::RelayStore::backlog(&store)
                .await
                .expect("backlog");
            if b.unsent == 0 || Instant::now() > deadline {
                store.pool().close().await;
                break b;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let out = child.wait_with_output().expect("wait");
    rt.block_on(url.teardown(&spec)).expect("teardown");
    let _ = std::fs::remove_dir_all(&dir);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );

    let expected: Vec<(Vec<u8>, Vec<u8>)> = sent
        .iter()
        .map(|m| (m.id().as_bytes().to_vec(), m.payload().to_vec()))
        .collect();
    let mut sorted = got.clone();
    sorted.sort();
    let mut want = expected.clone();
    want.sort();
    assert_eq!(sorted, want, "{stderr}");
    assert_eq!(marked.unsent, 0, "{marked:?} {stderr}");
    assert!(out.status.success(), "exits 0 on SIGTERM: {stderr}");
    assert!(stdout.contains("2 published"), "{stdout} {stderr}");
}

/// On PostgreSQL `idem relay` wakes on each commit that enqueued (LISTEN/NOTIFY): with a
/// 60 s poll, a row committed after the relay started still arrives within seconds.
#[test]
fn on_postgres_a_commit_wakes_the_relay_long_before_its_poll() {
    use std::time::{Duration, Instant};

    use idem_any::{BrokerUrl, SourceSpec, WithSource};
    use idem_consumer::{Delivery, Source};
    use idem_core::outbox::{Emitter, OutboxStore};
    use idem_core::{ConsumerName, MessageId, Migrate, TableName, TransactionalStore};
    use idem_sql::PostgresStore;
    use idem_testkit::isolated::PgSchema;

    let test = "on_postgres_a_commit_wakes_the_relay_long_before_its_poll";
    let Some(redis) = idem_testkit::service_url(idem_testkit::services::REDIS, test) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let Some(schema) = rt.block_on(PgSchema::create("cli_relay", test)) else {
        return;
    };
    let stream = idem_testkit::unique_name("cli_relay", "pg");
    // Writers and relay spell the table the same way: the channel is its name.
    let table = format!("{}.idem_outbox", schema.name());
    let store = rt.block_on(async {
        let store = PostgresStore::from_pool(schema.pool(2).await)
            .with_outbox_table(TableName::new(&table).expect("name"))
            .expect("name");
        store.migrate().await.expect("migrate");
        store
    });
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "relay",
            "--database",
            schema.url(),
            "--outbox-table",
            &table,
        ])
        .args(["--broker", &redis, "--poll", "60s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start idem relay");
    // Past its first (empty) poll, listening.
    std::thread::sleep(Duration::from_secs(2));
    let sent = rt.block_on(async {
        let mut emitter = Emitter::for_message(
            &ConsumerName::new("orders").expect("name"),
            &MessageId::new("order-8").expect("id"),
        );
        let sent = emitter
            .message(stream.as_str(), b"woken".to_vec())
            .expect("msg");
        let mut tx = store.begin().await.expect("begin");
        store
            .enqueue(&mut tx, std::slice::from_ref(&sent))
            .await
            .expect("enqueue");
        store.commit(tx).await.expect("commit");
        sent
    });
    let committed = Instant::now();

    struct First;
    impl WithSource for First {
        type Output = Option<(Vec<u8>, Vec<u8>)>;
        async fn run<S: Source>(self, mut source: S) -> Self::Output {
            let ids = source.default_id_source();
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                let Ok(batch) = source.next(1).await else {
                    continue;
                };
                if let Some(d) = batch.into_iter().next() {
                    let id = ids.extract(&d).expect("an ID").into_owned();
                    let payload = d.payload().to_vec();
                    d.ack().await.expect("ack");
                    let _ = source.close().await;
                    return Some((id, payload));
                }
            }
            None
        }
    }
    let url = BrokerUrl::parse(&redis).expect("url");
    let spec = SourceSpec::new(&stream, format!("{stream}_c"), "reader");
    let got = rt
        .block_on(url.with_source(&spec, First))
        .expect("read back");
    let took = committed.elapsed();
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let out = child.wait_with_output().expect("wait");
    rt.block_on(url.teardown(&spec)).expect("teardown");
    rt.block_on(schema.drop());
    let stderr = String::from_utf8_lossy(&out.stderr);

    assert_eq!(
        got,
        Some((sent.id().as_bytes().to_vec(), b"woken".to_vec())),
        "{stderr}"
    );
    assert!(
        took < Duration::from_secs(10),
        "woken, not polled: {took:?} {stderr}"
    );
    assert!(out.status.success(), "{stderr}");
}
