//! `--emit NAME --broker URL`: each charge's `PaymentCharged` event goes through the outbox, in
//! the request's transaction, to the broker, read back with idem's own source: one event per
//! executed charge (a replay makes none), its message ID the one the request's emitter derives
//! from its scoped key (recomputed with `idem_http::Principal::emitter`), its payload the
//! charge; the outbox rows marked sent. And `--emit` refused where the charge's transaction is
//! not the request's (Redis).

use std::process::Command;
use std::time::{Duration, Instant};

use idem_any::{BrokerUrl, SourceSpec, WithSource};
use idem_consumer::{Delivery, Source};
use idem_core::MessageId;
use idem_testkit::{service_url, services, unique_name};

use crate::util::{BIN, Post, Server, Store, TestDb, client, post, principal_of, token};

/// The ID of the first event of the request `POST /charges` with `Idempotency-Key: key_header`
/// and bearer `token`, recomputed outside the request through idem-http's own
/// [`Principal::emitter`](idem_http::Principal::emitter): what
/// [`idem_http::IdemRequest::emitter`] hands the handler for that principal, method, path and
/// key.
fn event_id(token: &str, key_header: &str) -> MessageId {
    let key = idem_http::parse_key(key_header.as_bytes(), 255).expect("a valid key");
    idem_http::Principal::new(principal_of(token))
        .emitter(&axum::http::Method::POST, "/charges", &key)
        .next_id()
}

/// One event as read: its message ID where idem's consumers read it, and its JSON payload.
type Event = (Vec<u8>, serde_json::Value);

/// Reads events from an open source: says it is subscribed, reads until `want` arrived, then
/// keeps reading for `linger` so that one too many would be seen.
struct Read {
    ready: tokio::sync::oneshot::Sender<()>,
    want: usize,
    linger: Duration,
}

impl WithSource for Read {
    type Output = Vec<Event>;

    async fn run<S: Source>(self, mut source: S) -> Vec<Event> {
        let ids = source.default_id_source();
        let _ = self.ready.send(());
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut until = deadline;
        while Instant::now() < until {
            // A fetch is cancelled only when reading ends: one cancelled midway leaves what it
            // read pending until the broker redelivers it, long after this test.
            let wait = tokio::time::timeout_at(until.into(), source.next(8)).await;
            let batch = match wait {
                Ok(Ok(batch)) => batch,
                Ok(Err(e)) => {
                    eprintln!("reading {e}; again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(_) => break,
            };
            for d in batch {
                let id = ids
                    .extract(&d)
                    .expect("an ID where idem reads it")
                    .into_owned();
                let payload = serde_json::from_slice(d.payload()).unwrap_or_else(|e| {
                    panic!("not JSON ({e}): {}", String::from_utf8_lossy(d.payload()))
                });
                got.push((id, payload));
                d.ack().await.expect("ack");
            }
            if got.len() >= self.want && until == deadline {
                until = Instant::now() + self.linger;
            }
        }
        let _ = source.close().await;
        got
    }
}

async fn emits_once_per_charge(store: Store, broker_var: &str, test: &str) {
    let Some(broker) = service_url(broker_var, test) else {
        return;
    };
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let destination = unique_name("httpemit", test).replace('_', "-");
    let server = Server::start(&db, &["--emit", &destination, "--broker", &broker]);
    let http = client();
    let base = server.base.as_str();
    let me = token(test);
    let (key1, key2) = (format!("\"{test}-1\""), format!("\"{test}-2\""));
    let alice = r#"{"account":"alice","amount_cents":1250}"#;
    let bob = r#"{"account":"bob","amount_cents":300}"#;

    let url = BrokerUrl::parse(&broker).expect("broker URL");
    let spec = SourceSpec::new(&destination, format!("{destination}-reader"), "reader");
    let (ready, subscribed) = tokio::sync::oneshot::channel();
    let read = url.with_source(
        &spec,
        Read {
            ready,
            want: 2,
            linger: Duration::from_millis(1500),
        },
    );
    // The source first (an MQTT broker drops what nobody subscribes to), then the requests.
    let act = async {
        subscribed.await.expect("the source opened");
        let first = post(&http, base, &Post::new(&me, &key1, alice))
            .await
            .expect("first");
        let retry = post(&http, base, &Post::new(&me, &key1, alice))
            .await
            .expect("retry");
        let second = post(&http, base, &Post::new(&me, &key2, bob))
            .await
            .expect("second");
        (first, retry, second)
    };
    let (got, (first, retry, second)) = tokio::join!(read, act);
    let got = got.expect("read back");
    // Marked sent once the broker confirmed: shortly after.
    let deadline = Instant::now() + Duration::from_secs(10);
    let outbox = loop {
        let rows = db.outbox().await;
        if rows.iter().all(|(_, sent)| *sent) || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let status = server.terminate();
    url.teardown(&spec).await.expect("teardown");
    db.teardown().await;

    assert_eq!(first.status, 201, "{first:?}");
    assert!(
        retry.replayed() && retry.body == first.body,
        "the retry replays: {retry:?}"
    );
    assert_eq!(second.status, 201, "{second:?}");
    assert!(!second.replayed(), "{second:?}");
    let charge = |a: &crate::util::Answer| a.json()["id"].as_str().expect("id").to_owned();
    let want: Vec<Event> = vec![
        (
            event_id(&me, &key1).as_bytes().to_vec(),
            serde_json::json!({"payment_id": charge(&first), "account": "alice", "amount_cents": 1250}),
        ),
        (
            event_id(&me, &key2).as_bytes().to_vec(),
            serde_json::json!({"payment_id": charge(&second), "account": "bob", "amount_cents": 300}),
        ),
    ];
    let mut sorted = got.clone();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want_sorted = want.clone();
    want_sorted.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        sorted, want_sorted,
        "exactly one event per executed charge, with the derived IDs"
    );
    assert_eq!(
        outbox,
        want.iter()
            .map(|(id, _)| (id.clone(), true))
            .collect::<Vec<_>>(),
        "two outbox rows, in request order, both marked sent"
    );
    assert!(status.success(), "exits 0 on SIGTERM");
}

/// A takeover: instance A (no heartbeat, a 2 s lease) writes its charge and event and sleeps
/// 5 s in its transaction; instance B takes the key over and executes. A's late completion is
/// refused and rolls back — its charge and its event with it — so exactly one event is
/// published: B's charge's, under the ID both executions derive from the request.
async fn takeover_emits_once(store: Store, test: &str) {
    let Some(broker) = service_url(services::REDIS, test) else {
        return;
    };
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let destination = unique_name("httpemit", test).replace('_', "-");
    let emit = ["--emit", destination.as_str(), "--broker", broker.as_str()];
    let a = Server::start(
        &db,
        &[
            &[
                "--test-hooks",
                "--lease",
                "2s",
                "--heartbeat",
                "off",
                "--leased-only",
            ][..],
            &emit,
            &["--relay-name", "relay-a"],
        ]
        .concat(),
    );
    let b = Server::start(
        &db,
        &[
            &["--test-hooks", "--lease", "2s", "--leased-only"][..],
            &emit,
            &["--relay-name", "relay-b"],
        ]
        .concat(),
    );
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let body = r#"{"account":"carol","amount_cents":700}"#;

    let url = BrokerUrl::parse(&broker).expect("broker URL");
    let spec = SourceSpec::new(&destination, format!("{destination}-reader"), "reader");
    let (ready, subscribed) = tokio::sync::oneshot::channel();
    let read = url.with_source(
        &spec,
        Read {
            ready,
            want: 1,
            // Past A's refused completion (5 s after it started).
            linger: Duration::from_secs(4),
        },
    );
    let act = async {
        subscribed.await.expect("the source opened");
        let late = {
            let (http, base, me, key) = (http.clone(), a.base.clone(), me.clone(), key.clone());
            tokio::spawn(async move {
                let p = Post {
                    sleep_ms: Some(5_000),
                    ..Post::new(&me, &key, body)
                };
                post(&http, &base, &p).await
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !a
            .log()
            .iter()
            .any(|l| l.contains("charge written, sleeping"))
        {
            assert!(Instant::now() < deadline, "A never started: {:#?}", a.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(2600)).await;
        let taken = post(&http, &b.base, &Post::new(&me, &key, body))
            .await
            .expect("B");
        let late = late.await.expect("task").expect("A answers");
        (taken, late)
    };
    let (got, (taken, late)) = tokio::join!(read, act);
    let got = got.expect("read back");
    let deadline = Instant::now() + Duration::from_secs(10);
    let outbox = loop {
        let rows = db.outbox().await;
        if rows.iter().all(|(_, sent)| *sent) || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let logs = (a.log(), b.log());
    drop((a, b));
    url.teardown(&spec).await.expect("teardown");
    db.teardown().await;

    assert_eq!(taken.status, 201, "B executes: {taken:?} {logs:#?}");
    assert_eq!(late.status, 409, "A's late completion is refused: {late:?}");
    assert_eq!(late.problem_code(), "lease-lost");
    let id = event_id(&me, &key).as_bytes().to_vec();
    let charge = taken.json()["id"].as_str().expect("id").to_owned();
    assert_eq!(
        got,
        vec![(
            id.clone(),
            serde_json::json!({"payment_id": charge, "account": "carol", "amount_cents": 700})
        )],
        "one event, B's charge's: A's rolled back with its charge {logs:#?}"
    );
    assert_eq!(outbox, vec![(id, true)], "one outbox row, marked sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_emits_to_nats() {
    emits_once_per_charge(Store::Sqlite, services::NATS, "sqlite_emits_to_nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_emits_to_redis_streams() {
    emits_once_per_charge(
        Store::Sqlite,
        services::REDIS,
        "sqlite_emits_to_redis_streams",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_emits_to_rabbitmq() {
    emits_once_per_charge(Store::Sqlite, services::AMQP, "sqlite_emits_to_rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_emits_to_mqtt() {
    emits_once_per_charge(Store::Sqlite, services::MQTT, "sqlite_emits_to_mqtt").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_emits_to_nats() {
    emits_once_per_charge(Store::Postgres, services::NATS, "postgres_emits_to_nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_emits_to_redis_streams() {
    emits_once_per_charge(
        Store::Postgres,
        services::REDIS,
        "postgres_emits_to_redis_streams",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_emits_to_nats() {
    emits_once_per_charge(Store::MySql, services::NATS, "mysql_emits_to_nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_emits_to_redis_streams() {
    emits_once_per_charge(
        Store::MySql,
        services::REDIS,
        "mysql_emits_to_redis_streams",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takeover_emits_once() {
    takeover_emits_once(Store::Postgres, "postgres_takeover_emits_once").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_takeover_emits_once() {
    takeover_emits_once(Store::MySql, "mysql_takeover_emits_once").await;
}

/// With a Redis `--database` the charge commits in the ledger's transaction, not the
/// request's, so an event could not commit with it: refused at start, before anything
/// connects, with the reason. `--emit` without `--broker` is refused too.
#[test]
fn emit_is_refused_with_a_redis_database() {
    let dir = std::env::temp_dir().join(unique_name("httpemit", "redis_refused"));
    let ledger = format!("sqlite:{}", dir.join("ledger.db").display());
    let run = |args: &[&str]| {
        let o = Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .expect("run http-payments");
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        "--database",
        "redis://:hunter2@127.0.0.1:1",
        "--ledger",
        &ledger,
        "--emit",
        "payments.charged",
        "--broker",
        "nats://127.0.0.1:1",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("--emit needs a SQL --database") && err.contains("not the request's"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        !err.contains("opening the ledger"),
        "refused before the ledger opens: {err}"
    );

    let (code, err) = run(&["--emit", "payments.charged"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--broker"), "{err}");
}
