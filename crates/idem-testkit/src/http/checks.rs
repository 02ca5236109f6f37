//! The black-box checks, generic over the framework and the store;
//! [`http_suite_tests!`](crate::http_suite_tests) runs each once per store. Every check talks
//! to the server over TCP only, and reads the store through the fixture. The outbox checks
//! (`POST /emit`) are in their own module, re-exported here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::HeaderValue;
use idem_core::store::reap_all;
use serde_json::json;

use super::{
    HttpFixture, HttpFramework, Post, REQUEST_LIMIT, Reply, STORAGE_LIMIT, Server, raw_http, serve,
};

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => Arc::new(fx),
            None => return,
        }
    };
}

mod outbox;

pub use outbox::{
    a_failed_emitting_request_enqueues_nothing_and_its_retry_enqueues_once,
    a_fenced_out_execution_enqueues_nothing_and_the_takeover_enqueues_once,
    a_store_without_a_shared_transaction_refuses_the_outbox,
    an_emitting_request_enqueues_its_messages_under_derived_ids_once,
    another_body_with_an_emitting_key_is_422_and_enqueues_nothing,
    concurrent_emitting_requests_with_one_key_enqueue_once,
    two_principals_with_one_key_enqueue_under_distinct_ids,
};

async fn default_server<A: HttpFramework, F: HttpFixture>(fx: &Arc<F>) -> Server<F> {
    serve::<A, F>(Arc::clone(fx), fx.store(), |b| b).await
}

async fn done<F: HttpFixture>(server: Server<F>, fx: Arc<F>) {
    drop(server);
    // The server task may still hold a clone for a moment after the abort.
    let mut fx = fx;
    for _ in 0..100 {
        match Arc::try_unwrap(fx) {
            Ok(fx) => return fx.teardown().await,
            Err(back) => fx = back,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The headers a replay must repeat: everything of the first response except what is never
/// stored (`Set-Cookie`), what is not allow-listed (`x-not-stored`) and what the server stamps
/// on every response (`date`).
fn kept(reply: &Reply) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = reply
        .headers
        .iter()
        .filter(|(n, _)| {
            !matches!(
                n.as_str(),
                "set-cookie" | "x-not-stored" | "date" | "idempotent-replayed"
            )
        })
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    out.sort();
    out
}

/// Concurrent requests with one key execute once.
pub async fn concurrent_requests_with_one_key_execute_once<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = Arc::new(default_server::<A, F>(&fx).await);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            server
                .post(Post::new("k-concurrent", "concurrent").sleep_ms(300))
                .await
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("request task"));
    }
    let firsts: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .collect();
    assert_eq!(firsts.len(), 1, "exactly one first execution: {replies:#?}");
    let first = firsts[0];
    let (mut conflicts, mut replays) = (0, 0);
    for r in &replies {
        match r.status {
            201 if r.replayed() => {
                assert_eq!(r.body, first.body, "a replay is the first response");
                replays += 1;
            }
            201 => {}
            409 => {
                assert_eq!(r.code(), "conflict");
                let after: u64 = r.headers["retry-after"]
                    .to_str()
                    .expect("ascii")
                    .parse()
                    .expect("whole seconds");
                // A hint (1 s by default), not the 30 s lease that remains.
                assert!((1..=2).contains(&after), "Retry-After {after}");
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert_eq!(conflicts + replays, 63);
    let server = Arc::try_unwrap(server).expect("no task left");
    assert_eq!(server.executions(), 1);
    assert_eq!(fx.count_effects("concurrent").await, 1);
    // Afterwards, a retry is a replay.
    let again = server.post(Post::new("k-concurrent", "concurrent")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    done(server, fx).await;
}

/// A replay is byte identical and marked and the first is not.
pub async fn a_replay_is_byte_identical_and_marked_and_the_first_is_not<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    // The handler sets the marker itself here; the layer must strip it from a first response.
    let first = server
        .post(Post::new("k-replay", "replay").header("x-fake-replay", 1))
        .await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed(), "a first execution carries no marker");
    assert!(first.headers.contains_key("set-cookie"));
    assert!(first.headers.contains_key("x-not-stored"));
    for _ in 0..2 {
        let retry = server.post(Post::new("k-replay", "replay")).await;
        assert_eq!(retry.status, first.status);
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body, "body byte for byte");
        assert_eq!(kept(&retry), kept(&first), "kept headers");
        assert!(
            !retry.headers.contains_key("set-cookie"),
            "never Set-Cookie"
        );
        assert!(!retry.headers.contains_key("x-not-stored"));
        assert_eq!(retry.headers["x-stored"], "kept-1");
        assert_eq!(retry.headers["location"], "/charges/1");
    }
    assert_eq!(server.executions(), 1);
    assert_eq!(fx.count_effects("replay").await, 1);
    done(server, fx).await;
}

/// Another body with the same key is 422 and the original still replays.
pub async fn another_body_with_the_same_key_is_422_and_the_original_still_replays<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let first = server.post(Post::new("k-reuse", "original")).await;
    assert_eq!(first.status, 201);
    let reused = server.post(Post::new("k-reuse", "different")).await;
    assert_eq!(reused.status, 422);
    assert_eq!(reused.code(), "fingerprint-mismatch");
    assert!(!reused.replayed());
    let again = server.post(Post::new("k-reuse", "original")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(server.executions(), 1);
    assert_eq!(fx.count_effects("different").await, 0);
    done(server, fx).await;
}

/// A missing key on a required route is 400 and nothing runs.
pub async fn a_missing_key_on_a_required_route_is_400_and_nothing_runs<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let r = server
        .post(Post::new("unused", "keyless").keys(Vec::new()))
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.code(), "missing-key");
    assert_eq!(server.executions(), 0);
    assert_eq!(fx.count_records().await, 0);
    done(server, fx).await;
}

/// Malformed and doubled keys are 400.
pub async fn malformed_and_doubled_keys_are_400<A: HttpFramework, F: HttpFixture>(test: &str) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let long = "k".repeat(256);
    let cases: Vec<(&str, Vec<HeaderValue>)> = vec![
        ("empty", vec![HeaderValue::from_static("")]),
        ("empty sf-string", vec![HeaderValue::from_static("\"\"")]),
        (
            "256 bytes",
            vec![HeaderValue::from_str(&long).expect("ascii")],
        ),
        (
            "256 bytes, sf-string",
            vec![HeaderValue::from_str(&format!("\"{long}\"")).expect("ascii")],
        ),
        (
            "non-ASCII",
            vec![HeaderValue::from_bytes("\"clé\"".as_bytes()).expect("obs-text")],
        ),
        (
            "non-ASCII, bare",
            vec![HeaderValue::from_bytes("clé-1".as_bytes()).expect("obs-text")],
        ),
        (
            "unterminated sf-string",
            vec![HeaderValue::from_static("\"abc")],
        ),
        ("bad escape", vec![HeaderValue::from_static("\"a\\nb\"")]),
        ("space", vec![HeaderValue::from_static("a b")]),
        (
            "doubled",
            vec![
                HeaderValue::from_static("\"a\""),
                HeaderValue::from_static("\"a\""),
            ],
        ),
        (
            "doubled, different",
            vec![HeaderValue::from_static("a"), HeaderValue::from_static("b")],
        ),
    ];
    for (what, keys) in cases {
        let r = server.post(Post::new("x", "malformed").keys(keys)).await;
        assert_eq!(r.status, 400, "{what}: {r:?}");
        assert_eq!(r.code(), "invalid-key", "{what}");
    }
    // At the limit, and as a bare Stripe-style token, keys are fine.
    let r = server
        .post(Post::new("x", "fine").keys(vec![
            HeaderValue::from_str(&"k".repeat(255)).expect("ascii"),
        ]))
        .await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(server.executions(), 1);
    assert_eq!(fx.count_effects("malformed").await, 0);
    assert_eq!(fx.count_records().await, 1);
    done(server, fx).await;
}

/// Two principals with one key execute twice.
pub async fn two_principals_with_one_key_execute_twice<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let alice = server.post(Post::new("k-shared", "both")).await;
    let bob = server
        .post(Post::new("k-shared", "both").principal(Some("bob")))
        .await;
    for r in [&alice, &bob] {
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    assert_ne!(alice.execution(), bob.execution());
    // Each replays their own.
    let alice_again = server.post(Post::new("k-shared", "both")).await;
    assert_eq!(alice_again.body, alice.body);
    let bob_again = server
        .post(Post::new("k-shared", "both").principal(Some("bob")))
        .await;
    assert_eq!(bob_again.body, bob.body);
    // Bob's request in flight does not block Alice's with the same key.
    let bob_slow = server.send(
        Post::new("k-other", "other")
            .principal(Some("bob"))
            .sleep_ms(800),
    );
    let alice_meanwhile = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        server.post(Post::new("k-other", "other")).await
    };
    let (bob_slow, alice_meanwhile) = tokio::join!(bob_slow, alice_meanwhile);
    let bob_slow = bob_slow.expect("bob's response");
    assert_eq!((bob_slow.status, bob_slow.replayed()), (201, false));
    assert_eq!(
        (alice_meanwhile.status, alice_meanwhile.replayed()),
        (201, false),
        "{alice_meanwhile:?}"
    );
    let anonymous = server
        .post(Post::new("k-shared", "both").principal(None))
        .await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(anonymous.code(), "missing-principal");
    // RFC 9110 §15.5.2: a 401 carries a challenge.
    assert_eq!(
        anonymous
            .headers
            .get("www-authenticate")
            .map(|v| v.as_bytes()),
        Some(&b"Bearer"[..]),
        "{anonymous:?}"
    );
    assert_eq!(server.executions(), 4);
    assert_eq!(fx.count_effects("both").await, 2);
    done(server, fx).await;
}

/// A 5xx is not stored its writes roll back and the retry runs.
pub async fn a_5xx_is_not_stored_its_writes_roll_back_and_the_retry_runs<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let failed = server.post(Post::new("k-5xx", "fails").status(500)).await;
    assert_eq!(failed.status, 500);
    assert!(!failed.replayed());
    if F::SHARED_TRANSACTION {
        assert_eq!(
            fx.count_effects("fails").await,
            0,
            "a 500 rolled its writes back"
        );
    }
    assert_eq!(fx.count_records().await, 0, "the key is free again");
    let retry = server.post(Post::new("k-5xx", "fails")).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "the retry executed");
    assert_eq!(server.executions(), 2);
    let expected = if F::SHARED_TRANSACTION { 1 } else { 2 };
    assert_eq!(fx.count_effects("fails").await, expected);
    // 503 and 429 are not stored either.
    for status in [503, 429, 409, 408, 425] {
        let key = format!("k-{status}");
        let r = server
            .post(Post::new(&key, "transient").status(status))
            .await;
        assert_eq!(r.status, status);
        let r = server.post(Post::new(&key, "transient")).await;
        assert_eq!((r.status, r.replayed()), (201, false), "after {status}");
    }
    done(server, fx).await;
}

/// A panicking handler is not stored and rolls back.
pub async fn a_panicking_handler_is_not_stored_and_rolls_back<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let crashed = server
        .send(Post::new("k-panic", "panics").header("x-panic", 1))
        .await;
    assert!(crashed.is_err() || crashed.is_ok_and(|r| r.status >= 500));
    if F::SHARED_TRANSACTION {
        assert_eq!(fx.count_effects("panics").await, 0);
    }
    let retry = server.post(Post::new("k-panic", "panics")).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(server.executions(), 2);
    done(server, fx).await;
}

/// A 4xx is stored and replayed.
pub async fn a_4xx_is_stored_and_replayed<A: HttpFramework, F: HttpFixture>(test: &str) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let refused = server.post(Post::new("k-4xx", "refused").status(404)).await;
    assert_eq!(refused.status, 404);
    assert!(!refused.replayed());
    // The retry asks for a 201: it gets the stored 404.
    let retry = server.post(Post::new("k-4xx", "refused")).await;
    assert_eq!(retry.status, 404);
    assert!(retry.replayed());
    assert_eq!(retry.body, refused.body);
    assert_eq!(server.executions(), 1);
    assert_eq!(
        fx.count_effects("refused").await,
        1,
        "a stored 4xx commits its writes"
    );
    done(server, fx).await;
}

/// A late completion with a stale fence is rejected.
pub async fn a_late_completion_with_a_stale_fence_is_rejected<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = Arc::new(
        // The leased mode: a record taken in one transaction is held as long as its
        // transaction, never taken over under it (the request conformance checks that).
        serve::<A, F>(Arc::clone(&fx), fx.store(), |b| {
            b.lease(Duration::from_secs(1))
                .without_heartbeat()
                .leased_only()
        })
        .await,
    );
    let slow = {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            server
                .post(Post::new("k-fence", "fenced").sleep_ms(2500))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    let retry = server.post(Post::new("k-fence", "fenced")).await;
    let took = started.elapsed();
    let slow = slow.await.expect("slow request");
    if F::TAKEOVER_WHILE_HOLDER_RUNS {
        // The retry took the lapsed lease over and ran; the slow one's completion was refused.
        assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
        assert_eq!(slow.status, 409, "{slow:?}");
        // Not the in-flight `conflict`: this execution ran, and its response was not stored.
        assert_eq!(slow.code(), "lease-lost");
        let replay = server.post(Post::new("k-fence", "fenced")).await;
        assert!(replay.replayed());
        assert_eq!(
            replay.body, retry.body,
            "the takeover's response is the stored one"
        );
        assert_eq!(server.executions(), 2);
        let expected = if F::SHARED_TRANSACTION { 1 } else { 2 };
        assert_eq!(
            fx.count_effects("fenced").await,
            expected,
            "the fenced-out execution's writes rolled back"
        );
    } else {
        // SQLite: the holder's open transaction keeps the write lock, so the lapsed lease
        // cannot be taken over under it; the retry is told so at once.
        assert_eq!(retry.status, 409, "{retry:?}");
        assert!(
            took < Duration::from_secs(1),
            "answered at once, not after {took:?}"
        );
        assert_eq!((slow.status, slow.replayed()), (201, false));
        let replay = server.post(Post::new("k-fence", "fenced")).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, slow.body);
        assert_eq!(server.executions(), 1);
        assert_eq!(fx.count_effects("fenced").await, 1);
    }
    let server = Arc::try_unwrap(server).expect("no task left");
    done(server, fx).await;
}

/// A heartbeat keeps a long request in progress.
pub async fn a_heartbeat_keeps_a_long_request_in_progress<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = Arc::new(
        serve::<A, F>(Arc::clone(&fx), fx.store(), |b| {
            b.lease(Duration::from_secs(1))
                .heartbeat(Duration::from_millis(250))
        })
        .await,
    );
    let slow = {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            server
                .post(Post::new("k-heartbeat", "long").sleep_ms(2500))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let started = Instant::now();
    let retry = server.post(Post::new("k-heartbeat", "long")).await;
    assert_eq!(retry.status, 409, "the lease is still held: {retry:?}");
    assert_eq!(retry.code(), "conflict");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "answered at once"
    );
    let slow = slow.await.expect("slow request");
    assert_eq!((slow.status, slow.replayed()), (201, false));
    assert_eq!(server.executions(), 1);
    let server = Arc::try_unwrap(server).expect("no task left");
    done(server, fx).await;
}

/// An expired record executes again and is reaped.
pub async fn an_expired_record_executes_again_and_is_reaped<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = serve::<A, F>(Arc::clone(&fx), fx.store(), |b| {
        b.ttl(Duration::from_secs(2))
            .lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(300))
    })
    .await;
    let first = server.post(Post::new("k-ttl", "ttl")).await;
    assert_eq!(first.status, 201);
    assert!(server.post(Post::new("k-ttl", "ttl")).await.replayed());
    tokio::time::sleep(Duration::from_millis(2300)).await;
    // Redis may already have dropped the expired keys by itself.
    let before = fx.count_records().await;
    let reaped = reap_all(&fx.store(), 10).await.expect("reap");
    assert_eq!(reaped, before as u64);
    assert_eq!(fx.count_records().await, 0);
    let again = server.post(Post::new("k-ttl", "ttl")).await;
    assert_eq!(
        (again.status, again.replayed()),
        (201, false),
        "executed again"
    );
    assert_ne!(again.execution(), first.execution());
    // Expired but not reaped: executes again too.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let third = server.post(Post::new("k-ttl", "ttl")).await;
    assert_eq!((third.status, third.replayed()), (201, false));
    assert_eq!(server.executions(), 3);
    done(server, fx).await;
}

/// A request over the limit is 413 and records nothing.
pub async fn a_request_over_the_limit_is_413_and_records_nothing<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    // A declared length over the limit is refused before a byte of the body is read. The
    // server then closes the connection; a client still writing the body may see a broken
    // pipe before the answer (reqwest does, sometimes), so this one speaks HTTP/1.1 itself and
    // sends only the head.
    let head = format!(
        "POST /charges HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         x-principal: alice\r\nidempotency-key: \"k-big\"\r\ncontent-length: {}\r\n\r\n",
        REQUEST_LIMIT + 1
    );
    let answer = raw_http(&server.base, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("\"code\":\"body-too-large\""), "{answer}");
    // Without a Content-Length (chunked), the limit holds while reading.
    let mut chunked = b"POST /charges HTTP/1.1\r\nhost: test\r\nx-principal: alice\r\n\
        idempotency-key: k-chunked\r\ntransfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..=REQUEST_LIMIT / 1024 {
        chunked.extend_from_slice(b"400\r\n");
        chunked.extend_from_slice(&[b' '; 1024]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let answer = raw_http(&server.base, &chunked).await;
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    // Just under the limit is fine.
    let r = server
        .post(Post::new("k-fits", "fits").raw_body(vec![b' '; REQUEST_LIMIT]))
        .await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(server.executions(), 1);
    assert_eq!(
        fx.count_records().await,
        1,
        "only the request that fit left a record"
    );
    done(server, fx).await;
}

/// A response over the storage limit replays marked omitted.
pub async fn a_response_over_the_storage_limit_replays_marked_omitted<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let body = json!({ "effect": "huge", "pad": STORAGE_LIMIT });
    let first = server
        .post(Post::new("k-huge", "huge").body(body.clone()))
        .await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert!(first.body.len() > STORAGE_LIMIT, "the client got all of it");
    assert!(
        first.json()["pad"]
            .as_str()
            .is_some_and(|p| p.len() == STORAGE_LIMIT)
    );
    let retry = server.post(Post::new("k-huge", "huge").body(body)).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.headers["idempotent-body-omitted"], "true");
    assert!(retry.body.is_empty());
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(server.executions(), 1, "a retry never executes again");
    assert_eq!(fx.count_effects("huge").await, 1);
    // A body within the limit carries no omitted mark.
    let small = server.post(Post::new("k-small", "small")).await;
    assert!(!small.headers.contains_key("idempotent-body-omitted"));
    let small = server.post(Post::new("k-small", "small")).await;
    assert!(small.replayed() && !small.headers.contains_key("idempotent-body-omitted"));
    done(server, fx).await;
}

/// A key on get is ignored and records nothing.
pub async fn a_key_on_get_is_ignored_and_records_nothing<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    for _ in 0..2 {
        let r = server.get("k-get").await;
        assert_eq!(r.status, 200);
        assert!(!r.replayed());
    }
    assert_eq!(
        server.state.gets.load(std::sync::atomic::Ordering::SeqCst),
        2
    );
    assert_eq!(fx.count_records().await, 0);
    done(server, fx).await;
}

/// A store outage is 503 and the handler does not run.
pub async fn a_store_outage_is_503_and_the_handler_does_not_run<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let down = fx.down_store().await;
    let server = serve::<A, F>(Arc::clone(&fx), down, |b| b).await;
    let r = server.post(Post::new("k-down", "down")).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.code(), "store-unavailable");
    assert_eq!(server.executions(), 0);
    assert_eq!(fx.count_effects("down").await, 0);
    done(server, fx).await;
}

/// Optional and off routes run without a record.
pub async fn optional_and_off_routes_run_without_a_record<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    // Optional, no key: runs every time, as if the layer were not there.
    for _ in 0..2 {
        let r = server
            .post(
                Post::new("unused", "optional")
                    .path("/optional")
                    .keys(Vec::new()),
            )
            .await;
        assert_eq!((r.status, r.replayed()), (201, false));
    }
    assert_eq!(fx.count_records().await, 0);
    // Optional, with a key: idempotent.
    let first = server
        .post(Post::new("k-opt", "optional").path("/optional"))
        .await;
    let again = server
        .post(Post::new("k-opt", "optional").path("/optional"))
        .await;
    assert!(!first.replayed() && again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(fx.count_records().await, 1);
    // Off: a key changes nothing.
    for _ in 0..2 {
        let r = server.post(Post::new("k-off", "off").path("/off")).await;
        assert_eq!((r.status, r.replayed()), (201, false));
    }
    assert_eq!(fx.count_records().await, 1);
    assert_eq!(server.executions(), 5);
    // The handler took no transaction without a record, so nothing was written for those.
    assert_eq!(fx.count_effects("off").await, 0);
    assert_eq!(fx.count_effects("optional").await, 1);
    done(server, fx).await;
}

/// Key headers outside the accepted format, beyond those of
/// `malformed_and_doubled_keys_are_400`: each is `400 invalid-key` with nothing recorded, and
/// the server serves a normal request afterwards.
pub async fn malformed_lists_obs_text_and_huge_keys_are_400_and_serving_goes_on<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let value = |bytes: &[u8]| HeaderValue::from_bytes(bytes).expect("a header value");
    let huge = vec![b'k'; 64 * 1024];
    let mut huge_sf = vec![b'"'];
    huge_sf.extend_from_slice(&huge);
    huge_sf.push(b'"');
    let cases: Vec<(&str, Vec<HeaderValue>)> = vec![
        ("text after the string", vec![value(b"\"a\"b")]),
        ("a list on one line", vec![value(b"\"a\", \"b\"")]),
        ("two bare keys joined by a proxy", vec![value(b"a, b")]),
        ("a trailing comma", vec![value(b"\"a\",")]),
        ("a parameter without a name", vec![value(b"\"a\";")]),
        ("a parameter with a bad value", vec![value(b"\"a\";v=?2")]),
        ("a backslash at the end", vec![value(b"\"a\\")]),
        ("an escaped letter", vec![value(b"\"a\\x\"")]),
        ("a tab inside the string", vec![value(b"\"a\tb\"")]),
        ("a tab inside a bare key", vec![value(b"a\tb")]),
        ("obs-text in the string", vec![value(b"\"k\xff\"")]),
        ("obs-text, bare", vec![value(b"\xe9t\xe9")]),
        ("UTF-8, bare", vec![value("\u{1F511}".as_bytes())]),
        ("a 64 KiB bare key", vec![value(&huge)]),
        ("a 64 KiB sf-string", vec![value(&huge_sf)]),
        ("doubled, one empty", vec![value(b"\"a\""), value(b"")]),
        ("tripled", vec![value(b"a"), value(b"a"), value(b"a")]),
    ];
    for (what, keys) in cases {
        let r = server.post(Post::new("x", "malformed").keys(keys)).await;
        assert_eq!(r.status, 400, "{what}: {r:?}");
        assert_eq!(r.code(), "invalid-key", "{what}");
    }
    assert_eq!(server.executions(), 0);
    assert_eq!(fx.count_records().await, 0);
    // Parameters are ignored and surrounding whitespace trimmed, and an sf-string may hold
    // spaces (RFC 8941 §3.3.3): these are keys.
    for (n, key) in [
        &b"\"p-1\";v=1;x"[..],
        b"  \"p-2\"  ",
        b"a,b",
        b"\"order 42\"",
    ]
    .iter()
    .enumerate()
    {
        let r = server
            .post(Post::new("x", &format!("fine-{n}")).keys(vec![value(key)]))
            .await;
        assert_eq!(r.status, 201, "{:?}: {r:?}", String::from_utf8_lossy(key));
    }
    let r = server.post(Post::new("k-after-bad-keys", "after")).await;
    assert_eq!(r.status, 201, "the server still serves: {r:?}");
    assert_eq!(fx.count_effects("malformed").await, 0);
    assert_eq!(fx.count_effects("after").await, 1);
    done(server, fx).await;
}

/// A body shorter than its `Content-Length`, the client gone before the rest: `400
/// invalid-body` (to a client that half-closed and still reads), the handler never runs,
/// nothing is recorded, and the same key then executes normally.
pub async fn a_truncated_body_is_400_records_nothing_and_serving_goes_on<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let body = br#"{"effect":"truncated"}"#;
    let head = format!(
        "POST /charges HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         x-principal: alice\r\nidempotency-key: \"k-truncated\"\r\ncontent-length: {}\r\n\r\n",
        body.len() + 100
    );
    let mut conn = tokio::net::TcpStream::connect(server.base.trim_start_matches("http://"))
        .await
        .expect("connect");
    conn.write_all(head.as_bytes()).await.expect("head");
    conn.write_all(body).await.expect("part of the body");
    conn.shutdown().await.expect("half-close");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
        .await
        .expect("the server answers and closes, it does not wait for the rest")
        .expect("read the answer");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(answer.contains("\"code\":\"invalid-body\""), "{answer}");
    // A client that closes outright gets nothing, and changes nothing either.
    let mut gone = tokio::net::TcpStream::connect(server.base.trim_start_matches("http://"))
        .await
        .expect("connect");
    gone.write_all(head.as_bytes()).await.expect("head");
    gone.write_all(&body[..5]).await.expect("part of the body");
    drop(gone);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(server.executions(), 0, "the handler never ran");
    assert_eq!(fx.count_records().await, 0, "nothing recorded");
    let r = server.post(Post::new("k-truncated", "truncated")).await;
    assert_eq!(
        r.status, 201,
        "the key is free and the server serves: {r:?}"
    );
    assert!(!r.replayed());
    assert_eq!(fx.count_effects("truncated").await, 1);
    done(server, fx).await;
}

/// A client that sends its request and disconnects while the handler runs: the server drops
/// the request, the execution is abandoned (its writes roll back on the stores that share a
/// transaction with them, the key is freed), and a
/// retry with the same key runs the handler again — answered at once, `409` with
/// `Retry-After` only until the key is freed, never a hang. A framework that runs the handler
/// to its end whatever the client does ([`HttpFramework::CANCELS_ON_DISCONNECT`] false) keeps
/// the key until then, and the first execution is stored.
pub async fn a_client_gone_mid_request_abandons_the_execution_and_the_retry_runs<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    use tokio::io::AsyncWriteExt;

    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let body = br#"{"effect":"gone"}"#;
    let request = format!(
        "POST /charges HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         x-principal: alice\r\nidempotency-key: \"k-gone\"\r\nx-sleep-ms: 3000\r\n\
         content-length: {}\r\n\r\n{}",
        body.len(),
        std::str::from_utf8(body).expect("utf-8")
    );
    let mut conn = tokio::net::TcpStream::connect(server.base.trim_start_matches("http://"))
        .await
        .expect("connect");
    conn.write_all(request.as_bytes()).await.expect("request");
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.executions() == 0 {
        assert!(Instant::now() < deadline, "the handler starts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The handler is asleep with its effect written in the open transaction.
    drop(conn);
    let started = Instant::now();
    if !A::CANCELS_ON_DISCONNECT {
        // The framework runs the handler to its end (actix-web): every retry meanwhile is
        // answered at once (`409` with `Retry-After`, never held), and once the handler is
        // done the first execution is the one stored and replayed.
        let replay = loop {
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                server.post(Post::new("k-gone", "gone")),
            )
            .await
            .expect("the retry is answered, not held");
            if r.status != 409 {
                break r;
            }
            assert_eq!(r.code(), "conflict");
            assert!(r.headers.contains_key("retry-after"), "{r:?}");
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the key is freed when the handler ends"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            (replay.status, replay.replayed()),
            (201, true),
            "{replay:?}"
        );
        assert_eq!(server.executions(), 1, "the handler ran once");
        assert_eq!(fx.count_effects("gone").await, 1);
        return done(server, fx).await;
    }
    let retry = loop {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            server.post(Post::new("k-gone", "gone")),
        )
        .await
        .expect("the retry is answered, not held");
        if r.status != 409 {
            break r;
        }
        assert_eq!(r.code(), "conflict");
        assert!(r.headers.contains_key("retry-after"), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the key is freed when the client goes, not when the lease or the handler ends"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(
        !retry.replayed(),
        "the first execution was abandoned, not completed: {retry:?}"
    );
    assert_eq!(server.executions(), 2, "the retry ran the handler again");
    // Redis shares no transaction with the effect: there the first write stays.
    let expected = if F::SHARED_TRANSACTION { 1 } else { 2 };
    assert_eq!(
        fx.count_effects("gone").await,
        expected,
        "the abandoned execution's writes rolled back"
    );
    let again = server.post(Post::new("k-gone", "gone")).await;
    assert!(
        again.replayed(),
        "the retry's response is the stored one: {again:?}"
    );
    done(server, fx).await;
}

/// Issue 19, point 1: the key a handler derives for an external call is its record's —
/// distinct per principal and route, the same on every execution of one record.
pub async fn two_principals_with_one_key_derive_two_external_keys<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let derived = |r: &Reply| {
        r.json()["derived"]
            .as_str()
            .expect("a derived key")
            .to_owned()
    };
    let alice = server
        .post(Post::new("order-42", "d").path("/derive"))
        .await;
    let bob = server
        .post(
            Post::new("order-42", "d")
                .path("/derive")
                .principal(Some("bob")),
        )
        .await;
    assert_eq!((alice.status, bob.status), (201, 201), "{alice:?} {bob:?}");
    assert_ne!(
        derived(&alice),
        derived(&bob),
        "two tenants sending one Idempotency-Key must not send one key to a third party"
    );
    assert_eq!(derived(&alice).len(), 36, "a UUID");
    // Another route, same principal and key: another key.
    let v1 = server
        .post(Post::new("order-42", "d").path("/v1/derive"))
        .await;
    assert_ne!(derived(&v1), derived(&alice));
    // An execution that is not stored (a 5xx) and the retry that runs again derive the same.
    let failed = server
        .post(Post::new("order-43", "d").path("/derive").status(503))
        .await;
    assert_eq!(failed.status, 503);
    let retried = server
        .post(Post::new("order-43", "d").path("/derive"))
        .await;
    assert_eq!((retried.status, retried.replayed()), (201, false));
    assert_eq!(derived(&failed), derived(&retried));
    done(server, fx).await;
}

/// Issue 19, point 2: a request an extractor refused before the handler ran (axum's `Json`:
/// 415, 422, 400) is not stored, so the corrected retry with the same key runs; a 4xx the
/// handler decided on is; `Content-Type` is part of the fingerprint.
pub async fn an_extractor_rejection_is_not_stored_and_the_corrected_retry_runs<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let order = || Post::new("k-json", "json").path("/json");
    let refused = server.post(order().content_type("text/plain")).await;
    assert_eq!(refused.status, 415, "{refused:?}");
    let missing_field = server.post(order().body(json!({ "not-effect": 1 }))).await;
    assert_eq!(missing_field.status, 422, "{missing_field:?}");
    let not_json = server.post(order().raw_body(b"{".to_vec())).await;
    assert_eq!(not_json.status, 400, "{not_json:?}");
    assert_eq!(server.executions(), 0, "the handler never ran");
    assert_eq!(fx.count_records().await, 0, "the key is free");
    let corrected = server.post(order()).await;
    assert_eq!(
        (corrected.status, corrected.replayed()),
        (201, false),
        "the corrected retry runs: {corrected:?}"
    );
    let again = server.post(order()).await;
    assert!(
        again.replayed() && again.body == corrected.body,
        "{again:?}"
    );
    // The same bytes in another media type are another request.
    let other_type = server
        .post(order().content_type("application/json; charset=utf-8"))
        .await;
    assert_eq!(other_type.status, 422, "{other_type:?}");
    assert_eq!(other_type.code(), "fingerprint-mismatch");
    let detail = other_type.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains("Content-Type") && !detail.contains("method, path"),
        "the detail says what may differ: {detail}"
    );
    assert_eq!(fx.count_effects("json").await, 1);
    // A handler without any idem extractor: its 4xx is not stored unless it says it executed.
    let unmarked = server
        .post(Post::new("k-plain", "p").path("/plain").status(404))
        .await;
    assert_eq!(unmarked.status, 404);
    let rerun = server.post(Post::new("k-plain", "p").path("/plain")).await;
    assert_eq!((rerun.status, rerun.replayed()), (201, false), "{rerun:?}");
    let marked = server
        .post(
            Post::new("k-marked", "p")
                .path("/plain")
                .status(404)
                .header("x-executed", 1),
        )
        .await;
    assert_eq!((marked.status, marked.replayed()), (404, false));
    let replayed = server.post(Post::new("k-marked", "p").path("/plain")).await;
    assert_eq!(
        (replayed.status, replayed.replayed()),
        (404, true),
        "{replayed:?}"
    );
    assert_eq!(replayed.body, marked.body);
    done(server, fx).await;
}

/// Issue 19, point 8: under `Router::nest` the scope holds the path the client sent, so one
/// key on `/v1/charges` and `/v2/charges` is two records.
pub async fn nested_routes_keep_their_prefix_in_the_scope<A: HttpFramework, F: HttpFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let v1 = server
        .post(Post::new("k-nested", "nested").path("/v1/charges"))
        .await;
    let v2 = server
        .post(Post::new("k-nested", "nested").path("/v2/charges"))
        .await;
    for r in [&v1, &v2] {
        assert_eq!((r.status, r.replayed()), (201, false), "{r:?}");
    }
    assert_ne!(v1.execution(), v2.execution());
    let v1_again = server
        .post(Post::new("k-nested", "nested").path("/v1/charges"))
        .await;
    assert!(v1_again.replayed() && v1_again.body == v1.body);
    assert_eq!(server.executions(), 2);
    assert_eq!(fx.count_records().await, 2);
    done(server, fx).await;
}
