//! The completer conformance checks: [`Completer`] (builder, `pass`, `run`, `stats`, its
//! metrics) finishing operations of phases on a real store, through the public API only.
//! Each takes a fresh fixture, leaves the testkit's operation (a reservation, a charge at a
//! fake processor, a record) stuck — a "crash" drops a run hanging in its charge, after its
//! first phase committed — and counts what the completer ran.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem_core::{BoxError, RequestErrorKind, RequestScope};
use idem_request::{Completer, CompleterStats, Execution, Idempotency, PhaseCtx, Step};
use tokio_util::sync::CancellationToken;

use crate::completer_fixture::CompleterFixture;
use crate::phase_operation::{LONG, Op, PAST_SHORT, Phase, REFUNDED, SHORT, idem, key, scope};

/// How long a check waits for a running completer to get somewhere before it fails; never
/// an assertion on speed.
const PATIENCE: Duration = Duration::from_secs(30);

/// The lease of the operation a heartbeat keeps alive past it.
const HEARTBEAT_LEASE: Duration = Duration::from_millis(1500);

macro_rules! op {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => Op::new(fx),
            None => return,
        }
    };
}

/// A completer on `store` for the operation `op` in [`scope`]: it resumes with the
/// operation's `step` and gives up with its refund; its lease on a record it takes is `lease`.
fn completer<F: CompleterFixture>(
    op: &Op<F>,
    store: F::Store,
    lease: Duration,
    max_attempts: u32,
    batch: u32,
) -> Completer<F::Store> {
    completer_in(op, store, scope(), lease, max_attempts, batch)
}

fn completer_in<F: CompleterFixture>(
    op: &Op<F>,
    store: F::Store,
    scope: RequestScope,
    lease: Duration,
    max_attempts: u32,
    batch: u32,
) -> Completer<F::Store> {
    let idem = Idempotency::builder(store)
        .lease(lease)
        .build()
        .expect("idempotency");
    let (resume, give_up) = (op.clone(), op.clone());
    Completer::builder(idem)
        .max_attempts(max_attempts)
        .batch(batch)
        .interval(Duration::from_millis(50))
        .max_backoff(Duration::from_millis(200))
        .operation(
            scope,
            "conformance_order",
            move |idem: Idempotency<F::Store>, stuck| {
                let op = resume.clone();
                async move { op.resume(idem, stuck).await.map(drop) }
            },
            move |execution: Execution<F::Store>, _recovery| {
                let op = give_up.clone();
                async move { op.give_up(execution).await }
            },
        )
        .build()
        .expect("completer")
}

fn counts(s: &CompleterStats) -> [(&'static str, u64); 7] {
    [
        ("passes", s.passes),
        ("stuck_seen", s.stuck_seen),
        ("resumed", s.resumed),
        ("abandoned", s.abandoned),
        ("failed", s.failed),
        ("unknown", s.unknown),
        ("outages", s.outages),
    ]
}

/// The response a retry of `k` gets, with a step that fails if any phase runs.
async fn retry<F: CompleterFixture>(op: &Op<F>, k: &str) -> Result<String, idem_core::Error> {
    idem(op.store(), LONG)
        .run_phases(
            scope(),
            &key(k),
            "input",
            Phase::Reserve,
            async |_: Phase, _: &mut PhaseCtx<F::Store>| {
                Err::<Step<Phase, String>, _>("a phase ran on a finished operation")
            },
        )
        .await
}

/// Phase runs of `k` by attempt: how often each attempt ran its charge.
fn charges_by_attempt<F: CompleterFixture>(op: &Op<F>, k: &str) -> HashMap<u32, usize> {
    let mut by = HashMap::new();
    for (point, attempt) in op.ran(k) {
        if point == "Charge" {
            *by.entry(attempt).or_default() += 1;
        }
    }
    by
}

/// A record stuck past its lease is taken over by a pass and resumed at its point to the
/// end; a retry then gets the response the completer stored, and the next pass finds
/// nothing.
pub async fn a_stuck_record_is_resumed_and_a_retry_gets_its_response<F: CompleterFixture>(
    test: &str,
) {
    let op = op!(test);
    let k = "h1.order";
    op.crash(SHORT, k, Phase::Reserve).await;
    assert_eq!(op.effects(&format!("{k}/reserve")).await, 1);
    tokio::time::sleep(PAST_SHORT).await;
    let c = completer(&op, op.store(), LONG, 5, 32);
    assert_eq!(c.pass().await.expect("pass"), 1);
    assert_eq!(
        c.pass().await.expect("pass"),
        0,
        "a finished operation is not stuck"
    );
    let s = c.stats();
    assert_eq!(
        (s.stuck_seen, s.resumed, s.failed, s.abandoned),
        (1, 1, 0, 0),
        "{s:?}"
    );
    let ran: Vec<(String, u32)> = op.ran(k);
    let ran: Vec<(&str, u32)> = ran.iter().map(|(p, a)| (p.as_str(), *a)).collect();
    assert_eq!(
        ran,
        [("Reserve", 1), ("Charge", 1), ("Charge", 2), ("Record", 2)],
        "the completer must resume at the committed point"
    );
    assert_eq!(op.effects(&format!("{k}/reserve")).await, 1);
    assert_eq!(op.effects(&format!("{k}/record")).await, 1);
    let calls = op.calls();
    let derived = calls.keys().next().expect("the charge was sent");
    let replay = retry(&op, k).await.expect("a retry replays");
    assert_eq!(Some(replay), op.charge_of(derived));
    drop(c);
    op.teardown().await;
}

/// Two completers passing at once over the same stuck records resume each record exactly
/// once: every record's charge runs on one takeover only, and their counts add up.
pub async fn two_completers_resume_each_record_exactly_once<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let keys: Vec<String> = (0..8).map(|i| format!("h1.two-{i}")).collect();
    for k in &keys {
        op.crash(SHORT, k, Phase::Reserve).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    let (a, b) = (
        completer(&op, op.store(), LONG, 5, 3),
        completer(&op, op.store(), LONG, 5, 3),
    );
    let drain = async |c: &Completer<F::Store>| {
        let mut taken = 0;
        loop {
            match c.pass().await.expect("pass") {
                0 => return taken,
                n => taken += n,
            }
        }
    };
    let (ta, tb) = tokio::join!(drain(&a), drain(&b));
    assert_eq!(
        ta + tb,
        keys.len(),
        "each stuck record taken by one completer"
    );
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.resumed + sb.resumed, keys.len() as u64, "{sa:?} {sb:?}");
    assert_eq!(sa.stuck_seen + sb.stuck_seen, keys.len() as u64);
    for k in &keys {
        assert_eq!(
            charges_by_attempt(&op, k),
            HashMap::from([(1, 1), (2, 1)]),
            "{k}: resumed other than exactly once"
        );
        assert_eq!(op.effects(&format!("{k}/record")).await, 1, "{k}");
        assert_eq!(op.effects(&format!("{k}/reserve")).await, 1, "{k}");
    }
    drop((a, b));
    op.teardown().await;
}

/// A record that failed `max_attempts` executions is given up by the next pass: its
/// compensation and its abandoned response commit together — a give-up that lost the record
/// to another executor commits neither — every retry gets the response, and it is never
/// stuck again.
pub async fn after_max_attempts_it_gives_up_with_the_compensation_in_the_same_commit<
    F: CompleterFixture,
>(
    test: &str,
) {
    let op = op!(test);
    let k = "fail.order";
    op.run(&idem(op.store(), SHORT), k, "input", Phase::Reserve)
        .await
        .expect_err("the charge fails");
    let c = completer(&op, op.store(), SHORT, 2, 32);
    // Attempt 2 (the completer's first) resumes and fails; attempt 3 gives up.
    for _ in 0..2 {
        tokio::time::sleep(PAST_SHORT).await;
        assert_eq!(c.pass().await.expect("pass"), 1);
    }
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        c.pass().await.expect("pass"),
        0,
        "an abandoned operation is not stuck"
    );
    let s = c.stats();
    assert_eq!((s.failed, s.abandoned, s.resumed), (1, 1, 0), "{s:?}");
    assert_eq!(op.gave_up(), [k]);
    assert_eq!(
        charges_by_attempt(&op, k),
        HashMap::from([(1, 1), (2, 1)]),
        "giving up runs no phase"
    );
    assert_eq!(op.effects(&format!("{k}/refund")).await, 1);
    assert_eq!(op.effects(&format!("{k}/reserve")).await, 1);
    assert_eq!(retry(&op, k).await.expect("replay"), REFUNDED);

    // The same commit: a give-up whose record was taken over meanwhile is refused, and its
    // compensation, which ran, rolls back with it.
    let stale = "fail.stale";
    op.run(&idem(op.store(), SHORT), stale, "input", Phase::Reserve)
        .await
        .expect_err("the charge fails");
    tokio::time::sleep(PAST_SHORT).await;
    let (slow, fast) = (idem(op.store(), SHORT), idem(op.store(), LONG));
    let mut first = slow.take_stuck(10).await.expect("take");
    assert_eq!(first.len(), 1);
    tokio::time::sleep(PAST_SHORT).await;
    let mut second = fast.take_stuck(10).await.expect("take");
    assert_eq!(second.len(), 1, "the first taker's lease ran out");
    let (execution, _) = slow.resume(first.remove(0)).await.expect("resume");
    let err = op
        .give_up(execution)
        .await
        .expect_err("a give-up with a stale fence");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::LeaseLost),
        "{err}"
    );
    assert_eq!(op.gave_up(), [k, stale], "the compensation ran");
    assert_eq!(
        op.effects(&format!("{stale}/refund")).await,
        0,
        "a compensation committed without its abandoned response"
    );
    let (execution, _) = fast.resume(second.remove(0)).await.expect("resume");
    op.give_up(execution).await.expect("the holder gives up");
    assert_eq!(op.effects(&format!("{stale}/refund")).await, 1);
    assert_eq!(retry(&op, stale).await.expect("replay"), REFUNDED);
    drop(c);
    op.teardown().await;
}

/// A record whose lease is live is not taken: neither one an executor keeps renewing with
/// its heartbeat beyond its first lease, nor one hanging with a long lease. Once the hanging
/// one's executor is gone and its lease ended, the next pass takes it.
pub async fn a_record_whose_lease_is_live_is_not_taken<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let c = completer(&op, op.store(), LONG, 5, 32);
    // A lease the heartbeat (every third of it) keeps even on a loaded machine.
    let live = Idempotency::builder(op.store())
        .lease(HEARTBEAT_LEASE)
        .build()
        .expect("idempotency with a heartbeat");
    let (in_charge, passed) = (AtomicBool::new(false), AtomicBool::new(false));
    let heartbeat_key = key("heartbeat");
    let heartbeat = live.run_phases(
        scope(),
        &heartbeat_key,
        "input",
        Phase::Reserve,
        async |phase: Phase,
               ctx: &mut PhaseCtx<F::Store>|
               -> Result<Step<Phase, String>, BoxError> {
            if phase == Phase::Reserve {
                return op.step(phase, ctx).await;
            }
            in_charge.store(true, Ordering::SeqCst);
            while !passed.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(Step::Done("live".into()))
        },
    );
    let hanging = "h1.long-lease";
    let long = idem(op.store(), LONG);
    let long_run = op.run(&long, hanging, "input", Phase::Reserve);
    let passes = async {
        op.hanging(hanging).await;
        while !in_charge.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Past the heartbeat's first lease, and again a lease later.
        tokio::time::sleep(HEARTBEAT_LEASE + SHORT).await;
        let first = c.pass().await.expect("pass");
        tokio::time::sleep(HEARTBEAT_LEASE).await;
        let second = c.pass().await.expect("pass");
        passed.store(true, Ordering::SeqCst);
        first + second
    };
    let (done, taken) = tokio::join!(heartbeat, async {
        tokio::select! {
            r = long_run => panic!("the hanging operation ended: {r:?}"),
            n = passes => n,
        }
    });
    assert_eq!(done.expect("the live operation finishes"), "live");
    assert_eq!(taken, 0, "a record with a live lease was taken");
    assert_eq!(c.stats().stuck_seen, 0);
    // Its executor gone (the run dropped), the long-lease record's lease ends.
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(c.pass().await.expect("pass"), 1);
    assert_eq!(op.effects(&format!("{hanging}/record")).await, 1);
    drop(c);
    op.teardown().await;
}

/// Passes take at most the batch size: five stuck records with a batch of two take three
/// passes (2, 2, 1), and each record is resumed once.
pub async fn passes_take_bounded_batches<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let keys: Vec<String> = (0..5).map(|i| format!("h1.batch-{i}")).collect();
    for k in &keys {
        op.crash(SHORT, k, Phase::Reserve).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    let c = completer(&op, op.store(), LONG, 5, 2);
    let mut taken = Vec::new();
    for _ in 0..4 {
        taken.push(c.pass().await.expect("pass"));
    }
    assert_eq!(taken, [2, 2, 1, 0], "the batch limit was not kept");
    let s = c.stats();
    assert_eq!((s.passes, s.stuck_seen, s.resumed), (4, 5, 5), "{s:?}");
    for k in &keys {
        assert_eq!(op.effects(&format!("{k}/record")).await, 1, "{k}");
    }
    drop(c);
    op.teardown().await;
}

/// The stats and the metrics count what happened: records taken as stuck, resumed, failed
/// and given up, and nothing else.
pub async fn stats_and_metrics_count_stuck_resumed_failed_and_abandoned<F: CompleterFixture>(
    test: &str,
) {
    let op = op!(test);
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    // The check's future runs on this thread (`block_on`) and awaits every pass itself, so
    // the thread's own recorder sees the completer's counters and no other test's.
    let _guard = metrics::set_default_local_recorder(&recorder);
    // Three records in the first pass, so records and passes never count alike.
    op.crash(SHORT, "h1.ok-1", Phase::Reserve).await;
    op.crash(SHORT, "h1.ok-2", Phase::Reserve).await;
    op.run(
        &idem(op.store(), SHORT),
        "fail.bad",
        "input",
        Phase::Reserve,
    )
    .await
    .expect_err("the charge fails");
    tokio::time::sleep(PAST_SHORT).await;
    let c = completer(&op, op.store(), SHORT, 2, 32);
    assert_eq!(c.pass().await.expect("pass"), 3, "all three are stuck");
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(c.pass().await.expect("pass"), 1, "the failed one again");
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(c.pass().await.expect("pass"), 0);
    assert_eq!(
        counts(&c.stats()),
        [
            ("passes", 3),
            ("stuck_seen", 4),
            ("resumed", 2),
            ("abandoned", 1),
            ("failed", 1),
            ("unknown", 0),
            ("outages", 0),
        ]
    );
    let text = handle.render();
    for line in [
        "idem_completer_stuck_total 4",
        "idem_completer_resumed_total 2",
        "idem_completer_failed_total 1",
        "idem_completer_abandoned_total 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from:\n{text}"
        );
    }
    drop(c);
    op.teardown().await;
}

/// `run` finishes stuck records in passes until shut down, and returns its counts.
pub async fn run_resumes_stuck_records_until_shutdown<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let k = "h1.run";
    op.crash(SHORT, k, Phase::Reserve).await;
    tokio::time::sleep(PAST_SHORT).await;
    let c = completer(&op, op.store(), LONG, 5, 32);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(c.clone().run(shutdown.clone()));
    let started = Instant::now();
    while c.stats().resumed < 1 && started.elapsed() < PATIENCE {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("stops on shutdown")
        .expect("no panic");
    assert_eq!(
        (stats.resumed, stats.failed, stats.outages),
        (1, 0, 0),
        "{stats:?}"
    );
    assert_eq!(op.effects(&format!("{k}/record")).await, 1);
    drop(c);
    op.teardown().await;
}

/// A store that refuses (here: its requests table is missing) is an outage: `pass` returns
/// the error, `run` keeps waiting it out with backoff, and nothing counts as a pass, a
/// failure or a give-up.
pub async fn a_refusing_store_is_an_outage_not_a_failure<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let c = completer(&op, op.fx.refusing_store(), LONG, 1, 32);
    assert!(c.pass().await.is_err(), "the store refuses");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(c.clone().run(shutdown.clone()));
    let started = Instant::now();
    while c.stats().outages < 3 && started.elapsed() < PATIENCE {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("stops on shutdown")
        .expect("no panic");
    assert!(stats.outages >= 3, "run stopped retrying: {stats:?}");
    assert_eq!((stats.passes, stats.failed, stats.abandoned), (0, 0, 0));
    drop(c);
    op.teardown().await;
}

/// An operation that fails as an outage (the store went away under it) stops the pass with
/// the error, before the rest of the batch, counted as an outage and never as a failure or
/// a reason to give up; the records keep their points and a later pass finishes them.
pub async fn a_store_failing_under_an_operation_stops_the_pass_as_an_outage<F: CompleterFixture>(
    test: &str,
) {
    let op = op!(test);
    for k in ["h1.mid-1", "h1.mid-2"] {
        op.crash(SHORT, k, Phase::Reserve).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    let idem_short = Idempotency::builder(op.store())
        .lease(SHORT)
        .build()
        .expect("idempotency");
    let down = Completer::builder(idem_short)
        .max_attempts(5)
        .operation(
            scope(),
            "conformance_order",
            move |_: Idempotency<F::Store>, _stuck| {
                seen.fetch_add(1, Ordering::SeqCst);
                async {
                    Err(idem_core::Error::new(
                        idem_core::ErrorKind::Unavailable,
                        "the database went away",
                    ))
                }
            },
            |_: Execution<F::Store>, _| async { panic!("never given up for an outage") },
        )
        .build()
        .expect("completer");
    assert!(down.pass().await.is_err(), "an outage, not a pass");
    let s = down.stats();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the pass stops at the first"
    );
    assert_eq!((s.outages, s.failed, s.abandoned), (1, 0, 0), "{s:?}");
    assert_eq!(op.gave_up().len(), 0);
    tokio::time::sleep(PAST_SHORT).await;
    let up = completer(&op, op.store(), LONG, 5, 32);
    assert_eq!(up.pass().await.expect("pass"), 2, "both kept their points");
    for k in ["h1.mid-1", "h1.mid-2"] {
        assert_eq!(op.effects(&format!("{k}/record")).await, 1, "{k}");
    }
    drop((down, up));
    op.teardown().await;
}

/// A stuck record of a scope no operation is registered for is left alone (counted as
/// unknown; not resumed, failed or given up), and a completer that knows it resumes it.
pub async fn an_unknown_operation_is_left_alone<F: CompleterFixture>(test: &str) {
    let op = op!(test);
    let other = RequestScope::new(["another_operation"]);
    let k = "h1.unknown";
    op.crash_in(SHORT, other, k, Phase::Reserve).await;
    tokio::time::sleep(PAST_SHORT).await;
    let c = completer(&op, op.store(), SHORT, 2, 32);
    for _ in 0..4 {
        c.pass().await.expect("pass");
        tokio::time::sleep(PAST_SHORT).await;
    }
    let s = c.stats();
    assert!(s.unknown >= 1, "{s:?}");
    assert_eq!((s.resumed, s.abandoned, s.failed), (0, 0, 0), "{s:?}");
    assert!(op.gave_up().is_empty());
    assert_eq!(op.effects(&format!("{k}/record")).await, 0);
    let knows = completer_in(&op, op.store(), other, LONG, 100, 32);
    assert_eq!(knows.pass().await.expect("pass"), 1);
    assert_eq!(knows.stats().resumed, 1);
    assert_eq!(op.effects(&format!("{k}/record")).await, 1);
    drop((c, knows));
    op.teardown().await;
}
