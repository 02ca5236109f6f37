//! The README's curl session, with the real binary over real TCP on every store: first call
//! 201, replay byte for byte with `Idempotent-Replayed: true`, 409 while in flight, 422 for a
//! different body (the original still replays), 400 without a key, 401 without a token,
//! input validation, `GET /charges/{id}`, and one `charges` row per executed charge.

use std::time::{Duration, Instant};

use crate::util::{Post, Server, Store, TestDb, client, get, post, token};

const BODY: &str = r#"{"account":"alice","amount_cents":1250}"#;

async fn curl_session(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let server = Server::start(&db, &["--test-hooks"]);
    let http = client();
    let base = server.base.as_str();
    let me = token(test);
    let key = format!("\"{test}-1\"");

    // First call: executed, 201, no replay marker.
    let first = post(&http, base, &Post::new(&me, &key, BODY))
        .await
        .expect("first");
    assert_eq!(first.status, 201, "{first:?} {:#?}", server.log());
    assert!(
        !first.replayed(),
        "a first execution never carries the marker"
    );
    assert_eq!(first.header("content-type"), Some("application/json"));
    let charge = first.json();
    assert_eq!(charge["account"], "alice");
    assert_eq!(charge["amount_cents"], 1250);
    let id = charge["id"].as_str().expect("id").to_owned();
    assert!(charge["created_at"].is_string());

    // Replay: the stored response byte for byte, with the marker.
    let replay = post(&http, base, &Post::new(&me, &key, BODY))
        .await
        .expect("replay");
    assert_eq!(replay.status, 201);
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body, "byte-identical replay");
    assert_eq!(replay.header("location"), first.header("location"));

    // Same key, different body: 422, and the original still replays.
    let other = r#"{"account":"alice","amount_cents":999}"#;
    let mismatch = post(&http, base, &Post::new(&me, &key, other))
        .await
        .expect("mismatch");
    assert_eq!(mismatch.status, 422, "{mismatch:?}");
    assert_eq!(mismatch.problem_code(), "fingerprint-mismatch");
    let again = post(&http, base, &Post::new(&me, &key, BODY))
        .await
        .expect("again");
    assert!(again.replayed() && again.body == first.body, "{again:?}");

    // Missing key: 400 and nothing executed.
    let nokey = Post {
        key: None,
        ..Post::new(&me, "", BODY)
    };
    let missing = post(&http, base, &nokey).await.expect("missing key");
    assert_eq!(missing.status, 400, "{missing:?}");
    assert_eq!(missing.problem_code(), "missing-key");

    // No or malformed token: 401 before anything else.
    for bad in [None, Some("not a token")] {
        let p = Post {
            token: bad,
            ..Post::new("", &key, BODY)
        };
        let unauthorized = post(&http, base, &p).await.expect("401");
        assert_eq!(unauthorized.status, 401, "{bad:?}: {unauthorized:?}");
        assert_eq!(unauthorized.problem_code(), "unauthorized");
        assert!(unauthorized.header("www-authenticate").is_some());
    }

    // In flight: a retry gets 409 at once, with Retry-After, while the first still runs.
    let slow_key = format!("\"{test}-slow\"");
    let slow = {
        let http = http.clone();
        let base = base.to_owned();
        let (me, slow_key) = (me.clone(), slow_key.clone());
        tokio::spawn(async move {
            let p = Post {
                sleep_ms: Some(3000),
                ..Post::new(&me, &slow_key, BODY)
            };
            post(&http, &base, &p).await
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    let asked = Instant::now();
    let busy = post(&http, base, &Post::new(&me, &slow_key, BODY))
        .await
        .expect("409");
    assert_eq!(busy.status, 409, "{busy:?} {:#?}", server.log());
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "409 at once, not after the first finished: {:?}",
        asked.elapsed()
    );
    assert_eq!(busy.problem_code(), "conflict");
    let retry_after: u64 = busy
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in whole seconds");
    assert!((1..=2).contains(&retry_after), "a hint: {retry_after}");
    let slow = slow.await.expect("task").expect("slow request");
    assert_eq!(slow.status, 201, "{slow:?}");
    assert!(!slow.replayed());
    let after = post(&http, base, &Post::new(&me, &slow_key, BODY))
        .await
        .expect("after");
    assert!(after.replayed() && after.body == slow.body, "{after:?}");

    // Validation: bad JSON 400, blank account and non-positive amount 422 (all problem+json);
    // refused before the charge began, so not stored: the corrected request runs on its key.
    for (i, (body, status, code)) in [
        ("{not json", 400, "invalid-json"),
        (r#"{"account":"","amount_cents":5}"#, 422, "invalid-charge"),
        (
            r#"{"account":"bob","amount_cents":0}"#,
            422,
            "invalid-charge",
        ),
        (
            r#"{"account":"bob","amount_cents":-5}"#,
            422,
            "invalid-charge",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let k = format!("\"{test}-invalid-{i}\"");
        let a = post(&http, base, &Post::new(&me, &k, body))
            .await
            .expect("invalid");
        assert_eq!(
            (a.status, a.problem_code().as_str()),
            (status, code),
            "{body}: {a:?}"
        );
    }
    let fixed = post(
        &http,
        base,
        &Post::new(&me, &format!("\"{test}-invalid-0\""), BODY),
    )
    .await
    .expect("corrected");
    assert_eq!((fixed.status, fixed.replayed()), (201, false), "{fixed:?}");

    // Reads: the charge for its principal; 404 for an unknown ID and for someone else.
    let read = get(&http, base, &me, &format!("/charges/{id}")).await;
    assert_eq!(read.status, 200, "{read:?}");
    assert_eq!(read.json(), charge);
    let unknown = get(&http, base, &me, "/charges/ch_nope").await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.problem_code(), "not-found");
    let stranger = get(&http, base, &token("stranger"), &format!("/charges/{id}")).await;
    assert_eq!(stranger.status, 404);

    // Exactly the three executed charges were written, under a digest of the token: the
    // credential itself is nowhere in the database.
    assert_eq!(db.count_charges(&me).await, 3);
    assert_eq!(
        db.count_rows_of(&me).await,
        0,
        "the bearer token is stored in clear"
    );

    let status = server.terminate();
    assert!(status.success(), "exits 0 on SIGTERM: {status:?}");
    db.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_curl_session() {
    curl_session(Store::Sqlite, "sqlite_curl_session").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_curl_session() {
    curl_session(Store::Postgres, "postgres_curl_session").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_curl_session() {
    curl_session(Store::MySql, "mysql_curl_session").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_curl_session() {
    curl_session(Store::Redis, "redis_curl_session").await;
}

/// A key reused after its record expired is a new charge, on every store: on Redis too, where
/// the charge's ID is derived from the record (a re-execution of the same record finds it).
async fn an_expired_key_is_a_new_charge(store: Store, test: &str) {
    let Some(db) = TestDb::new(store, test).await else {
        return;
    };
    let server = Server::start(&db, &["--ttl", "2s", "--lease", "1s"]);
    let http = client();
    let me = token(test);
    let key = format!("\"{test}\"");
    let first = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("first");
    assert_eq!(first.status, 201, "{first:?} {:#?}", server.log());
    let replay = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("replay");
    assert!(replay.replayed() && replay.body == first.body, "{replay:?}");
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let again = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("after the TTL");
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_ne!(
        again.json()["id"],
        first.json()["id"],
        "the key's record expired: this is a new charge, not the old one"
    );
    let replay = post(&http, &server.base, &Post::new(&me, &key, BODY))
        .await
        .expect("replay of the new one");
    assert!(replay.replayed() && replay.body == again.body, "{replay:?}");
    assert_eq!(db.count_charges(&me).await, 2);
    drop(server);
    db.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_expired_key_is_a_new_charge() {
    an_expired_key_is_a_new_charge(Store::Sqlite, "sqlite_an_expired_key_is_a_new_charge").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_expired_key_is_a_new_charge() {
    an_expired_key_is_a_new_charge(Store::Postgres, "postgres_an_expired_key_is_a_new_charge")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_expired_key_is_a_new_charge() {
    an_expired_key_is_a_new_charge(Store::MySql, "mysql_an_expired_key_is_a_new_charge").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_expired_key_is_a_new_charge() {
    an_expired_key_is_a_new_charge(Store::Redis, "redis_an_expired_key_is_a_new_charge").await;
}

/// SQLite (issue 19, point 4): a request that works before it writes holds no lock meanwhile,
/// and one that cannot get the write lock within `--busy-timeout` — here a charge held in its
/// transaction by another request — is `503` with `Retry-After`, charges nothing, and leaves
/// its key free: the retry charges once. (Its handler's write waits past the bound, or, on a
/// machine too slow to take its record before the other request locks, its record's take
/// does: `database-busy` from the handler or `store-unavailable` from the layer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_charge_waiting_for_the_write_lock_past_the_bound_is_503_and_its_key_stays_free() {
    let test = "sqlite_write_lock_bound";
    let Some(db) = TestDb::new(Store::Sqlite, test).await else {
        return;
    };
    let server = Server::start(&db, &["--test-hooks", "--busy-timeout", "300ms"]);
    let http = client();
    let me = token(test);
    let (waiting_key, holder_key) = (format!("\"{test}-waiting\""), format!("\"{test}-holder\""));
    let spawn = |key: String, work_ms: Option<u64>, sleep_ms: Option<u64>| {
        let (http, base, me) = (http.clone(), server.base.clone(), me.clone());
        tokio::spawn(async move {
            let p = Post {
                work_ms,
                sleep_ms,
                ..Post::new(&me, &key, BODY)
            };
            post(&http, &base, &p).await.expect("an answer")
        })
    };
    // Its record taken, it works 600 ms before writing.
    let waiting = spawn(waiting_key.clone(), Some(600), None);
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Writes its charge at once, then keeps the transaction (and the write lock) for 2 s.
    let holder = spawn(holder_key, None, Some(2000));
    let refused = waiting.await.expect("task");
    assert_eq!(refused.status, 503, "{refused:?} {:#?}", server.log());
    assert!(
        ["database-busy", "store-unavailable"].contains(&refused.problem_code().as_str()),
        "{refused:?}"
    );
    let retry_after: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let holder = holder.await.expect("task");
    assert_eq!(holder.status, 201, "{holder:?}");
    assert_eq!(db.count_charges(&me).await, 1, "only the holder's charge");
    let again = post(&http, &server.base, &Post::new(&me, &waiting_key, BODY))
        .await
        .expect("again");
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(db.count_charges(&me).await, 2);
    drop(server);
    db.teardown().await;
}

#[test]
fn bad_urls_are_one_line_errors() {
    for args in [
        &["--database", "oracle://x"][..],
        &["--database", "redis://127.0.0.1:6379"][..],
        &[
            "--database",
            "sqlite::memory:",
            "--ledger",
            "sqlite::memory:",
        ][..],
    ] {
        let out = std::process::Command::new(crate::util::BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: ") && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}
