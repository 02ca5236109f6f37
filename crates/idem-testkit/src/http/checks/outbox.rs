//! Issue 21, point 1: the outbox through real HTTP. `POST /emit` enqueues messages through
//! the request's [`emitter`](idem_http::IdemRequest::emitter) in the request's transaction;
//! these checks read the store's outbox as a relay leases it and recompute every ID through
//! idem-http's public [`Principal::emitter`] — never from the server's answer alone — so an ID
//! that is random, or derived from anything but (principal, method, path, key), fails them,
//! and so does a message enqueued outside the request's transaction.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use idem_core::outbox::OutboxRow;
use idem_core::{IdempotencyKey, MessageId};
use idem_http::Principal;
use serde_json::json;

use super::{default_server, done};
use crate::http::{EMIT_DEFAULT, EMIT_DESTINATION, HttpFixture, HttpFramework, Post, Reply, serve};

/// The IDs of the `n` messages `principal`'s `POST path` with `key` enqueues, recomputed as
/// anyone outside the request can.
fn expected(principal: &str, path: &str, key: &str, n: u64) -> Vec<MessageId> {
    let key = IdempotencyKey::new(key).expect("a valid key");
    let mut emitter = Principal::new(principal).emitter(&Method::POST, path, &key);
    (0..n).map(|_| emitter.next_id()).collect()
}

fn ids(rows: &[OutboxRow]) -> Vec<MessageId> {
    rows.iter().map(|r| r.message.id().clone()).collect()
}

fn as_strings(ids: &[MessageId]) -> Vec<String> {
    ids.iter()
        .map(|id| String::from_utf8_lossy(id.as_bytes()).into_owned())
        .collect()
}

/// The rows of `effect`'s messages as execution `execution` of `POST /emit` writes them: for
/// [`EMIT_DESTINATION`], the payload naming the effect, the position and the execution (so a
/// row another execution wrote, outside the transaction of the one whose response is stored,
/// shows).
fn assert_messages(rows: &[OutboxRow], effect: &str, execution: u64) {
    for (position, row) in rows.iter().enumerate() {
        assert_eq!(row.message.destination(), EMIT_DESTINATION);
        let payload: serde_json::Value =
            serde_json::from_slice(row.message.payload()).expect("a JSON payload");
        assert_eq!(
            payload,
            json!({ "effect": effect, "position": position, "execution": execution }),
            "the messages of the execution whose response is stored"
        );
    }
}

fn first_execution(r: &Reply) {
    assert_eq!((r.status, r.replayed()), (201, false), "{r:?}");
}

/// One request enqueues exactly its messages, under the IDs derived from its scoped key, with
/// its effect; every retry replays the stored response and enqueues nothing more.
pub async fn an_emitting_request_enqueues_its_messages_under_derived_ids_once<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let want = expected("alice", "/emit", "k-emit", EMIT_DEFAULT);
    let first = server
        .post(Post::new("k-emit", "emitted").emitting(EMIT_DEFAULT))
        .await;
    first_execution(&first);
    assert_eq!(first.emitted(), as_strings(&want), "the handler's emitter");
    let rows = fx.outbox().await;
    assert_eq!(
        ids(&rows),
        want,
        "exactly its messages, the derived IDs in order"
    );
    assert_messages(&rows, "emitted", first.execution());
    assert_eq!(fx.count_effects("emitted").await, 1);
    for _ in 0..2 {
        let retry = server
            .post(Post::new("k-emit", "emitted").emitting(EMIT_DEFAULT))
            .await;
        assert!(retry.replayed() && retry.body == first.body, "{retry:?}");
    }
    assert_eq!(ids(&fx.outbox().await), want, "a replay enqueues nothing");
    assert_eq!(server.executions(), 1);
    // Another key is another request: its own messages, none of the first's IDs.
    let other = server
        .post(Post::new("k-emit-2", "second").emitting(1))
        .await;
    first_execution(&other);
    let second = expected("alice", "/emit", "k-emit-2", 1);
    assert!(!want.contains(&second[0]));
    assert_eq!(ids(&fx.outbox().await), [want, second].concat());
    done(server, fx).await;
}

/// The key reused for another body is `422` before the handler runs: nothing is enqueued, and
/// the original still replays.
pub async fn another_body_with_an_emitting_key_is_422_and_enqueues_nothing<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let first = server
        .post(Post::new("k-reused", "original").emitting(2))
        .await;
    first_execution(&first);
    let want = expected("alice", "/emit", "k-reused", 2);
    assert_eq!(ids(&fx.outbox().await), want);
    for other in [
        Post::new("k-reused", "different").emitting(2),
        Post::new("k-reused", "original").emitting(5),
    ] {
        let reused = server.post(other).await;
        assert_eq!(reused.status, 422, "{reused:?}");
        assert_eq!(reused.code(), "fingerprint-mismatch");
    }
    assert_eq!(
        ids(&fx.outbox().await),
        want,
        "no message of the refused requests"
    );
    assert_eq!(fx.count_effects("different").await, 0);
    let again = server
        .post(Post::new("k-reused", "original").emitting(2))
        .await;
    assert!(again.replayed() && again.body == first.body, "{again:?}");
    assert_eq!(server.executions(), 1);
    done(server, fx).await;
}

/// A handler that fails — a 5xx, a panic — after enqueueing leaves no message: its messages
/// roll back with its effect. The retry that succeeds enqueues them exactly once, under the
/// same IDs the failed runs derived. A stored 4xx commits its messages like a 2xx.
pub async fn a_failed_emitting_request_enqueues_nothing_and_its_retry_enqueues_once<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let want = expected("alice", "/emit", "k-fails", EMIT_DEFAULT);
    let order = || Post::new("k-fails", "fails").emitting(EMIT_DEFAULT);
    for status in [500, 503] {
        let failed = server.post(order().status(status)).await;
        assert_eq!((failed.status, failed.replayed()), (status, false));
        assert_eq!(
            failed.emitted(),
            as_strings(&want),
            "the same IDs every run"
        );
        assert!(
            fx.outbox().await.is_empty(),
            "a {status} rolled its messages back"
        );
    }
    let crashed = server.send(order().header("x-panic", 1)).await;
    assert!(crashed.is_err() || crashed.is_ok_and(|r| r.status >= 500));
    assert!(
        fx.outbox().await.is_empty(),
        "a panic rolled its messages back"
    );
    assert_eq!(fx.count_effects("fails").await, 0);
    assert_eq!(fx.count_records().await, 0, "the key is free");
    let retry = server.post(order()).await;
    first_execution(&retry);
    let rows = fx.outbox().await;
    assert_eq!(
        ids(&rows),
        want,
        "the successful retry enqueues exactly once"
    );
    assert_messages(&rows, "fails", retry.execution());
    let again = server.post(order()).await;
    assert!(again.replayed() && again.body == retry.body, "{again:?}");
    assert_eq!(ids(&fx.outbox().await), want);
    assert_eq!(server.executions(), 4);
    assert_eq!(fx.count_effects("fails").await, 1);
    // A 4xx the handler answered is stored, and its messages commit with it.
    let refused = server
        .post(Post::new("k-refused", "refused").emitting(1).status(404))
        .await;
    assert_eq!((refused.status, refused.replayed()), (404, false));
    let replayed = server
        .post(Post::new("k-refused", "refused").emitting(1))
        .await;
    assert_eq!((replayed.status, replayed.replayed()), (404, true));
    let refused_ids = expected("alice", "/emit", "k-refused", 1);
    assert_eq!(ids(&fx.outbox().await), [want, refused_ids].concat());
    done(server, fx).await;
}

/// Concurrent requests with one key: one execution, its messages once.
pub async fn concurrent_emitting_requests_with_one_key_enqueue_once<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = Arc::new(default_server::<A, F>(&fx).await);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            server
                .post(
                    Post::new("k-race", "race")
                        .emitting(EMIT_DEFAULT)
                        .sleep_ms(300),
                )
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
    let first = firsts[0].execution();
    for r in &replies {
        assert!(
            r.status == 409 || (r.status == 201 && !r.emitted().is_empty()),
            "{r:?}"
        );
    }
    let server = Arc::try_unwrap(server).expect("no task left");
    assert_eq!(server.executions(), 1);
    let rows = fx.outbox().await;
    assert_eq!(
        ids(&rows),
        expected("alice", "/emit", "k-race", EMIT_DEFAULT),
        "one execution's messages, once"
    );
    assert_messages(&rows, "race", first);
    done(server, fx).await;
}

/// A request that outlives its lease (no heartbeat) is taken over by its retry: the takeover's
/// messages are the ones enqueued, once, and the fenced-out execution's — under the same
/// derived IDs — roll back with its refused completion. (SQLite: the holder's open transaction
/// keeps the write lock, so the retry is told `409` and the holder's messages commit.)
pub async fn a_fenced_out_execution_enqueues_nothing_and_the_takeover_enqueues_once<
    A: HttpFramework,
    F: HttpFixture,
>(
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
    let order = || Post::new("k-fenced", "fenced").emitting(EMIT_DEFAULT);
    let slow = {
        let server = Arc::clone(&server);
        tokio::spawn(async move { server.post(order().sleep_ms(2500)).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = server.post(order()).await;
    let slow = slow.await.expect("slow request");
    let server = Arc::try_unwrap(server).expect("no task left");
    let rows = fx.outbox().await;
    assert_eq!(
        ids(&rows),
        expected("alice", "/emit", "k-fenced", EMIT_DEFAULT),
        "one execution's messages, once"
    );
    let stored = if F::TAKEOVER_WHILE_HOLDER_RUNS {
        first_execution(&retry);
        assert_eq!(slow.status, 409, "{slow:?}");
        assert_eq!(slow.code(), "lease-lost");
        retry.execution()
    } else {
        assert_eq!(retry.status, 409, "{retry:?}");
        first_execution(&slow);
        slow.execution()
    };
    assert_messages(&rows, "fenced", stored);
    assert_eq!(fx.count_effects("fenced").await, 1);
    done(server, fx).await;
}

/// Two principals (tenants) with one key are two requests: both enqueue, under distinct IDs —
/// a consumer downstream must not take one tenant's event for a duplicate of the other's.
/// Another path with the same key derives other IDs too.
pub async fn two_principals_with_one_key_enqueue_under_distinct_ids<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let alice = server
        .post(Post::new("order-42", "tenant").emitting(2))
        .await;
    let bob = server
        .post(
            Post::new("order-42", "tenant")
                .emitting(2)
                .principal(Some("bob")),
        )
        .await;
    first_execution(&alice);
    first_execution(&bob);
    let (want_alice, want_bob) = (
        expected("alice", "/emit", "order-42", 2),
        expected("bob", "/emit", "order-42", 2),
    );
    assert!(want_alice.iter().all(|id| !want_bob.contains(id)));
    assert_eq!(alice.emitted(), as_strings(&want_alice));
    assert_eq!(bob.emitted(), as_strings(&want_bob));
    let v1 = server
        .post(Post::new("order-42", "tenant").emitting(2).path("/v1/emit"))
        .await;
    first_execution(&v1);
    let want_v1 = expected("alice", "/v1/emit", "order-42", 2);
    assert!(want_v1.iter().all(|id| !want_alice.contains(id)));
    assert_eq!(
        ids(&fx.outbox().await),
        [want_alice, want_bob, want_v1].concat(),
        "each request's own messages"
    );
    assert_eq!(fx.count_effects("tenant").await, 3);
    done(server, fx).await;
}

/// Redis shares no transaction with the request, and idem says so in types: its store
/// implements no `OutboxStore`, so the handler's enqueue is refused ([`Enqueue::NoOutbox`],
/// answered `501 no-outbox`), never written somewhere that would not commit with the stored
/// response; the refusal is not stored, and nothing is enqueued. The emitter itself still
/// derives the request's IDs (they depend on the request only).
///
/// [`Enqueue::NoOutbox`]: crate::http::outbox::Enqueue::NoOutbox
pub async fn a_store_without_a_shared_transaction_refuses_the_outbox<
    A: HttpFramework,
    F: HttpFixture,
>(
    test: &str,
) {
    assert!(
        !F::SHARED_TRANSACTION,
        "for the stores that share no transaction"
    );
    let fx = fixture!(test);
    let server = default_server::<A, F>(&fx).await;
    let want = as_strings(&expected("alice", "/emit", "k-no-outbox", 2));
    for _ in 0..2 {
        let refused = server
            .post(Post::new("k-no-outbox", "unsent").emitting(2))
            .await;
        assert_eq!(refused.status, 501, "{refused:?}");
        assert_eq!(refused.code(), "no-outbox");
        let detail = refused.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            detail.contains("implements no OutboxStore")
                && detail.contains("shares no transaction"),
            "{detail}"
        );
        assert_eq!(refused.emitted(), want);
        assert!(!refused.replayed(), "a refusal is not stored");
    }
    assert_eq!(server.executions(), 2, "each retry runs again");
    assert_eq!(fx.count_records().await, 0);
    assert_eq!(fx.count_effects("unsent").await, 0);
    assert!(fx.outbox().await.is_empty());
    done(server, fx).await;
}
