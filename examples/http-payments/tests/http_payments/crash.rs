//! Crashes and takeovers with the real binary: in the leased mode (`--leased-only`, and always
//! on SQLite and Redis) a server SIGKILLed mid-request leaves its key leased — a retry on the
//! restarted server is 409 until the lease runs out, then executes exactly once and replays —
//! and a server whose request outlives its lease while another instance takes the key over
//! has its late completion refused and its charge rolled back. In the one-transaction mode
//! (PostgreSQL and MariaDB by default) the kill rolls the take back with the charge: the
//! retry executes at once, exactly once.

use std::time::{Duration, Instant};

use crate::util::{Post, Server, Store, TestDb, client, post, token};

const BODY: &str = r#"{"account":"carol","amount_cents":700}"#;

/// The lease the servers run with: long enough that the restarted server answers the first
/// retry before it runs out even on a busy machine, short enough for a test.
const LEASE: &str = "4s";

/// Starts a server with `extra` arguments, sends it a request that sleeps in its transaction
/// after writing its charge, and SIGKILLs the server mid-sleep; returns when it was killed.
async fn kill_mid_request(db: &TestDb, me: &str, key: &str, extra: &[&str]) -> Instant {
    let doomed = Server::start(
        db,
        &[&["--test-hooks", "--lease", LEASE][..], extra].concat(),
    );
    let in_flight = {
        let (http, base, me, key) = (client(), doomed.base.clone(), me.to_owned(), key.to_owned());
        tokio::spawn(async move {
            let p = Post {
                sleep_ms: Some(60_000),
                ..Post::new(&me, &key, BODY)
            };
            post(&http, &base, &p).await
        })
    };
    // Let the request take its record and write its charge, then kill the process mid-sleep.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !doomed
        .log()
        .iter()
        .any(|l| l.contains("charge written, sleeping"))
    {
        assert!(
            Instant::now() < deadline,
            "the request never started: {:#?}",
            doomed.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed_at = Instant::now();
    doomed.kill();
    let lost = in_flight.await.expect("task");
    assert!(
        lost.is_err(),
        "the client sees the connection drop: {lost:?}"
    );
    killed_at
}

async fn sigkill_mid_request(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");

    let killed_at = kill_mid_request(&db, &me, &key, &["--leased-only"]).await;

    // The restarted server: the dead request's lease still holds the key.
    let server = Server::start(&db, &["--test-hooks", "--lease", LEASE, "--leased-only"]);
    let busy = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("retry");
    assert!(
        killed_at.elapsed() < Duration::from_secs(4),
        "restart too slow for this check: {:?}",
        killed_at.elapsed()
    );
    assert_eq!(
        busy.status,
        409,
        "before the lease lapses: {busy:?} {:#?}",
        server.log()
    );
    assert_eq!(busy.problem_code(), "conflict");
    let retry_after: u64 = busy
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=4).contains(&retry_after), "{retry_after}");
    // Nothing of the killed request committed.
    assert_eq!(db.count_charges(&me).await, 0);

    // After the lease: the retry takes the record over and executes, once.
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let executed = loop {
        let a = post(&http, &server.base, &Post::new(&me, &key, BODY))
            .await
            .expect("retry");
        if a.status != 409 {
            break a;
        }
        assert!(
            Instant::now() < deadline,
            "still 409 long after the lease: {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(executed.status, 201, "{executed:?} {:#?}", server.log());
    assert!(!executed.replayed(), "the takeover executes");
    let replay = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("replay");
    assert!(
        replay.replayed() && replay.body == executed.body,
        "{replay:?}"
    );
    assert_eq!(db.count_charges(&me).await, 1, "exactly one charge");
    assert!(
        server.log().iter().any(|l| l.contains("took over")),
        "the takeover is logged: {:#?}",
        server.log()
    );
    drop(server);
    db.teardown().await;
}

/// Instance A runs without a heartbeat, so its 2 s lease lapses while its handler sleeps 5 s;
/// instance B takes the key over and executes. A's late completion carries a stale fencing
/// token and is refused; its charge row rolls back with it.
/// The one-transaction mode: a server SIGKILLed mid-request (its charge written, its
/// transaction open) leaves nothing behind — the take rolled back with the charge — so the
/// retry on the restarted server executes at once, exactly once, and then replays.
async fn sigkill_mid_request_in_one_transaction(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");

    kill_mid_request(&db, &me, &key, &[]).await;

    let server = Server::start(&db, &["--test-hooks", "--lease", LEASE]);
    // The server may still be ending the dead connection's transaction: a 409 meanwhile is
    // allowed, a wait for the lease (4 s) is not needed.
    let deadline = Instant::now() + Duration::from_secs(15);
    let executed = loop {
        let a = post(&http, &server.base, &Post::new(&me, &key, BODY))
            .await
            .expect("retry");
        if a.status != 409 {
            break a;
        }
        assert!(Instant::now() < deadline, "still 409: {a:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(executed.status, 201, "{executed:?} {:#?}", server.log());
    assert!(!executed.replayed(), "the retry executes");
    let replay = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("replay");
    assert!(
        replay.replayed() && replay.body == executed.body,
        "{replay:?}"
    );
    assert_eq!(db.count_charges(&me).await, 1, "exactly one charge");
    assert!(
        !server.log().iter().any(|l| l.contains("took over")),
        "nothing to take over: {:#?}",
        server.log()
    );
    drop(server);
    db.teardown().await;
}

async fn stale_fence(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let a = Server::start(
        &db,
        &[
            "--test-hooks",
            "--lease",
            "2s",
            "--heartbeat",
            "off",
            "--leased-only",
        ],
    );
    let b = Server::start(&db, &["--test-hooks", "--lease", "2s", "--leased-only"]);

    let late = {
        let (http, base, me, key) = (http.clone(), a.base.clone(), me.clone(), key.clone());
        tokio::spawn(async move {
            let p = Post {
                sleep_ms: Some(5_000),
                ..Post::new(&me, &key, BODY)
            };
            post(&http, &base, &p).await
        })
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs(20);
    while !a
        .log()
        .iter()
        .any(|l| l.contains("charge written, sleeping"))
    {
        assert!(Instant::now() < deadline, "A never started: {:#?}", a.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let taken = post(&http, &b.base, &Post::new(&me, &key, BODY))
        .await
        .expect("B");
    let late = late.await.expect("task").expect("A answers");
    if store == Store::Sqlite {
        // SQLite has one writer, and A's transaction holds the write lock while it sleeps, so
        // no one can take the record over while A runs: B is told so at once (409) instead
        // of blocking, A's completion is still current and commits, and B's retry replays it.
        // A stale fence cannot arise on one SQLite file.
        assert_eq!(
            taken.status, 409,
            "B while A holds the write lock: {taken:?}"
        );
        assert_eq!(late.status, 201, "{late:?} {:#?}", a.log());
        let replay = post(&http, &b.base, &Post::new(&me, &key, BODY))
            .await
            .expect("B again");
        assert!(replay.replayed() && replay.body == late.body, "{replay:?}");
        assert_eq!(db.count_charges(&me).await, 1);
        drop((a, b));
        db.teardown().await;
        return;
    }
    assert_eq!(taken.status, 201, "B executes: {taken:?} {:#?}", b.log());
    assert!(!taken.replayed(), "{taken:?}");
    // A's completion carries a stale fence: refused, its response not stored (its charge
    // rolled back on a SQL store; on Redis it is B's charge, by the derived ID).
    assert_eq!(
        late.status,
        409,
        "A's late completion is refused: {late:?} {:#?}",
        a.log()
    );
    assert_eq!(late.problem_code(), "lease-lost");
    // The record holds B's response, on either instance.
    for server in [&a, &b] {
        let replay = post(&http, &server.base, &Post::new(&me, &key, BODY))
            .await
            .expect("replay");
        assert!(replay.replayed() && replay.body == taken.body, "{replay:?}");
    }
    assert_eq!(
        db.count_charges(&me).await,
        1,
        "one charge: A's rolled back"
    );
    drop((a, b));
    db.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sigkill_mid_request_then_one_execution() {
    sigkill_mid_request(Store::Sqlite, "sqlite_sigkill_mid_request").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sigkill_mid_request_then_one_execution() {
    sigkill_mid_request(Store::Postgres, "postgres_sigkill_mid_request").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_sigkill_mid_request_then_one_execution() {
    sigkill_mid_request(Store::MySql, "mysql_sigkill_mid_request").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkill_mid_request_then_one_execution() {
    sigkill_mid_request(Store::Redis, "redis_sigkill_mid_request").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sigkill_mid_request_in_one_transaction_then_one_execution() {
    sigkill_mid_request_in_one_transaction(Store::Postgres, "postgres_sigkill_one_tx").await;
}

#[tokio::test]
async fn mysql_sigkill_mid_request_in_one_transaction_then_one_execution() {
    sigkill_mid_request_in_one_transaction(Store::MySql, "mysql_sigkill_one_tx").await;
}

#[tokio::test]
async fn sqlite_stale_fence_late_completion_is_refused() {
    stale_fence(Store::Sqlite, "sqlite_stale_fence").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stale_fence_late_completion_is_refused() {
    stale_fence(Store::Postgres, "postgres_stale_fence").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_stale_fence_late_completion_is_refused() {
    stale_fence(Store::MySql, "mysql_stale_fence").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stale_fence_late_completion_is_refused() {
    stale_fence(Store::Redis, "redis_stale_fence").await;
}
