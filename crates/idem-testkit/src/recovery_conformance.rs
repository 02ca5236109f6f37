//! The recovery-point conformance checks ([`RecoveryStore`] and `idem_request`'s phases). Each
//! takes a fresh fixture, asserts one property against the real store, and tears it down.
//! Leases are half a second of the store's own clock, so a few checks sleep most of a second.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::store::{ReapRequests, RecoveryStore, RequestStore, reap_all};
use idem_core::{
    Begin, BoxError, Fence, Fingerprint, IdempotencyKey, RequestErrorKind, RequestKey,
    RequestScope, TransactionalStore,
};
use idem_request::{Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};

use crate::recovery_fixture::RecoveryFixture;

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);
const SHORT: Duration = Duration::from_millis(500);
/// Long enough for a [`SHORT`] lease to have run out on the store's clock.
const PAST_SHORT: Duration = Duration::from_millis(800);

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => fx,
            None => return,
        }
    };
}

/// The phases of the checks' operation: a local write, a foreign call, a last local write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Phase {
    Reserve,
    Charge { cents: i64 },
    Record { charge: String },
}

fn key(scope: &str, key: &str) -> RequestKey {
    RequestKey::new(
        RequestScope::new([scope]),
        IdempotencyKey::new(key).expect("valid key"),
    )
}

/// The fingerprint `run_phases` computes for an input of `()` (its canonical JSON, `null`).
fn unit_fp() -> Fingerprint {
    Fingerprint::of(b"null")
}

fn idem<S: RecoveryStore + Clone + 'static>(s: S, lease: Duration) -> Idempotency<S> {
    Idempotency::builder(s)
        .lease(lease)
        .without_heartbeat()
        .build()
        .expect("idempotency")
}

async fn acquire<S: RequestStore>(s: &S, k: &RequestKey, lease: Duration, ttl: Duration) -> Fence {
    match s
        .begin_request(k, &unit_fp(), lease, ttl)
        .await
        .expect("begin")
    {
        Begin::Acquired { fence, .. } => fence,
        other => panic!("expected to take the record, got {other:?}"),
    }
}

/// Commits `point` (the JSON of `phase`) for the record `fence` holds, with an effect `effect`.
async fn advance<F: RecoveryFixture>(
    fx: &F,
    k: &RequestKey,
    fence: Fence,
    phase: &Phase,
    effect: &str,
) {
    let s = fx.store();
    let mut tx = s.begin().await.expect("tx");
    fx.record_effect(&mut tx, effect).await.expect("effect");
    let (point, state) = encode(phase);
    s.advance_in(&mut tx, k, fence, &point, &state)
        .await
        .expect("advance");
    s.commit(tx).await.expect("commit");
}

fn encode(phase: &Phase) -> (String, Vec<u8>) {
    let value = serde_json::to_value(phase).expect("phase json");
    let name = match &value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(m) => m.keys().next().expect("variant").clone(),
        _ => unreachable!("an enum"),
    };
    (name, serde_json::to_vec(&value).expect("phase json"))
}

/// What the checks' operation saw: each phase run with its attempt, each foreign key sent.
#[derive(Debug, Default, Clone)]
struct Seen(Arc<Mutex<Vec<(String, u32)>>>, Arc<Mutex<Vec<String>>>);

impl Seen {
    fn phases(&self) -> Vec<(String, u32)> {
        self.0.lock().expect("seen").clone()
    }
    fn keys(&self) -> Vec<String> {
        self.1.lock().expect("seen").clone()
    }
}

/// The checks' operation: `Reserve` writes `<tag>-reserve`, `Charge` "calls" the processor
/// with its derived key (recorded in `seen`) and, on an attempt listed in `fail_charge`, fails
/// after the call; `Record` writes `<tag>-record` and answers.
async fn run<F: RecoveryFixture>(
    fx: &F,
    idem: &Idempotency<F::Store>,
    k: &RequestKey,
    tag: &str,
    seen: &Seen,
    fail_charge: &[u32],
) -> Result<String, idem_core::Error> {
    idem.run_phases(
        k.scope,
        &k.key,
        &(),
        Phase::Reserve,
        async |phase: Phase,
               ctx: &mut PhaseCtx<F::Store>|
               -> Result<Step<Phase, String>, BoxError> {
            seen.0
                .lock()
                .expect("seen")
                .push((ctx.point().to_owned(), ctx.attempt()));
            match phase {
                Phase::Reserve => {
                    fx.record_effect(ctx.tx(), &format!("{tag}-reserve"))
                        .await?;
                    Ok(Step::Next(Phase::Charge { cents: 1250 }))
                }
                Phase::Charge { cents } => {
                    let foreign = ctx.foreign_key("card").to_string();
                    seen.1.lock().expect("seen").push(foreign.clone());
                    if fail_charge.contains(&ctx.attempt()) {
                        return Err("the processor's answer was lost".into());
                    }
                    Ok(Step::Next(Phase::Record {
                        charge: format!("ch-{cents}-{}", &foreign[..8]),
                    }))
                }
                Phase::Record { charge } => {
                    fx.record_effect(ctx.tx(), &format!("{tag}-record")).await?;
                    Ok(Step::Done(charge))
                }
            }
        },
    )
    .await
}

/// An executor crashed after committing the first phase (no cleanup: its lease just runs
/// out). The next request takes the record over and resumes at the committed point: the first
/// phase's effect exists once, the rest runs once, and the phase sees its attempt number.
pub async fn a_crash_between_phases_resumes_at_the_last_point<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-crash");
    let fence = acquire(&s, &k, SHORT, DAY).await;
    advance(
        &fx,
        &k,
        fence,
        &Phase::Charge { cents: 1250 },
        "crash-reserve",
    )
    .await;
    tokio::time::sleep(PAST_SHORT).await;
    let idem = idem(s.clone(), LONG);
    let seen = Seen::default();
    let charge = run(&fx, &idem, &k, "crash", &seen, &[])
        .await
        .expect("resumed");
    assert!(charge.starts_with("ch-1250-"), "{charge}");
    assert_eq!(
        seen.phases(),
        vec![("Charge".to_owned(), 2), ("Record".to_owned(), 2)],
        "the resumed execution must start at the committed point, as attempt 2"
    );
    assert_eq!(fx.count_effects("crash-reserve").await, 1);
    assert_eq!(fx.count_effects("crash-record").await, 1);
    fx.teardown().await;
}

/// A phase that fails rolls back its own writes only: the retry never runs a committed phase
/// again, reruns the failed one, and a repeat after the end replays without running any.
pub async fn a_committed_local_phase_never_runs_again<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let idem = idem(s.clone(), LONG);
    let k = key("alice", "k-local");
    let seen = Seen::default();
    let err = run(&fx, &idem, &k, "local", &seen, &[1])
        .await
        .expect_err("the charge's answer was lost");
    assert!(err.to_string().contains("lost"), "{err}");
    let first = run(&fx, &idem, &k, "local", &seen, &[1])
        .await
        .expect("retry");
    let again = run(&fx, &idem, &k, "local", &seen, &[])
        .await
        .expect("replay");
    assert_eq!(first, again, "the repeat must replay the stored response");
    let points: Vec<String> = seen.phases().into_iter().map(|(p, _)| p).collect();
    assert_eq!(points, ["Reserve", "Charge", "Charge", "Record"]);
    assert_eq!(fx.count_effects("local-reserve").await, 1);
    assert_eq!(fx.count_effects("local-record").await, 1);
    fx.teardown().await;
}

/// A foreign call repeated after a failure or a takeover sends the same derived key; another
/// tenant's operation under the same client key sends another.
pub async fn a_foreign_call_repeats_with_the_same_derived_key<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let idem = idem(s.clone(), LONG);
    let (alice, bob) = (key("alice", "k-same"), key("bob", "k-same"));
    let seen = Seen::default();
    let _ = run(&fx, &idem, &alice, "a", &seen, &[1, 2]).await;
    let _ = run(&fx, &idem, &alice, "a", &seen, &[1, 2]).await;
    run(&fx, &idem, &alice, "a", &seen, &[1, 2])
        .await
        .expect("third attempt");
    let keys = seen.keys();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(keys.iter().all(|k| *k == keys[0]), "keys changed: {keys:?}");
    let other = Seen::default();
    run(&fx, &idem, &bob, "b", &other, &[]).await.expect("bob");
    assert_ne!(other.keys()[0], keys[0], "two tenants derived the same key");
    fx.teardown().await;
}

/// After a takeover the old executor's fence can no longer advance the record: its phase's
/// writes roll back and the point stays where the new holder sees it.
pub async fn a_stale_fence_cannot_advance<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-stale");
    let old = acquire(&s, &k, SHORT, DAY).await;
    advance(&fx, &k, old, &Phase::Charge { cents: 1 }, "stale-reserve").await;
    tokio::time::sleep(PAST_SHORT).await;
    let new = acquire(&s, &k, LONG, DAY).await;
    assert!(new > old);
    let mut late = s.begin().await.expect("tx");
    fx.record_effect(&mut late, "stale-late")
        .await
        .expect("effect");
    let (point, state) = encode(&Phase::Record { charge: "x".into() });
    let err = s
        .advance_in(&mut late, &k, old, &point, &state)
        .await
        .expect_err("a stale fence advanced");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::LeaseLost),
        "{err}"
    );
    let _ = s.rollback(late).await;
    assert_eq!(fx.count_effects("stale-late").await, 0);
    let recovery = s.recovery(&k, new).await.expect("recovery");
    assert_eq!(recovery.resume.expect("a point").point, "Charge");
    assert_eq!(recovery.attempts, 2);
    let err = s.recovery(&k, old).await.expect_err("stale fence read");
    assert_eq!(err.request_kind(), Some(RequestErrorKind::LeaseLost));
    advance(
        &fx,
        &k,
        new,
        &Phase::Record { charge: "y".into() },
        "stale-new",
    )
    .await;
    fx.teardown().await;
}

/// An abandoned operation replays its stored response, like a completed one, and runs no
/// phase again; a stale fence cannot abandon.
pub async fn an_abandoned_operation_replays_its_result<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let idem = idem(s.clone(), LONG);
    let k = key("alice", "k-abandon");
    let runs = Arc::new(Mutex::new(0));
    let step = async |phase: Phase,
                      ctx: &mut PhaseCtx<F::Store>|
           -> Result<Step<Phase, String>, BoxError> {
        *runs.lock().expect("runs") += 1;
        fx.record_effect(ctx.tx(), "abandon-compensation").await?;
        let _ = phase;
        Ok(Step::Abandon("declined".to_owned()))
    };
    let first = idem
        .run_phases(k.scope, &k.key, &(), Phase::Reserve, step)
        .await
        .expect("abandoned");
    let again = idem
        .run_phases(k.scope, &k.key, &(), Phase::Reserve, step)
        .await
        .expect("replayed");
    assert_eq!((first.as_str(), again.as_str()), ("declined", "declined"));
    assert_eq!(
        *runs.lock().expect("runs"),
        1,
        "a phase ran after abandonment"
    );
    assert_eq!(fx.count_effects("abandon-compensation").await, 1);
    assert_eq!(
        s.begin_request(&k, &unit_fp(), LONG, DAY)
            .await
            .expect("lookup"),
        Begin::Completed {
            result: b"\"declined\"".to_vec()
        }
    );
    let other = key("alice", "k-abandon-stale");
    let old = acquire(&s, &other, SHORT, DAY).await;
    advance(&fx, &other, old, &Phase::Charge { cents: 1 }, "x").await;
    tokio::time::sleep(PAST_SHORT).await;
    acquire(&s, &other, LONG, DAY).await;
    let mut tx = s.begin().await.expect("tx");
    let err = s
        .abandon_in(&mut tx, &other, old, b"late", DAY)
        .await
        .expect_err("a stale fence abandoned");
    assert_eq!(err.request_kind(), Some(RequestErrorKind::LeaseLost));
    let _ = s.rollback(tx).await;
    fx.teardown().await;
}

/// The completer finds records in progress past their lease with a recovery point — not
/// before the lease ran out, not those without a point, at most `limit` at a time — takes each
/// over (one more attempt, a new fence) and resumes them to the end.
pub async fn stuck_records_are_found_past_their_lease_bounded<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let mut stuck_keys = HashSet::new();
    for i in 0..3 {
        let k = key("alice", &format!("k-stuck-{i}"));
        let fence = acquire(&s, &k, SHORT, DAY).await;
        advance(&fx, &k, fence, &Phase::Charge { cents: i }, "stuck-reserve").await;
        stuck_keys.insert(k);
    }
    acquire(&s, &key("alice", "k-no-point"), SHORT, DAY).await;
    let live = key("alice", "k-live");
    let fence = acquire(&s, &live, LONG, DAY).await;
    advance(
        &fx,
        &live,
        fence,
        &Phase::Charge { cents: 9 },
        "live-reserve",
    )
    .await;
    let idem = idem(s.clone(), LONG);
    assert!(
        idem.take_stuck(10).await.expect("take").is_empty(),
        "a record was taken before its lease ran out"
    );
    tokio::time::sleep(PAST_SHORT).await;
    let first = idem.take_stuck(2).await.expect("take");
    assert_eq!(first.len(), 2, "the limit was not kept");
    let rest = idem.take_stuck(10).await.expect("take");
    assert_eq!(
        rest.len(),
        1,
        "taken records must not be taken again: {rest:?}"
    );
    let mut found = HashSet::new();
    for stuck in first.into_iter().chain(rest) {
        assert_eq!(stuck.recovery.attempts, 2);
        assert_eq!(
            stuck.recovery.resume.as_ref().expect("point").point,
            "Charge"
        );
        found.insert(stuck.key.clone());
        let seen = Seen::default();
        let charge: String = idem
            .resume_phases(stuck, async |phase: Phase, ctx: &mut PhaseCtx<F::Store>| {
                seen.0
                    .lock()
                    .expect("seen")
                    .push((ctx.point().to_owned(), ctx.attempt()));
                match phase {
                    Phase::Charge { cents } => Ok::<_, BoxError>(Step::Next(Phase::Record {
                        charge: format!("ch-{cents}"),
                    })),
                    Phase::Record { charge } => {
                        fx.record_effect(ctx.tx(), "stuck-record").await?;
                        Ok(Step::Done(charge))
                    }
                    Phase::Reserve => Err("a committed phase ran again".into()),
                }
            })
            .await
            .expect("resumed");
        assert!(charge.starts_with("ch-"));
    }
    assert_eq!(found, stuck_keys);
    assert_eq!(fx.count_effects("stuck-record").await, 3);
    assert!(idem.take_stuck(10).await.expect("take").is_empty());
    fx.teardown().await;
}

/// Two completers at once never take the same record, and (on a store with row locks) a
/// record another transaction holds locked is skipped at once rather than waited for.
pub async fn two_completers_skip_each_others_records<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    for i in 0..20 {
        let k = key("alice", &format!("k-two-{i}"));
        let fence = acquire(&s, &k, SHORT, DAY).await;
        advance(&fx, &k, fence, &Phase::Charge { cents: i }, "two").await;
    }
    // An executor still writing with a lapsed lease: its transaction holds the row.
    let busy = key("alice", "k-two-busy");
    let busy_fence = acquire(&s, &busy, SHORT, DAY).await;
    advance(&fx, &busy, busy_fence, &Phase::Charge { cents: 0 }, "two").await;
    tokio::time::sleep(PAST_SHORT).await;
    let holder = if F::SKIPS_LOCKED_ROWS {
        let mut tx = s.begin().await.expect("tx");
        let (point, state) = encode(&Phase::Charge { cents: 1 });
        s.advance_in(&mut tx, &busy, busy_fence, &point, &state)
            .await
            .expect("the lapsed holder still advances until taken over");
        Some(tx)
    } else {
        None
    };
    let started = Instant::now();
    let takers = (0..2).map(|_| {
        let s = s.clone();
        tokio::spawn(async move {
            let mut taken = Vec::new();
            loop {
                let batch = s.take_stuck(3, LONG).await.expect("take");
                if batch.is_empty() {
                    return taken;
                }
                taken.extend(batch.into_iter().map(|b| b.key));
            }
        })
    });
    let mut all = Vec::new();
    for t in takers.collect::<Vec<_>>() {
        // A taker that waits for the locked row never returns while it is held.
        let taken = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("a taker waited for a record another transaction holds");
        all.extend(taken.expect("taker"));
    }
    let elapsed = started.elapsed();
    let distinct: HashSet<_> = all.iter().cloned().collect();
    assert_eq!(distinct.len(), all.len(), "a record was taken twice");
    if let Some(tx) = holder {
        assert_eq!(all.len(), 20, "the locked record must be skipped");
        assert!(!distinct.contains(&busy));
        assert!(
            elapsed < Duration::from_secs(3),
            "the takers waited {elapsed:?}"
        );
        s.rollback(tx).await.expect("rollback");
        let late = s.take_stuck(10, LONG).await.expect("take");
        assert_eq!(late.len(), 1, "the record is stuck once its holder let go");
    } else {
        assert_eq!(all.len(), 21);
    }
    fx.teardown().await;
}

/// A record with a recovery point is never started afresh or reaped for outliving its TTL:
/// its phases committed, so it is taken over and resumed however late, and a release ends its
/// lease instead of deleting it. A record without a point still expires as before.
pub async fn expiry_never_resets_a_record_with_a_recovery_point<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let (with, without) = (key("alice", "k-exp-point"), key("alice", "k-exp-none"));
    let fence = acquire(&s, &with, SHORT, SHORT).await;
    advance(&fx, &with, fence, &Phase::Charge { cents: 5 }, "exp").await;
    acquire(&s, &without, SHORT, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let reaped = reap_all(&s, 10).await.expect("reap");
    assert_eq!(reaped, 1, "only the record without a point is reaped");
    match s
        .begin_request(&with, &Fingerprint::of(b"other"), LONG, DAY)
        .await
        .expect("lookup")
    {
        Begin::Mismatch => {}
        other => panic!("another request reset a record with a point: {other:?}"),
    }
    let taken = match s
        .begin_request(&with, &unit_fp(), SHORT, DAY)
        .await
        .expect("lookup")
    {
        Begin::Acquired { fence, takeover } => {
            assert!(
                takeover,
                "a record with a point must be taken over, not started afresh"
            );
            fence
        }
        other => panic!("{other:?}"),
    };
    let recovery = s.recovery(&with, taken).await.expect("recovery");
    assert_eq!(recovery.resume.expect("the point survived").point, "Charge");
    assert_eq!(recovery.attempts, 2);
    s.release(&with, taken).await.expect("release");
    match s
        .begin_request(&with, &unit_fp(), LONG, DAY)
        .await
        .expect("lookup")
    {
        Begin::Acquired {
            fence,
            takeover: true,
        } => {
            let recovery = s.recovery(&with, fence).await.expect("recovery");
            assert!(recovery.resume.is_some(), "release dropped the point");
            assert_eq!(recovery.attempts, 3);
        }
        other => panic!("a released record with a point was not resumable: {other:?}"),
    }
    fx.teardown().await;
}

/// `migrate` adds the recovery columns to a requests table made before them, keeping its
/// rows, and migrating again changes nothing.
pub async fn migration_adds_recovery_columns_to_an_old_table<F: RecoveryFixture>(test: &str) {
    use idem_core::Migrate;
    let fx = fixture!(test);
    let old = fx
        .legacy_store("legacy_requests", &key("alice", "k-legacy-row"), &unit_fp())
        .await;
    let k = key("alice", "k-legacy");
    assert!(
        old.begin_request(&k, &unit_fp(), LONG, DAY).await.is_err(),
        "the legacy table already had the recovery columns"
    );
    old.migrate().await.expect("migrate the old table");
    old.migrate().await.expect("migrate again");
    let fence = acquire(&old, &k, LONG, DAY).await;
    let mut tx = old.begin().await.expect("tx");
    let (point, state) = encode(&Phase::Charge { cents: 3 });
    old.advance_in(&mut tx, &k, fence, &point, &state)
        .await
        .expect("advance on the migrated table");
    old.commit(tx).await.expect("commit");
    let recovery = old.recovery(&k, fence).await.expect("recovery");
    assert_eq!(recovery.attempts, 1);
    assert_eq!(recovery.resume.expect("point").point, "Charge");
    assert_eq!(
        old.begin_request(&key("alice", "k-legacy-row"), &unit_fp(), LONG, DAY)
            .await
            .expect("the old row"),
        Begin::Completed {
            result: b"old".to_vec()
        },
        "the row written before the migration was lost"
    );
    let _ = old.reap_batch(1).await.expect("reap on the migrated table");
    fx.teardown().await;
}

/// `begin_phases` takes a record born at the operation's first point — committed with the take,
/// so a completer finds it before any phase commits — and says where a taken record stands
/// without another read: a new or reset record at the first point, attempt 1; one taken over
/// at its own last point, attempts counted; nothing with an answer that is not a take.
pub async fn a_phased_take_writes_the_first_point_and_returns_it<F: RecoveryFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = key("alice", "k-born");
    let (point, state) = encode(&Phase::Reserve);
    let at = |recovery: &Option<idem_core::Recovery>| {
        let r = recovery
            .as_ref()
            .expect("a take tells where the record stands");
        let resume = r.resume.as_ref().expect("a point");
        (r.attempts, resume.point.clone(), resume.state.clone())
    };
    let (begin, recovery) = s
        .begin_phases(&k, &unit_fp(), SHORT, DAY, &point, &state)
        .await
        .expect("take");
    let Begin::Acquired {
        fence: first,
        takeover: false,
    } = begin
    else {
        panic!("expected a new record, got {begin:?}");
    };
    assert_eq!(at(&recovery), (1, point.clone(), state.clone()));
    let stored = s.recovery(&k, first).await.expect("recovery");
    assert_eq!(
        Some(stored),
        recovery,
        "the take's answer is what the record holds"
    );
    // Live: in progress, nothing taken, nothing told.
    let (begin, recovery) = s
        .begin_phases(&k, &unit_fp(), LONG, DAY, &point, &state)
        .await
        .expect("lookup");
    assert!(matches!(begin, Begin::InProgress { .. }), "{begin:?}");
    assert_eq!(recovery, None);
    // The executor crashed before its first phase committed: the completer finds the record
    // at its first point.
    tokio::time::sleep(PAST_SHORT).await;
    let stuck = s.take_stuck(10, SHORT).await.expect("take stuck");
    assert_eq!(
        stuck.len(),
        1,
        "the first point was not committed with the take"
    );
    assert_eq!(
        stuck[0].recovery.resume.as_ref().expect("a point").point,
        point
    );
    // Taken over again: at its own point (not the caller's first), one attempt more.
    tokio::time::sleep(PAST_SHORT).await;
    let (other_point, other_state) = encode(&Phase::Record { charge: "x".into() });
    let (begin, recovery) = s
        .begin_phases(&k, &unit_fp(), LONG, DAY, &other_point, &other_state)
        .await
        .expect("takeover");
    let Begin::Acquired {
        fence: taken,
        takeover: true,
    } = begin
    else {
        panic!("expected a takeover, got {begin:?}");
    };
    assert!(taken > stuck[0].fence);
    assert_eq!(at(&recovery), (3, point.clone(), state.clone()));
    // An ended record past its TTL starts afresh at the new first point.
    let mut tx = s.begin_execution().await.expect("tx");
    s.complete_in(&mut tx, &k, taken, b"done", SHORT)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
    tokio::time::sleep(PAST_SHORT).await;
    let (begin, recovery) = s
        .begin_phases(&k, &unit_fp(), LONG, DAY, &other_point, &other_state)
        .await
        .expect("reset");
    let Begin::Acquired {
        fence: reset,
        takeover: false,
    } = begin
    else {
        panic!("expected an expired record started afresh, got {begin:?}");
    };
    assert!(reset > taken);
    assert_eq!(at(&recovery), (1, other_point, other_state));
    assert_eq!(s.recovery(&k, reset).await.ok(), recovery);
    fx.teardown().await;
}
