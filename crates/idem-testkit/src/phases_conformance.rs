//! The phases conformance checks: `idem_request`'s operations of phases
//! ([`Idempotency::run_phases`](idem_request::Idempotency::run_phases),
//! [`take_stuck`](idem_request::Idempotency::take_stuck),
//! [`resume_phases`](idem_request::Idempotency::resume_phases)) end to end on a real store,
//! through the public API only. Each takes a fresh fixture, runs the testkit's operation (a
//! reservation, a charge at a fake processor, a record) and counts the phases it ran and the
//! calls the processor got. The store-level contract under them is `recovery_conformance`'s.

use idem_core::RequestErrorKind;

use crate::phase_operation::{DECLINED, LONG, Op, PAST_SHORT, Phase, SHORT, idem, key};
use crate::recovery_fixture::RecoveryFixture;

macro_rules! op {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => Op::new(fx),
            None => return,
        }
    };
}

fn points(ran: &[(String, u32)]) -> Vec<(&str, u32)> {
    ran.iter().map(|(p, a)| (p.as_str(), *a)).collect()
}

/// A phase that committed never runs again: not on the retry after a phase failed, not on
/// the takeover after an executor crashed; the failed or interrupted phase reruns (with the
/// next attempt number) and the repeat after the end replays the response, running nothing.
pub async fn a_committed_local_phase_never_runs_again_after_a_failure_or_a_takeover<
    F: RecoveryFixture,
>(
    test: &str,
) {
    let op = op!(test);
    let idem = idem(op.store(), LONG);
    let k = "f1.h2.order";
    let err = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect_err("the charge's answer was lost on attempt 1");
    assert!(err.to_string().contains("lost"), "{err}");
    op.crash(SHORT, k, Phase::Reserve).await;
    tokio::time::sleep(PAST_SHORT).await;
    let done = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect("the takeover finishes");
    assert_eq!(
        points(&op.ran(k)),
        [
            ("Reserve", 1),
            ("Charge", 1),
            ("Charge", 2),
            ("Charge", 3),
            ("Record", 3)
        ],
        "each attempt must resume at the last committed point"
    );
    let replay = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect("replay");
    assert_eq!(replay, done, "a repeat must replay the stored response");
    assert_eq!(op.ran(k).len(), 5, "a phase ran on a finished operation");
    assert_eq!(op.effects(&format!("{k}/reserve")).await, 1);
    assert_eq!(op.effects(&format!("{k}/record")).await, 1);
    op.teardown().await;
}

/// Every attempt of a foreign call sends the same derived key, so the processor charges
/// once however often it is called; another record (another client key, or the same
/// client key in another scope) derives another key.
pub async fn a_foreign_call_repeats_only_with_the_same_derived_key<F: RecoveryFixture>(test: &str) {
    let op = op!(test);
    let idem = idem(op.store(), LONG);
    let k = "f1.f2.h3.order";
    for attempt in 1..=2 {
        op.run(&idem, k, "input", Phase::Reserve)
            .await
            .expect_err(&format!("attempt {attempt} fails after the call"));
    }
    op.crash(SHORT, k, Phase::Reserve).await;
    tokio::time::sleep(PAST_SHORT).await;
    let charge = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect("attempt 4 finishes");
    let calls = op.calls();
    assert_eq!(
        calls.len(),
        1,
        "the attempts sent different keys: {calls:?}"
    );
    let (derived, n) = calls.iter().next().expect("one key");
    assert_eq!(*n, 4, "one call per attempt of the charge");
    assert_eq!(
        op.charge_of(derived),
        Some(charge),
        "the response is the one charge"
    );
    let derived = derived.clone();

    let other = "another-order";
    op.run(&idem, other, "input", Phase::Reserve)
        .await
        .expect("another record");
    let tenant = idem_core::RequestScope::new(["another_tenant"]);
    idem.run_phases(
        tenant,
        &key(k),
        "input",
        Phase::Reserve,
        async |phase, ctx: &mut idem_request::PhaseCtx<F::Store>| op.step(phase, ctx).await,
    )
    .await
    .expect_err("f1: the other tenant's first attempt fails too");
    let calls = op.calls();
    assert_eq!(
        calls.len(),
        3,
        "three records, three derived keys: {calls:?}"
    );
    let mut counts: Vec<u32> = calls.values().copied().collect();
    counts.sort_unstable();
    assert_eq!(counts, [1, 1, 4]);
    assert_eq!(calls.get(&derived), Some(&4), "another record reused a key");
    op.teardown().await;
}

/// The record's first recovery point commits before the first phase runs: an operation
/// whose first phase is a foreign call and that crashes in it is stuck at that point, and
/// the completer's resume repeats the call with the same derived key.
pub async fn the_first_point_commits_before_the_first_phase<F: RecoveryFixture>(test: &str) {
    let op = op!(test);
    let k = "h1.first";
    op.crash(SHORT, k, Phase::Charge { cents: 700 }).await;
    tokio::time::sleep(PAST_SHORT).await;
    let idem = idem(op.store(), LONG);
    let mut stuck = idem.take_stuck(10).await.expect("take");
    assert_eq!(
        stuck.len(),
        1,
        "the crashed operation has no committed point to resume at"
    );
    let stuck = stuck.remove(0);
    assert_eq!(stuck.key.key.as_str(), k);
    let resume = stuck.recovery.resume.clone().expect("a point");
    assert_eq!(resume.point, "Charge");
    assert_eq!(stuck.recovery.attempts, 2);
    let charge = op.resume(idem, stuck).await.expect("resumed");
    assert_eq!(
        points(&op.ran(k)),
        [("Charge", 1), ("Charge", 2), ("Record", 2)]
    );
    let calls = op.calls();
    assert_eq!(
        calls.values().copied().collect::<Vec<_>>(),
        [2],
        "{calls:?}"
    );
    let derived = calls.keys().next().expect("one key");
    assert_eq!(op.charge_of(derived), Some(charge));
    op.teardown().await;
}

/// A phase that abandons stores its response as abandoned in the same commit as its own
/// writes (a release of the reservation): the caller and every retry get that response, no
/// phase runs again, and the record is never stuck.
pub async fn abandon_stores_a_response_replayed_to_retries<F: RecoveryFixture>(test: &str) {
    let op = op!(test);
    let idem = idem(op.store(), SHORT);
    let k = "decline.order";
    let first = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect("abandoned");
    assert_eq!(first, DECLINED);
    let again = op
        .run(&idem, k, "input", Phase::Reserve)
        .await
        .expect("replayed");
    assert_eq!(again, DECLINED);
    assert_eq!(points(&op.ran(k)), [("Reserve", 1), ("Charge", 1)]);
    assert_eq!(op.effects(&format!("{k}/reserve")).await, 1);
    assert_eq!(op.effects(&format!("{k}/release")).await, 1);
    assert_eq!(op.effects(&format!("{k}/record")).await, 0);
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        idem.take_stuck(10).await.expect("take").is_empty(),
        "an abandoned operation was taken as stuck"
    );
    op.teardown().await;
}

/// Another input under a key already used is refused as a reused key — whether the first
/// operation finished or is stuck in the middle — without running a phase or touching the
/// record: the stuck one still resumes at its point and finishes with its own input.
pub async fn a_fingerprint_conflict_is_refused<F: RecoveryFixture>(test: &str) {
    let op = op!(test);
    let idem = idem(op.store(), LONG);
    let done = "done-order";
    let charge = op
        .run(&idem, done, "input", Phase::Reserve)
        .await
        .expect("first");
    let err = op
        .run(&idem, done, "another input", Phase::Reserve)
        .await
        .expect_err("another input under a used key");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::KeyReused),
        "{err}"
    );

    let stuck = "h1.stuck-order";
    op.crash(SHORT, stuck, Phase::Reserve).await;
    tokio::time::sleep(PAST_SHORT).await;
    let err = op
        .run(&idem, stuck, "another input", Phase::Reserve)
        .await
        .expect_err("another input under a stuck key");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::KeyReused),
        "{err}"
    );
    assert_eq!(
        points(&op.ran(done)).len(),
        3,
        "a refused request ran a phase"
    );
    assert_eq!(points(&op.ran(stuck)), [("Reserve", 1), ("Charge", 1)]);
    let finished = op
        .run(&idem, stuck, "input", Phase::Reserve)
        .await
        .expect("the right input resumes");
    assert_eq!(
        points(&op.ran(stuck)),
        [("Reserve", 1), ("Charge", 1), ("Charge", 2), ("Record", 2)]
    );
    assert_ne!(finished, charge);
    assert_eq!(op.effects(&format!("{done}/record")).await, 1);
    assert_eq!(op.effects(&format!("{stuck}/reserve")).await, 1);
    op.teardown().await;
}
