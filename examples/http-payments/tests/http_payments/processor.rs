//! `--card-processor`: the real binary charging idem-testkit's fake card processor (in this
//! process, over TCP) as the foreign phase of a recovery-point operation. Every test counts
//! the processor's effects per key and the `charges` rows: one charge, made once, recorded
//! once with the processor's ID — through a replay, a lost answer, `503`s and a crash between
//! the processor call and the row.

use std::time::{Duration, Instant};

use idem_testkit::fake_processor::{FakeProcessor, Fault, Stats};

use crate::util::{Answer, Post, Server, Store, TestDb, client, get, post, token};

const BODY: &str = r#"{"account":"dora","amount_cents":1250}"#;

async fn processor() -> FakeProcessor {
    FakeProcessor::start()
        .await
        .expect("start the fake processor")
}

/// The processor charged once, under one key.
fn one_effect(stats: &Stats) {
    assert_eq!(stats.total_effects(), 1, "{stats:?}");
    assert_eq!(stats.effects.len(), 1, "one key: {stats:?}");
    assert_eq!(stats.without_key, 0, "{stats:?}");
}

/// The answer is the charge with the processor's ID, and the row `GET` reads holds it.
async fn recorded(http: &reqwest::Client, server: &Server, me: &str, answer: &Answer) -> String {
    assert_eq!(answer.status, 201, "{answer:?} {:#?}", server.log());
    let body = answer.json();
    let processor_id = body["processor_charge_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no processor_charge_id: {body}"))
        .to_owned();
    let id = body["id"].as_str().expect("id");
    let row = get(http, &server.base, me, &format!("/charges/{id}")).await;
    assert_eq!(row.status, 200, "{row:?}");
    assert_eq!(
        row.json()["processor_charge_id"].as_str(),
        Some(&*processor_id)
    );
    processor_id
}

/// One request → one processor effect and one row carrying its ID; the retry of the same
/// `Idempotency-Key` replays it without calling the processor again.
async fn once_then_replay(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let fake = processor().await;
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let server = Server::start(&db, &["--card-processor", &fake.url()]);

    let first = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("post");
    let processor_id = recorded(&http, &server, &me, &first).await;
    assert!(processor_id.starts_with("ch_"), "{processor_id}");
    one_effect(&fake.stats());
    assert_eq!(fake.stats().calls, 1);
    assert_eq!(db.count_charges(&me).await, 1);

    let again = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("retry");
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed(), "the replay is marked: {again:?}");
    assert!(!first.replayed());
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(
        again.body, first.body,
        "the retry replays the stored charge"
    );
    assert_eq!(
        fake.stats().calls,
        1,
        "a replay does not call the processor"
    );
    one_effect(&fake.stats());
    assert_eq!(db.count_charges(&me).await, 1);

    // Another key is another charge, under another derived key.
    let other = post(&http, &server.base, &Post::new(&me, "\"other\"", BODY))
        .await
        .expect("post");
    assert_eq!(other.status, 201, "{other:?}");
    assert_eq!(fake.stats().total_effects(), 2);
    assert_eq!(fake.stats().effects.len(), 2);
    assert_eq!(db.count_charges(&me).await, 2);
    drop(server);
    db.teardown().await;
}

/// `fault` on the processor's next calls: idem-client retries with the same derived key, so
/// the processor charges once and the service records one row.
async fn through_faults(store: Store, test: &str, faults: &[Fault], calls: u64) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let fake = processor().await;
    for fault in faults {
        fake.fault_next(fault.clone());
    }
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let server = Server::start(&db, &["--card-processor", &fake.url()]);
    let answer = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("post");
    recorded(&http, &server, &me, &answer).await;
    let stats = fake.stats();
    one_effect(&stats);
    assert_eq!(stats.calls, calls, "the client retried: {stats:?}");
    let (derived, _) = stats.effects.iter().next().expect("a key");
    assert_eq!(
        stats.calls_for(derived),
        calls,
        "every attempt sent the same key"
    );
    assert_eq!(db.count_charges(&me).await, 1);
    drop(server);
    db.teardown().await;
}

/// The server is SIGKILLed after the processor charged and before the `Record` point
/// committed. The retry on a restarted server, once the lease ran out, resumes at `Charge`:
/// it calls the processor again with the same derived key, the processor replays its charge,
/// and one row is written with that charge's ID.
/// The server is killed after the processor charged; `resume` brings the charge to its end
/// on a new server (the client's retry, or the completer) and returns the client's answer.
async fn crash_after_the_charge(store: Store, test: &str) {
    crash_then(store, test, false).await;
}

async fn crash_then(store: Store, test: &str, completer: bool) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let fake = processor().await;
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let url = fake.url();
    // Without the completer the client's retry takes the charge over; with it (every 200 ms)
    // the charge is finished before anyone retries.
    let interval = if completer { "200ms" } else { "off" };
    let flags = [
        "--card-processor",
        &url,
        "--test-hooks",
        "--lease",
        "2s",
        "--completer-interval",
        interval,
    ];
    let doomed = Server::start(&db, &flags);
    let in_flight = {
        let (http, base, me, key) = (http.clone(), doomed.base.clone(), me.clone(), key.clone());
        tokio::spawn(async move {
            let p = Post {
                sleep_ms: Some(60_000),
                ..Post::new(&me, &key, BODY)
            };
            post(&http, &base, &p).await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !doomed
        .log()
        .iter()
        .any(|l| l.contains("processor charged, sleeping"))
    {
        assert!(
            Instant::now() < deadline,
            "the request never charged: {:#?}",
            doomed.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    doomed.kill();
    assert!(
        in_flight.await.expect("task").is_err(),
        "the connection drops"
    );
    one_effect(&fake.stats());
    assert_eq!(db.count_charges(&me).await, 0, "no row before the crash");

    let server = Server::start(&db, &flags);
    let deadline = Instant::now() + Duration::from_secs(20);
    if completer {
        // No client retries: the completer finishes the charge once its lease ran out.
        while db.count_charges(&me).await == 0 {
            assert!(
                Instant::now() < deadline,
                "the completer never finished the charge: {:#?}",
                server.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let answer = loop {
        let a = post(&http, &server.base, &Post::new(&me, &key, BODY))
            .await
            .expect("retry");
        if a.status != 409 {
            break a;
        }
        assert!(Instant::now() < deadline, "still 409: {a:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let processor_id = recorded(&http, &server, &me, &answer).await;
    if completer {
        assert!(
            answer.replayed(),
            "the completer's charge is replayed: {answer:?}"
        );
    }
    let stats = fake.stats();
    one_effect(&stats);
    assert_eq!(stats.calls, 2, "the resumed phase called again: {stats:?}");
    let (derived, _) = stats.effects.iter().next().expect("a key");
    assert_eq!(stats.calls_for(derived), 2, "with the same key: {stats:?}");
    assert_eq!(
        processor_id, "ch_000001",
        "the processor's first charge, replayed"
    );
    assert_eq!(db.count_charges(&me).await, 1);
    drop(server);
    db.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_card_processor_once_then_replay() {
    once_then_replay(Store::Sqlite, "sqlite_card_once").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_card_processor_once_then_replay() {
    once_then_replay(Store::Postgres, "postgres_card_once").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_card_processor_once_then_replay() {
    once_then_replay(Store::MySql, "mysql_card_once").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_card_processor_lost_answer_is_retried_with_the_same_key() {
    through_faults(
        Store::Sqlite,
        "sqlite_card_drop",
        &[Fault::ChargeThenDrop],
        2,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_card_processor_503_twice_then_charged_once() {
    let unavailable = Fault::Status {
        status: 503,
        retry_after: None,
    };
    through_faults(
        Store::Sqlite,
        "sqlite_card_503",
        &[unavailable.clone(), unavailable],
        3,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_card_processor_crash_after_the_charge_resumes_with_the_same_key() {
    crash_after_the_charge(Store::Sqlite, "sqlite_card_crash").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_card_processor_crash_after_the_charge_resumes_with_the_same_key() {
    crash_after_the_charge(Store::Postgres, "postgres_card_crash").await;
}

/// A `charges` table made before `processor_charge_id` existed gets the column in place on
/// start, its rows kept, and `--card-processor` records into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_card_processor_crashed_charge_is_finished_by_the_completer() {
    crash_then(Store::Sqlite, "sqlite_card_completer", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_card_processor_crashed_charge_is_finished_by_the_completer() {
    crash_then(Store::Postgres, "postgres_card_completer", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_old_charges_table_gets_the_processor_column() {
    let test = "sqlite_card_migrate";
    let Some(db) = TestDb::new(Store::Sqlite, test).await else {
        return;
    };
    let url = db.args[1].clone();
    let me = token(test);
    {
        use sqlx::ConnectOptions;
        let options: sqlx::sqlite::SqliteConnectOptions = url.parse().expect("sqlite URL");
        let mut conn = options
            .create_if_missing(true)
            .connect()
            .await
            .expect("open the ledger");
        sqlx::query(
            "CREATE TABLE charges (id TEXT PRIMARY KEY, principal TEXT NOT NULL,
             account TEXT NOT NULL, amount_cents INTEGER NOT NULL, created_at TEXT NOT NULL)",
        )
        .execute(&mut conn)
        .await
        .expect("the old table");
        sqlx::query("INSERT INTO charges VALUES ('ch_old', ?, 'dora', 5, '2026-01-01T00:00:00Z')")
            .bind(crate::util::principal_of(&me))
            .execute(&mut conn)
            .await
            .expect("an old row");
    }
    let fake = processor().await;
    let http = client();
    let server = Server::start(&db, &["--card-processor", &fake.url()]);
    let old = get(&http, &server.base, &me, "/charges/ch_old").await;
    assert_eq!(old.status, 200, "{old:?}");
    assert!(
        old.json().get("processor_charge_id").is_none(),
        "{:?}",
        old.json()
    );
    let answer = post(&http, &server.base, &Post::new(&me, "\"k\"", BODY))
        .await
        .expect("post");
    recorded(&http, &server, &me, &answer).await;
    assert_eq!(db.count_charges(&me).await, 2);
    drop(server);
    db.teardown().await;
}
