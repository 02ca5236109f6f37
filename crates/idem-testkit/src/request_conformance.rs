//! The idempotent-request conformance checks ([`RequestStore`] and [`ReapRequests`]). Each
//! takes a fresh fixture, asserts one property against the real store, and tears it down.
//! Timings use short leases and TTLs of the store's own clock, so a few checks sleep a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::store::{ReapRequests, RequestStore, reap_all};
use idem_core::{
    Begin, BoxError, Fence, Fingerprint, IdempotencyKey, RequestAction, RequestErrorKind,
    RequestKey, RequestScope, TransactionalStore,
};
use idem_request::{Idempotency, Start};

use crate::request_fixture::RequestFixture;

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => fx,
            None => return,
        }
    };
}

fn key(scope: &str, key: &str) -> RequestKey {
    RequestKey::new(
        RequestScope::new([scope]),
        IdempotencyKey::new(key).expect("valid key"),
    )
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(body.as_bytes())
}

/// Looks `k` up with the fingerprint of `body`, under a long lease and TTL.
async fn lookup<S: RequestStore>(s: &S, k: &RequestKey, body: &str) -> Begin {
    s.begin_request(k, &fp(body), LONG, DAY)
        .await
        .expect("begin_request")
}

async fn acquire<S: RequestStore>(s: &S, k: &RequestKey, body: &str, lease: Duration) -> Fence {
    match s
        .begin_request(k, &fp(body), lease, DAY)
        .await
        .expect("begin")
    {
        Begin::Acquired { fence, .. } => fence,
        other => panic!("expected to take the record, got {other:?}"),
    }
}

/// Completes `k` under `fence` with `result` in a fresh transaction and commits.
async fn complete<S: RequestStore>(s: &S, k: &RequestKey, fence: Fence, result: &[u8]) {
    let mut tx = s.begin().await.expect("begin tx");
    s.complete_in(&mut tx, k, fence, result, DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
}

/// The first request takes the record; a retry meanwhile — even while the first holds its
/// transaction open — is told "in progress" at once, with a `Retry-After` of whole seconds
/// within the lease, and does not take it.
pub async fn a_retry_while_the_first_runs_is_in_progress_at_once<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-1");
    let fence = acquire(&s, &k, "body", LONG).await;
    let mut tx = s.begin().await.expect("begin tx");
    fx.record_effect(&mut tx, "k-1").await.expect("effect");
    let started = Instant::now();
    let retry = lookup(&s, &k, "body").await;
    let waited = started.elapsed();
    match retry {
        Begin::InProgress { retry_after } => {
            assert!(
                retry_after >= Duration::from_secs(1) && retry_after <= LONG,
                "{retry_after:?}"
            );
            assert_eq!(
                retry_after.subsec_nanos(),
                0,
                "whole seconds: {retry_after:?}"
            );
        }
        other => panic!("a retry during the first execution got {other:?}"),
    }
    assert!(
        waited < Duration::from_secs(2),
        "the retry waited {waited:?} for the first"
    );
    s.complete_in(&mut tx, &k, fence, b"done", DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
    fx.teardown().await;
}

/// A completed record replays exactly the bytes stored, to every retry.
pub async fn a_completed_request_replays_its_result_byte_for_byte<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-bytes");
    let fence = acquire(&s, &k, "body", LONG).await;
    let result: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    complete(&s, &k, fence, &result).await;
    for _ in 0..2 {
        match lookup(&s, &k, "body").await {
            Begin::Completed { result: stored } => assert!(stored == result, "replay differs"),
            other => panic!("expected the stored result, got {other:?}"),
        }
    }
    fx.teardown().await;
}

/// The same key with another fingerprint is a mismatch, in progress or completed, and the
/// record is untouched: a retry with the original request still gets its state.
pub async fn another_fingerprint_is_a_mismatch_and_leaves_the_record<F: RequestFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-fp");
    let fence = acquire(&s, &k, "original", LONG).await;
    let other = lookup(&s, &k, "changed").await;
    assert_eq!(other, Begin::Mismatch);
    complete(&s, &k, fence, b"first result").await;
    let other = lookup(&s, &k, "changed").await;
    assert_eq!(other, Begin::Mismatch);
    let again = lookup(&s, &k, "original").await;
    assert_eq!(
        again,
        Begin::Completed {
            result: b"first result".to_vec()
        }
    );
    fx.teardown().await;
}

/// A lease that ran out (its executor crashed) is taken over with a larger fence. The old
/// executor's late completion is refused — and on a store with a shared transaction its writes
/// roll back — while the new executor completes normally.
pub async fn a_lapsed_lease_is_taken_over_and_the_late_completion_refused<F: RequestFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-crash");
    let short = Duration::from_secs(1);
    let old = acquire(&s, &k, "body", short).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let (new, takeover) = match lookup(&s, &k, "body").await {
        Begin::Acquired { fence, takeover } => (fence, takeover),
        other => panic!("a lapsed lease was not taken over: {other:?}"),
    };
    assert!(
        takeover && new > old,
        "takeover {takeover}, fences {old:?} → {new:?}"
    );
    // The old executor wakes up and tries to finish.
    let mut late = s.begin().await.expect("begin tx");
    fx.record_effect(&mut late, "late").await.expect("effect");
    let err = s
        .complete_in(&mut late, &k, old, b"late", DAY)
        .await
        .expect_err("a stale fence must not complete");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::LeaseLost),
        "{err}"
    );
    let _ = s.rollback(late).await;
    if F::SHARED_TRANSACTION {
        assert_eq!(
            fx.count_effects("late").await,
            0,
            "the late executor's writes committed"
        );
    }
    assert!(
        !s.extend_lease(&k, old, LONG).await.expect("extend"),
        "a stale fence renewed"
    );
    s.release(&k, old).await.expect("stale release is a no-op");
    complete(&s, &k, new, b"new").await;
    let replay = lookup(&s, &k, "body").await;
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"new".to_vec()
        }
    );
    fx.teardown().await;
}

/// Releasing frees the key for the next request; a stale fence releases nothing.
pub async fn release_frees_the_key_and_a_stale_fence_frees_nothing<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-release");
    let first = acquire(&s, &k, "body", LONG).await;
    s.release(&k, first).await.expect("release");
    let second = acquire(&s, &k, "body", LONG).await;
    s.release(&k, first).await.expect("stale release");
    let busy = lookup(&s, &k, "body").await;
    assert!(
        matches!(busy, Begin::InProgress { .. }),
        "stale release freed it: {busy:?}"
    );
    s.release(&k, second).await.expect("release");
    acquire(&s, &k, "another body after release", LONG).await;
    fx.teardown().await;
}

/// A renewed lease keeps the record held past its original length.
pub async fn a_renewed_lease_keeps_the_record_held<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-renew");
    let fence = acquire(&s, &k, "body", Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        s.extend_lease(&k, fence, Duration::from_secs(5))
            .await
            .expect("extend")
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    let busy = lookup(&s, &k, "body").await;
    assert!(
        matches!(busy, Begin::InProgress { .. }),
        "renewed lease lapsed: {busy:?}"
    );
    fx.teardown().await;
}

/// A record past its TTL counts as absent — the key executes again — and the reaper deletes
/// expired records, not live ones.
pub async fn an_expired_record_executes_again_and_is_reaped<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let ttl = Duration::from_secs(1);
    let (expiring, kept) = (key("alice", "k-ttl"), key("alice", "k-kept"));
    for (k, ttl) in [(&expiring, ttl), (&kept, DAY)] {
        let Begin::Acquired { fence, .. } = s
            .begin_request(k, &fp("body"), ttl, ttl)
            .await
            .expect("begin")
        else {
            panic!("fresh key not acquired");
        };
        let mut tx = s.begin().await.expect("tx");
        s.complete_in(&mut tx, k, fence, b"r", ttl)
            .await
            .expect("complete");
        s.commit(tx).await.expect("commit");
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    // One expired record: a store that keeps expired rows deletes exactly it; a store whose
    // records expire by themselves (Redis key expiry) finds nothing left to delete.
    let reaped = reap_all(&s, 1).await.expect("reap");
    let expected = if F::EXPIRES_ITSELF { 0 } else { 1 };
    assert_eq!(
        reaped, expected,
        "the reaper deleted {reaped} records; {expected} was due"
    );
    let again = lookup(&s, &expiring, "new body").await;
    assert!(
        matches!(again, Begin::Acquired { .. }),
        "expired key did not execute again: {again:?}"
    );
    let replay = lookup(&s, &kept, "body").await;
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"r".to_vec()
        }
    );
    assert_eq!(s.reap_batch(100).await.expect("reap"), 0);
    fx.teardown().await;
}

/// 32 concurrent first requests with one key: exactly one takes the record.
pub async fn concurrent_first_requests_take_the_record_once<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-race");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (s, k) = (s.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            s.begin_request(&k, &fp("body"), LONG, DAY).await
        }));
    }
    let mut acquired = 0;
    for t in tasks {
        match t.await.expect("task").expect("begin") {
            Begin::Acquired { .. } => acquired += 1,
            Begin::InProgress { .. } => {}
            other => panic!("unexpected answer under contention: {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
    fx.teardown().await;
}

/// The same key in two scopes (two principals) is two independent records.
pub async fn scopes_never_share_records<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let (alice, bob) = (key("alice", "shared-key"), key("bob", "shared-key"));
    let a = acquire(&s, &alice, "alice's body", LONG).await;
    let b = acquire(&s, &bob, "bob's body", LONG).await;
    complete(&s, &alice, a, b"alice's result").await;
    let busy = lookup(&s, &bob, "bob's body").await;
    assert!(matches!(busy, Begin::InProgress { .. }), "{busy:?}");
    complete(&s, &bob, b, b"bob's result").await;
    let replay = lookup(&s, &bob, "bob's body").await;
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"bob's result".to_vec()
        }
    );
    fx.teardown().await;
}

/// Through the engine: an operation whose outcome is not stored (a 5xx) is abandoned — its
/// writes roll back on a store with a shared transaction — and the key executes again; a
/// completed one commits its write with the stored result and replays.
pub async fn an_abandoned_execution_rolls_back_and_frees_the_key<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let idem = Idempotency::builder(fx.store()).build().expect("engine");
    let k = key("alice", "k-abandon");
    let Start::Run(mut run) = idem.start(k.clone(), fp("body")).await.expect("start") else {
        panic!("fresh key did not run");
    };
    fx.record_effect(run.tx(), "abandoned")
        .await
        .expect("effect");
    run.abandon().await.expect("abandon");
    if F::SHARED_TRANSACTION {
        assert_eq!(
            fx.count_effects("abandoned").await,
            0,
            "an abandoned write committed"
        );
    }
    let Start::Run(mut run) = idem.start(k.clone(), fp("body")).await.expect("start") else {
        panic!("an abandoned key did not run again");
    };
    fx.record_effect(run.tx(), "kept").await.expect("effect");
    run.complete(b"201").await.expect("complete");
    assert_eq!(fx.count_effects("kept").await, 1);
    match idem.start(k, fp("body")).await.expect("start") {
        Start::Replay(r) => assert_eq!(r, b"201"),
        other => panic!("expected a replay, got {other:?}"),
    }
    fx.teardown().await;
}

/// The function-level API: 16 concurrent calls with one key run the function once; the others
/// get the result replayed or "in progress"; later calls all replay it.
pub async fn function_calls_run_once_and_replay_their_result<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let fx = Arc::new(fx);
    let idem = Idempotency::builder(fx.store()).build().expect("engine");
    let ran = Arc::new(AtomicUsize::new(0));
    let scope = RequestScope::new(["create_charge", "alice"]);
    let k = IdempotencyKey::new("call-1").expect("key");
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (idem, ran, k, fx) = (idem.clone(), Arc::clone(&ran), k.clone(), Arc::clone(&fx));
        tasks.push(tokio::spawn(async move {
            idem.call(scope, &k, &("alice", 1250), async |tx| {
                ran.fetch_add(1, Ordering::SeqCst);
                fx.record_effect(tx, "call-1").await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, BoxError>(vec![42u64, 7])
            })
            .await
        }));
    }
    for t in tasks {
        match t.await.expect("task") {
            Ok(v) => assert_eq!(v, vec![42, 7]),
            Err(e) => {
                assert_eq!(e.request_kind(), Some(RequestErrorKind::InProgress), "{e}");
                assert!(
                    matches!(RequestAction::of(&e), RequestAction::Wait(Some(_))),
                    "{e}"
                );
            }
        }
    }
    let again: Vec<u64> = idem
        .call(scope, &k, &("alice", 1250), async |_tx| {
            Ok::<_, BoxError>(vec![0])
        })
        .await
        .expect("replay");
    assert_eq!(again, vec![42, 7]);
    let reused = idem
        .call(scope, &k, &("alice", 9999), async |_tx| {
            Ok::<_, BoxError>(vec![0u64])
        })
        .await
        .expect_err("another input under the same key");
    assert_eq!(reused.request_kind(), Some(RequestErrorKind::KeyReused));
    assert_eq!(RequestAction::of(&reused), RequestAction::GiveUp);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(fx.count_effects("call-1").await, 1);
    if let Ok(fx) = Arc::try_unwrap(fx) {
        fx.teardown().await;
    }
}
