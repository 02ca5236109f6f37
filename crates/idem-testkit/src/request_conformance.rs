//! The idempotent-request conformance checks ([`RequestStore`] and [`ReapRequests`]). Each
//! takes a fresh fixture, asserts one property against the real store, and tears it down.
//! Timings use short leases and TTLs of the store's own clock, so a few checks sleep a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::store::{ReapRequests, RequestStore, reap_all};
use idem_core::{
    Begin, BeginIn, BoxError, Fence, Fingerprint, IdempotencyKey, RequestAction, RequestErrorKind,
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
    for leased in [false, true] {
        abandon_then_complete(&fx, leased).await;
    }
    fx.teardown().await;
}

/// The engine on `fx`'s store: in the leased mode, or in one transaction where the store can.
fn engine<F: RequestFixture>(fx: &F, leased: bool) -> Idempotency<F::Store> {
    let builder = Idempotency::builder(fx.store());
    let builder = if leased {
        builder.leased_only()
    } else {
        builder
    };
    builder.build().expect("engine")
}

async fn abandon_then_complete<F: RequestFixture>(fx: &F, leased: bool) {
    let idem = engine(fx, leased);
    let k = key("alice", &format!("k-abandon-{leased}"));
    let (abandoned, kept) = (format!("abandoned-{leased}"), format!("kept-{leased}"));
    let Start::Run(mut run) = idem.start(k.clone(), fp("body")).await.expect("start") else {
        panic!("fresh key did not run");
    };
    assert_eq!(
        run.in_transaction(),
        F::ONE_TRANSACTION && !leased,
        "the execution's mode (leased_only: {leased})"
    );
    fx.record_effect(run.tx(), &abandoned)
        .await
        .expect("effect");
    run.abandon().await.expect("abandon");
    if F::SHARED_TRANSACTION {
        assert_eq!(
            fx.count_effects(&abandoned).await,
            0,
            "an abandoned write committed"
        );
    }
    let Start::Run(mut run) = idem.start(k.clone(), fp("body")).await.expect("start") else {
        panic!("an abandoned key did not run again");
    };
    fx.record_effect(run.tx(), &kept).await.expect("effect");
    run.complete(b"201").await.expect("complete");
    assert_eq!(fx.count_effects(&kept).await, 1);
    match idem.start(k, fp("body")).await.expect("start") {
        Start::Replay(r) => assert_eq!(r, b"201"),
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// The function-level API: 16 concurrent calls with one key run the function once; the others
/// get the result replayed or "in progress"; later calls all replay it.
pub async fn function_calls_run_once_and_replay_their_result<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let fx = Arc::new(fx);
    for leased in [false, true] {
        calls_run_once(&fx, leased).await;
    }
    if let Ok(fx) = Arc::try_unwrap(fx) {
        fx.teardown().await;
    }
}

async fn calls_run_once<F: RequestFixture>(fx: &Arc<F>, leased: bool) {
    let idem = engine(&**fx, leased);
    let ran = Arc::new(AtomicUsize::new(0));
    let scope = RequestScope::new(["create_charge", "alice"]);
    let k = IdempotencyKey::new(&format!("call-{leased}")).expect("key");
    let effect = format!("call-{leased}");
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (idem, ran, k, fx) = (idem.clone(), Arc::clone(&ran), k.clone(), Arc::clone(fx));
        let effect = effect.clone();
        tasks.push(tokio::spawn(async move {
            idem.call(scope, &k, &("alice", 1250), async |tx| {
                ran.fetch_add(1, Ordering::SeqCst);
                fx.record_effect(tx, &effect).await?;
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
    assert_eq!(ran.load(Ordering::SeqCst), 1, "leased_only: {leased}");
    assert_eq!(fx.count_effects(&effect).await, 1);
}

/// Takes `k` in one transaction, or `None` (after checking the fixture says so) on a store
/// without the mode.
async fn take_in<F: RequestFixture>(
    s: &F::Store,
    k: &RequestKey,
    body: &str,
    lease: Duration,
) -> Option<(Fence, bool, crate::RequestTxOf<F>)> {
    match s
        .begin_request_in(k, &fp(body), lease, DAY)
        .await
        .expect("begin_request_in")
    {
        BeginIn::Unsupported => {
            assert!(
                !F::ONE_TRANSACTION,
                "the fixture says the store takes records in one transaction, and it does not"
            );
            None
        }
        BeginIn::Acquired {
            fence,
            takeover,
            tx,
        } => {
            assert!(
                F::ONE_TRANSACTION,
                "the store has a one-transaction mode the fixture does not declare"
            );
            Some((fence, takeover, tx))
        }
        other => panic!("expected to take the record in a transaction, got {other:?}"),
    }
}

/// How long a duplicate may take to be answered while the first execution holds its record
/// uncommitted: well under the three seconds the checks hold it, generous for a loaded host.
const AT_ONCE: Duration = Duration::from_secs(2);

/// `lookup`'s answer within [`AT_ONCE`]; a lookup that waits for the first execution fails.
async fn at_once<T>(what: &str, lookup: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(AT_ONCE, lookup).await {
        Ok(answer) => answer,
        Err(_) => panic!("{what} waited for the first execution's transaction"),
    }
}

/// [`RequestStore::begin_request_in`]'s answer for `k`, which must not be a take.
async fn answer_in<S: RequestStore>(s: &S, k: &RequestKey, body: &str) -> Begin {
    match s
        .begin_request_in(k, &fp(body), LONG, DAY)
        .await
        .expect("begin_request_in")
    {
        BeginIn::Answer(answer) => answer,
        BeginIn::Acquired { fence, .. } => panic!("took a record it should not: fence {fence:?}"),
        other => panic!("unexpected answer {other:?}"),
    }
}

/// One transaction: while the first execution holds its record uncommitted (for three seconds),
/// every duplicate — in either mode, with the same or another fingerprint — is told "in
/// progress" at once, never made to wait; afterwards the completed record replays in both modes
/// and another fingerprint is a mismatch. One effect, committed with the record.
pub async fn in_one_transaction_a_duplicate_is_in_progress_at_once<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-one-tx");
    let Some((fence, takeover, mut tx)) = take_in::<F>(&s, &k, "body", LONG).await else {
        return fx.teardown().await;
    };
    assert!(!takeover);
    fx.record_effect(&mut tx, "one-tx").await.expect("effect");
    let first = {
        let (s, k) = (s.clone(), k.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            s.complete_in(&mut tx, &k, fence, b"done", DAY)
                .await
                .expect("complete");
            s.commit(tx).await.expect("commit");
        })
    };
    let started = Instant::now();
    for body in ["body", "another body"] {
        let in_tx = at_once("a one-transaction lookup", answer_in(&s, &k, body)).await;
        assert!(
            matches!(in_tx, Begin::InProgress { .. }),
            "{body}: {in_tx:?}"
        );
        let leased = at_once("a leased lookup", lookup(&s, &k, body)).await;
        assert!(
            matches!(leased, Begin::InProgress { .. }),
            "{body}: {leased:?}"
        );
    }
    let waited = started.elapsed();
    assert!(
        waited < AT_ONCE,
        "the duplicates waited {waited:?} for the first execution's transaction"
    );
    first.await.expect("first execution");
    let done = Begin::Completed {
        result: b"done".to_vec(),
    };
    assert_eq!(answer_in(&s, &k, "body").await, done);
    assert_eq!(lookup(&s, &k, "body").await, done);
    assert_eq!(answer_in(&s, &k, "another body").await, Begin::Mismatch);
    assert_eq!(lookup(&s, &k, "another body").await, Begin::Mismatch);
    assert_eq!(fx.count_effects("one-tx").await, 1);
    fx.teardown().await;
}

/// One transaction: an execution whose connection is gone (its transaction dropped, as when the
/// process is killed) leaves nothing behind — its effect and the record roll back, and the key
/// executes again at once, with no lease to wait out and nothing to release.
pub async fn in_one_transaction_a_lost_connection_frees_the_key<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-one-tx-crash");
    let Some((_, _, mut tx)) = take_in::<F>(&s, &k, "body", LONG).await else {
        return fx.teardown().await;
    };
    fx.record_effect(&mut tx, "crashed").await.expect("effect");
    drop(tx);
    // The server rolls back as it sees the connection close: the key is free within moments.
    let started = Instant::now();
    let (fence, mut tx) = loop {
        match s
            .begin_request_in(&k, &fp("body"), LONG, DAY)
            .await
            .expect("begin_request_in")
        {
            BeginIn::Acquired {
                fence,
                takeover,
                tx,
            } => {
                assert!(!takeover, "a rolled-back take left a record to take over");
                break (fence, tx);
            }
            BeginIn::Answer(Begin::InProgress { .. })
                if started.elapsed() < Duration::from_secs(2) =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("the key was not freed by the lost connection: {other:?}"),
        }
    };
    assert_eq!(
        fx.count_effects("crashed").await,
        0,
        "the lost execution's effect committed"
    );
    fx.record_effect(&mut tx, "retried").await.expect("effect");
    s.complete_in(&mut tx, &k, fence, b"retried", DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
    assert_eq!(
        lookup(&s, &k, "body").await,
        Begin::Completed {
            result: b"retried".to_vec()
        }
    );
    assert_eq!(fx.count_effects("retried").await, 1);
    fx.teardown().await;
}

/// Both modes on one record: a leased execution with a live lease is in progress to the
/// one-transaction mode; once its lease lapsed, the one-transaction mode takes it over with a
/// larger fence, and while that take is uncommitted a leased lookup is in progress at once;
/// the leased executor's late completion is refused (its effect rolls back) and the record
/// replays the one-transaction execution's result in both modes.
pub async fn leased_and_one_transaction_executions_never_both_run<F: RequestFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-mixed");
    let old = acquire(&s, &k, "body", Duration::from_secs(1)).await;
    if !F::ONE_TRANSACTION {
        assert!(matches!(
            s.begin_request_in(&k, &fp("body"), LONG, DAY)
                .await
                .expect("begin_request_in"),
            BeginIn::Unsupported
        ));
        return fx.teardown().await;
    }
    let busy = answer_in(&s, &k, "body").await;
    assert!(
        matches!(busy, Begin::InProgress { .. }),
        "a live lease: {busy:?}"
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let Some((new, takeover, mut tx)) = take_in::<F>(&s, &k, "body", LONG).await else {
        unreachable!("checked above");
    };
    assert!(
        takeover && new > old,
        "takeover {takeover}, fences {old:?} → {new:?}"
    );
    let started = Instant::now();
    let leased = at_once("a leased lookup", lookup(&s, &k, "body")).await;
    assert!(matches!(leased, Begin::InProgress { .. }), "{leased:?}");
    let in_tx = at_once("a one-transaction lookup", answer_in(&s, &k, "body")).await;
    assert!(matches!(in_tx, Begin::InProgress { .. }), "{in_tx:?}");
    let waited = started.elapsed();
    assert!(waited < AT_ONCE, "the lookups waited {waited:?}");
    fx.record_effect(&mut tx, "mixed-new")
        .await
        .expect("effect");
    s.complete_in(&mut tx, &k, new, b"new", DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
    // The leased executor wakes up and tries to finish.
    let mut late = s.begin().await.expect("begin tx");
    fx.record_effect(&mut late, "mixed-late")
        .await
        .expect("effect");
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
    assert!(!s.extend_lease(&k, old, LONG).await.expect("extend"));
    assert_eq!(fx.count_effects("mixed-late").await, 0);
    assert_eq!(fx.count_effects("mixed-new").await, 1);
    let done = Begin::Completed {
        result: b"new".to_vec(),
    };
    assert_eq!(answer_in(&s, &k, "body").await, done);
    assert_eq!(lookup(&s, &k, "body").await, done);
    fx.teardown().await;
}

/// Through the engine, in one transaction where the store has it: a second start while the
/// first execution runs is in progress at once; an execution dropped without completing (a
/// panic, a cancelled request) frees the key by itself; the completed one replays.
pub async fn an_engine_execution_in_one_transaction_frees_its_key_when_dropped<
    F: RequestFixture,
>(
    test: &str,
) {
    let fx = fixture!(test);
    let idem = engine(&fx, false);
    let k = key("alice", "k-engine-one-tx");
    let Start::Run(mut run) = idem.start(k.clone(), fp("body")).await.expect("start") else {
        panic!("fresh key did not run");
    };
    assert_eq!(run.in_transaction(), F::ONE_TRANSACTION);
    fx.record_effect(run.tx(), "dropped").await.expect("effect");
    let second = at_once("a second start", idem.start(k.clone(), fp("body"))).await;
    let second = second.expect("start");
    assert!(matches!(second, Start::InProgress { .. }), "{second:?}");
    drop(run);
    let started = Instant::now();
    let mut run = loop {
        match idem.start(k.clone(), fp("body")).await.expect("start") {
            Start::Run(run) => break run,
            Start::InProgress { .. } if started.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("a dropped execution did not free its key: {other:?}"),
        }
    };
    if F::SHARED_TRANSACTION {
        assert_eq!(fx.count_effects("dropped").await, 0);
    }
    fx.record_effect(run.tx(), "completed")
        .await
        .expect("effect");
    run.complete(b"201").await.expect("complete");
    match idem.start(k, fp("body")).await.expect("start") {
        Start::Replay(r) => assert_eq!(r, b"201"),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert_eq!(fx.count_effects("completed").await, 1);
    fx.teardown().await;
}
