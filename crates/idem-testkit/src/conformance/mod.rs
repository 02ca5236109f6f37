//! The conformance checks. Each takes a fresh fixture, asserts one property of the pattern
//! against the real store, and tears the fixture down.
//!
//! Effects are counted from the database, never from the handler's own bookkeeping: the point
//! is what committed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    BoxError, ConsumerName, Disposition, Error, ErrorKind, Fingerprint, Handler, Identified,
    ManualClock, Message, MessageId, Migrate, Outcome, Processor, Prune, Stamp, Stats, Timestamp,
    TransactionalStore,
};

use crate::fixture::{StoreFixture, TxOf};

type Msg = Message<Vec<u8>>;

fn msg(id: &str, payload: &str) -> Msg {
    Message::new(
        MessageId::new(id).expect("valid test id"),
        payload.as_bytes().to_vec(),
    )
}

fn processor<F: StoreFixture>(fx: &F, consumer: &str) -> Processor<F::Store> {
    Processor::builder(fx.store(), consumer)
        .build()
        .expect("valid processor")
}

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => fx,
            None => return,
        }
    };
}

/// A redelivery finds the claim: the handler runs once, the second delivery is a `Duplicate`.
pub async fn duplicate_delivery_runs_the_handler_once<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let m = msg("pay-1", r#"{"amount":100}"#);
    let first = p
        .process(&m, async |tx| F::record_effect(tx, "pay-1").await)
        .await;
    assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
    let again = p
        .process(&m, async |tx| F::record_effect(tx, "pay-1").await)
        .await;
    assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
    assert_eq!(fx.count_effects("pay-1").await, 1);
    assert_eq!(fx.count_claims().await, 1);
    fx.teardown().await;
}

/// 16 workers receive the same message at once: exactly one effect commits, the other 15 see a
/// duplicate. The handler sleeps to hold its transaction open while the others arrive.
pub async fn concurrent_duplicates_commit_exactly_one_effect<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = Arc::new(processor(&fx, "billing"));
    let ran = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let p = Arc::clone(&p);
        let ran = Arc::clone(&ran);
        tasks.push(tokio::spawn(async move {
            let m = msg("pay-race", r#"{"amount":5}"#);
            p.process(&m, async |tx| {
                ran.fetch_add(1, Ordering::SeqCst);
                F::record_effect(tx, "pay-race").await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, BoxError>(())
            })
            .await
        }));
    }
    let (mut processed, mut duplicates) = (0, 0);
    for t in tasks {
        match t.await.expect("task panicked") {
            Ok(Outcome::Processed(())) => processed += 1,
            Ok(Outcome::Duplicate) => duplicates += 1,
            other => panic!("unexpected outcome under contention: {other:?}"),
        }
    }
    assert_eq!((processed, duplicates), (1, 15));
    assert_eq!(ran.load(Ordering::SeqCst), 1, "a duplicate ran the handler");
    assert_eq!(fx.count_effects("pay-race").await, 1);
    assert_eq!(fx.count_claims().await, 1);
    fx.teardown().await;
}

/// A failing handler leaves neither its writes nor a claim, so the redelivery processes it.
pub async fn handler_error_rolls_back_the_claim_and_the_effect<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let m = msg("pay-2", "x");
    let err = p
        .process(&m, async |tx| {
            F::record_effect(tx, "pay-2").await?;
            Err::<(), BoxError>("payment gateway timed out".into())
        })
        .await
        .expect_err("handler error must surface");
    assert_eq!(err.kind(), ErrorKind::Handler);
    assert_eq!(err.disposition(), Disposition::Retry);
    assert!(
        err.to_string().contains("payment gateway timed out"),
        "{err}"
    );
    assert_eq!(fx.count_effects("pay-2").await, 0);
    assert_eq!(fx.count_claims().await, 0);
    let retry = p
        .process(&m, async |tx| F::record_effect(tx, "pay-2").await)
        .await;
    assert!(matches!(retry, Ok(Outcome::Processed(()))), "{retry:?}");
    assert_eq!(fx.count_effects("pay-2").await, 1);
    fx.teardown().await;
}

/// A handler that swallows a failed statement and returns `Ok`: whatever the engine does with
/// the transaction (PostgreSQL aborts it, others carry on), `process` may report `Processed`
/// only if the effect and the claim really committed — otherwise the caller would ack a lost
/// message.
pub async fn a_swallowed_database_error_never_reports_an_uncommitted_message<F: StoreFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let out = p
        .process(&msg("pay-swallow", "x"), async |tx| {
            F::record_effect(tx, "pay-swallow").await?;
            let _ignored = F::fail_statement(tx).await;
            Ok::<_, BoxError>(())
        })
        .await;
    let (effects, claims) = (
        fx.count_effects("pay-swallow").await,
        fx.count_claims().await,
    );
    match out {
        Ok(Outcome::Processed(())) => assert_eq!((effects, claims), (1, 1), "reported processed"),
        Err(e) => {
            assert_eq!((effects, claims), (0, 0), "reported {e}");
            assert!(e.is_retryable(), "{e:?}");
        }
        other => panic!("unexpected {other:?}"),
    }
    fx.teardown().await;
}

/// `Error::reject` from a handler keeps its kind: dead-letter, nothing committed.
pub async fn rejected_message_is_dead_lettered_and_leaves_no_claim<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let err = p
        .process(&msg("pay-bad", "{"), async |tx| {
            F::record_effect(tx, "pay-bad").await?;
            Err::<(), BoxError>(Error::reject("payload is not valid JSON").into())
        })
        .await
        .expect_err("rejection must surface");
    assert_eq!(err.kind(), ErrorKind::Rejected);
    assert_eq!(err.disposition(), Disposition::DeadLetter);
    assert_eq!(fx.count_effects("pay-bad").await, 0);
    assert_eq!(fx.count_claims().await, 0);
    fx.teardown().await;
}

/// Same ID, different payload: a `Conflict` carrying both fingerprints; the handler does not run.
pub async fn fingerprint_conflict_is_reported_not_skipped<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let original = msg("pay-3", r#"{"amount":100}"#);
    let reused = msg("pay-3", r#"{"amount":999}"#);
    assert!(
        p.process(&original, async |tx| F::record_effect(tx, "pay-3").await)
            .await
            .is_ok()
    );
    let out = p
        .process(&reused, async |tx| F::record_effect(tx, "pay-3").await)
        .await;
    match out {
        Ok(Outcome::Conflict { stored, received }) => {
            assert_eq!(stored, Fingerprint::of(r#"{"amount":100}"#));
            assert_eq!(received, Fingerprint::of(r#"{"amount":999}"#));
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(fx.count_effects("pay-3").await, 1);
    fx.teardown().await;
}

/// Claims are per consumer: billing and receipts each process the message once.
pub async fn each_consumer_processes_a_message_once<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let billing = processor(&fx, "billing");
    let receipts = processor(&fx, "receipts");
    let m = msg("pay-4", "x");
    for p in [&billing, &receipts, &billing, &receipts] {
        let _ = p
            .process(&m, async |tx| F::record_effect(tx, "pay-4").await)
            .await;
    }
    assert_eq!(fx.count_effects("pay-4").await, 2);
    assert_eq!(fx.count_claims().await, 2);
    fx.teardown().await;
}

/// Records the message's effect under its ID and returns the ID; `b-fail` is declined after
/// its write, which must roll back with its claim.
struct RecordOrDecline<F>(std::marker::PhantomData<fn() -> F>);

impl<F: StoreFixture> Handler<TxOf<F>, Vec<u8>> for RecordOrDecline<F> {
    type Output = String;

    async fn handle(&self, tx: &mut TxOf<F>, m: &Msg) -> Result<String, BoxError> {
        let key = m.message_id().to_string();
        F::record_effect(tx, &key).await?;
        if key == "b-fail" {
            return Err("card declined".into());
        }
        Ok(key)
    }
}

/// One claim statement, a handler per new message: the failing message is left out (the batch
/// is redone without it, so nothing of it commits), the rest commit together, and duplicates
/// (earlier in the batch, or from before) and conflicts are reported per message.
pub async fn batch_with_one_failing_message_rolls_back_only_that_message<F: StoreFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    assert!(
        p.process(&msg("b-old", "o"), async |tx| F::record_effect(tx, "b-old")
            .await)
            .await
            .is_ok()
    );
    let batch = vec![
        msg("b-1", "1"),
        msg("b-2", "2"),
        msg("b-fail", "f"),
        msg("b-1", "1"),     // repeat inside the batch
        msg("b-old", "o"),   // processed before
        msg("b-old", "new"), // conflict
        msg("b-3", "3"),
    ];
    let results = p
        .process_batch(&batch, &RecordOrDecline::<F>(std::marker::PhantomData))
        .await
        .expect("batch commits");
    assert_eq!(results.len(), batch.len());
    assert!(
        matches!(&results[0], Ok(Outcome::Processed(k)) if k == "b-1"),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(&results[1], Ok(Outcome::Processed(k)) if k == "b-2"),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(&results[2], Err(e) if e.kind() == ErrorKind::Handler),
        "{:?}",
        results[2]
    );
    assert!(
        matches!(&results[3], Ok(Outcome::Duplicate)),
        "{:?}",
        results[3]
    );
    assert!(
        matches!(&results[4], Ok(Outcome::Duplicate)),
        "{:?}",
        results[4]
    );
    assert!(
        matches!(&results[5], Ok(Outcome::Conflict { .. })),
        "{:?}",
        results[5]
    );
    assert!(
        matches!(&results[6], Ok(Outcome::Processed(_))),
        "{:?}",
        results[6]
    );
    for (key, n) in [
        ("b-1", 1),
        ("b-2", 1),
        ("b-3", 1),
        ("b-fail", 0),
        ("b-old", 1),
    ] {
        assert_eq!(fx.count_effects(key).await, n, "effects of {key}");
    }
    assert_eq!(fx.count_claims().await, 4, "b-old, b-1, b-2, b-3");
    // The failed message was not claimed, so its redelivery is processed.
    let retry = p
        .process(&msg("b-fail", "f"), async |tx| {
            F::record_effect(tx, "b-fail").await
        })
        .await;
    assert!(matches!(retry, Ok(Outcome::Processed(()))), "{retry:?}");
    fx.teardown().await;
}

/// Records the effect, then fails: `t-deadlock` with a transient error (not its message's:
/// the whole batch fails), any `t-bad…` with a handler error (its message's).
struct RecordThenFail<F>(std::marker::PhantomData<fn() -> F>);

impl<F: StoreFixture> Handler<TxOf<F>, Vec<u8>> for RecordThenFail<F> {
    type Output = ();

    async fn handle(&self, tx: &mut TxOf<F>, m: &Msg) -> Result<(), BoxError> {
        let key = m.message_id().to_string();
        F::record_effect(tx, &key).await?;
        if key == "t-deadlock" {
            return Err(Error::new(ErrorKind::Transient, "deadlock (injected)").into());
        }
        if key.starts_with("t-bad") {
            return Err("declined".into());
        }
        Ok(())
    }
}

/// A handler error that is not its message's (a deadlock, an outage) fails the whole batch and
/// commits nothing; a message whose every delivery in the batch fails is reported failed for
/// each of them, and the others still commit.
pub async fn batch_fails_whole_on_an_error_that_is_not_one_messages<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let handler = RecordThenFail::<F>(std::marker::PhantomData);
    let batch = vec![msg("t-1", "1"), msg("t-deadlock", "d"), msg("t-2", "2")];
    let whole = p.process_batch(&batch, &handler).await;
    assert!(
        matches!(&whole, Err(e) if e.kind() == ErrorKind::Transient),
        "{whole:?}"
    );
    assert_eq!(fx.count_claims().await, 0, "nothing of the batch committed");
    for key in ["t-1", "t-deadlock", "t-2"] {
        assert_eq!(fx.count_effects(key).await, 0, "effects of {key}");
    }
    // `t-bad` twice: its repeat becomes the first occurrence once `t-bad` is left out, runs,
    // and fails too; both are reported, and `t-3` commits in the third pass.
    let batch = vec![msg("t-bad", "b"), msg("t-3", "3"), msg("t-bad", "b")];
    let results = p.process_batch(&batch, &handler).await.expect("commits");
    assert!(
        matches!(&results[0], Err(e) if e.kind() == ErrorKind::Handler),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(&results[1], Ok(Outcome::Processed(()))),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(&results[2], Err(e) if e.kind() == ErrorKind::Handler),
        "{:?}",
        results[2]
    );
    assert_eq!(fx.count_effects("t-3").await, 1);
    assert_eq!(fx.count_effects("t-bad").await, 0);
    assert_eq!(fx.count_claims().await, 1, "t-3 only");
    fx.teardown().await;
}

/// Collects the new messages' IDs: the [`SetHandler`](idem_core::SetHandler) form of a set
/// batch, which the runner's set mode runs.
struct RecordAll<F>(std::marker::PhantomData<fn() -> F>);

impl<F: StoreFixture> idem_core::SetHandler<TxOf<F>, Vec<u8>> for RecordAll<F> {
    type Output = Vec<String>;

    async fn handle_set(&self, tx: &mut TxOf<F>, fresh: &[&Msg]) -> Result<Vec<String>, BoxError> {
        let mut keys = Vec::new();
        for m in fresh {
            let key = m.message_id().to_string();
            F::record_effect(tx, &key).await?;
            keys.push(key);
        }
        Ok(keys)
    }
}

/// The set-based form: the handler receives exactly the new messages, once; duplicates,
/// conflicts and invalid IDs are reported per input position.
pub async fn set_batch_claims_in_one_statement_and_hands_over_only_new_messages<F: StoreFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let p = Processor::builder(fx.store(), "billing")
        .max_message_id_len(20)
        .build()
        .expect("valid processor");
    assert!(
        p.process(&msg("s-old", "o"), async |tx| F::record_effect(tx, "s-old")
            .await)
            .await
            .is_ok()
    );
    let long = Message::new(
        MessageId::new("s-".repeat(15)).expect("valid"),
        b"l".to_vec(),
    );
    let batch = vec![
        msg("s-2", "2"),
        msg("s-1", "1"),
        msg("s-old", "o"),     // duplicate of a stored claim
        msg("s-old", "other"), // conflict with a stored claim
        msg("s-1", "1"),       // duplicate inside the batch
        msg("s-2", "changed"), // conflict inside the batch
        long,                  // over this processor's 20-byte limit
        msg("s-3", "3"),
    ];
    let report = p
        .process_batch_set(&batch, async |tx, fresh: &[&Msg]| {
            let mut keys = Vec::new();
            for m in fresh {
                let key = m.message_id().to_string();
                F::record_effect(tx, &key).await?;
                keys.push(key);
            }
            Ok::<_, BoxError>(keys)
        })
        .await
        .expect("batch commits");
    let mut handed = report.output.clone().expect("handler ran");
    handed.sort();
    assert_eq!(handed, ["s-1", "s-2", "s-3"]);
    let o = &report.outcomes;
    assert!(matches!(o[0], Ok(Outcome::Processed(()))), "{:?}", o[0]);
    assert!(matches!(o[1], Ok(Outcome::Processed(()))), "{:?}", o[1]);
    assert!(matches!(o[2], Ok(Outcome::Duplicate)), "{:?}", o[2]);
    match &o[3] {
        Ok(Outcome::Conflict { stored, received }) => {
            assert_eq!(*stored, Fingerprint::of("o"));
            assert_eq!(*received, Fingerprint::of("other"));
        }
        other => panic!("expected conflict with stored claim, got {other:?}"),
    }
    assert!(matches!(o[4], Ok(Outcome::Duplicate)), "{:?}", o[4]);
    assert!(matches!(o[5], Ok(Outcome::Conflict { .. })), "{:?}", o[5]);
    assert!(
        matches!(&o[6], Err(e) if e.kind() == ErrorKind::InvalidMessageId),
        "{:?}",
        o[6]
    );
    assert!(matches!(o[7], Ok(Outcome::Processed(()))), "{:?}", o[7]);
    for key in ["s-1", "s-2", "s-3", "s-old"] {
        assert_eq!(fx.count_effects(key).await, 1, "effects of {key}");
    }
    // Repeats are judged against what the store holds, not against another delivery: with
    // "s-old" stored as "o", a batch [other, other] is two conflicts and [other, o] a conflict
    // and a duplicate.
    let twice = vec![msg("s-old", "other"), msg("s-old", "other")];
    let r = p
        .process_batch_set(&twice, async |_tx, fresh: &[&Msg]| {
            Ok::<_, BoxError>(fresh.len())
        })
        .await
        .expect("batch");
    assert!(
        r.outcomes
            .iter()
            .all(|o| matches!(o, Ok(Outcome::Conflict { .. }))),
        "{r:?}"
    );
    let mixed = vec![msg("s-old", "other"), msg("s-old", "o")];
    let r = p
        .process_batch_set(&mixed, async |_tx, fresh: &[&Msg]| {
            Ok::<_, BoxError>(fresh.len())
        })
        .await
        .expect("batch");
    match &r.outcomes[0] {
        Ok(Outcome::Conflict { stored, .. }) => assert_eq!(*stored, Fingerprint::of("o")),
        other => panic!("expected a conflict with the stored claim, got {other:?}"),
    }
    assert!(
        matches!(r.outcomes[1], Ok(Outcome::Duplicate)),
        "{:?}",
        r.outcomes[1]
    );
    // The trait form settles the same way: only `s-4` is new.
    let trait_form = vec![msg("s-4", "4"), msg("s-1", "1"), msg("s-4", "4")];
    let r = p
        .process_batch_set_with(&trait_form, &RecordAll::<F>(std::marker::PhantomData))
        .await
        .expect("trait-form batch");
    assert_eq!(r.output.as_deref(), Some(&["s-4".to_owned()][..]));
    assert!(
        matches!(
            r.outcomes[..],
            [
                Ok(Outcome::Processed(())),
                Ok(Outcome::Duplicate),
                Ok(Outcome::Duplicate)
            ]
        ),
        "{:?}",
        r.outcomes
    );
    assert_eq!(fx.count_effects("s-4").await, 1);
    // Redelivering the whole batch: nothing is new, the handler does not run.
    let again = p
        .process_batch_set(&batch, async |_tx, fresh: &[&Msg]| {
            Ok::<_, BoxError>(fresh.len())
        })
        .await
        .expect("second batch");
    assert_eq!(again.output, None);
    assert!(
        again
            .outcomes
            .iter()
            .all(|o| !matches!(o, Ok(Outcome::Processed(_))))
    );
    assert_eq!(fx.count_claims().await, 5, "s-1, s-2, s-3, s-4, s-old");
    fx.teardown().await;
}

/// A set handler's error rolls back every claim of the batch.
pub async fn set_batch_handler_error_rolls_back_the_whole_batch<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let batch: Vec<Msg> = (0..50).map(|i| msg(&format!("r-{i}"), "x")).collect();
    let err = p
        .process_batch_set(&batch, async |tx, fresh: &[&Msg]| {
            for m in fresh {
                F::record_effect(tx, &m.message_id().to_string()).await?;
            }
            Err::<(), BoxError>(Error::retry("ledger unavailable").into())
        })
        .await
        .expect_err("handler error surfaces");
    assert_eq!(err.kind(), ErrorKind::Handler);
    assert_eq!(fx.count_claims().await, 0);
    assert_eq!(fx.count_effects("r-0").await, 0);
    fx.teardown().await;
}

/// Two workers claim overlapping batches at once (the broker redelivered half a batch to
/// another consumer): every message's effect commits exactly once across both.
pub async fn concurrent_set_batches_sharing_ids_commit_each_effect_once<F: StoreFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let p = Arc::new(processor(&fx, "billing"));
    let a: Vec<Msg> = (0..60).map(|i| msg(&format!("o-{i:03}"), "x")).collect();
    let b: Vec<Msg> = (30..90)
        .rev()
        .map(|i| msg(&format!("o-{i:03}"), "x"))
        .collect();
    let mut tasks = Vec::new();
    for batch in [a, b] {
        let p = Arc::clone(&p);
        tasks.push(tokio::spawn(async move {
            for attempt in 0..5 {
                let r = p
                    .process_batch_set(&batch, async |tx, fresh: &[&Msg]| {
                        for m in fresh {
                            F::record_effect(tx, &m.message_id().to_string()).await?;
                        }
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        Ok::<_, BoxError>(fresh.len())
                    })
                    .await;
                match r {
                    Ok(report) => return report.output.unwrap_or(0),
                    // Engines may pick a deadlock victim; it is retryable by contract.
                    Err(e) if e.is_retryable() && attempt < 4 => continue,
                    Err(e) => panic!("batch failed: {e:?}"),
                }
            }
            unreachable!()
        }));
    }
    let mut handled = 0;
    for t in tasks {
        handled += t.await.expect("task panicked");
    }
    assert_eq!(
        handled, 90,
        "each of the 90 distinct messages handled once in total"
    );
    for i in [0, 29, 30, 59, 60, 89] {
        assert_eq!(fx.count_effects(&format!("o-{i:03}")).await, 1, "o-{i:03}");
    }
    assert_eq!(fx.count_claims().await, 90);
    fx.teardown().await;
}

/// Naturally idempotent handlers opt out of the claim: same API, no row, handler runs each time.
pub async fn naturally_idempotent_mode_writes_no_claim<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = Processor::builder(fx.store(), "shipping")
        .naturally_idempotent()
        .build()
        .expect("valid processor");
    let m = msg("ship-1", "status=shipped");
    for _ in 0..2 {
        let out = p
            .process(&m, async |tx| F::record_effect(tx, "ship-1").await)
            .await;
        assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
    }
    assert_eq!(fx.count_claims().await, 0);
    assert_eq!(fx.count_effects("ship-1").await, 2);
    fx.teardown().await;
}

/// The low-level claim inside a transaction the caller began and commits.
pub async fn low_level_claim_composes_with_the_callers_transaction<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let p = processor(&fx, "billing");
    let store = fx.store();
    let m = msg("ll-1", "x");
    for expected_new in [true, false] {
        let mut tx = store.begin().await.expect("begin");
        let claim = p.claim_in(&mut tx, &m).await.expect("claim");
        assert_eq!(claim == idem_core::Claim::New, expected_new, "{claim:?}");
        if claim == idem_core::Claim::New {
            F::record_effect(&mut tx, "ll-1").await.expect("effect");
        }
        store.commit(tx).await.expect("commit");
    }
    // A claim whose transaction rolls back is gone.
    let mut tx = store.begin().await.expect("begin");
    let claim = p.claim_in(&mut tx, &msg("ll-2", "x")).await.expect("claim");
    assert_eq!(claim, idem_core::Claim::New);
    store.rollback(tx).await.expect("rollback");
    assert_eq!(fx.count_effects("ll-1").await, 1);
    assert_eq!(fx.count_claims().await, 1);
    fx.teardown().await;
}

/// Bad IDs never reach the handler and come back as `InvalidMessageId` (dead-letter).
pub async fn oversized_and_empty_ids_are_rejected<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    assert_eq!(
        MessageId::new("").expect_err("empty").kind(),
        ErrorKind::InvalidMessageId
    );
    let p = processor(&fx, "billing");
    let long = Message::new(
        MessageId::with_limit("x".repeat(300), 1024).expect("valid"),
        vec![],
    );
    let err = p
        .process(&long, async |tx| F::record_effect(tx, "long").await)
        .await
        .expect_err("over the default 255 bytes");
    assert_eq!(err.kind(), ErrorKind::InvalidMessageId);
    assert_eq!(err.disposition(), Disposition::DeadLetter);
    assert!(err.to_string().contains("300 bytes"), "{err}");
    // A processor configured for longer IDs stores them.
    let wide = Processor::builder(fx.store(), "billing")
        .max_message_id_len(1024)
        .build()
        .expect("store holds 1024-byte IDs");
    let out = wide
        .process(&long, async |tx| F::record_effect(tx, "long").await)
        .await;
    assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
    assert_eq!(fx.count_effects("long").await, 1);
    fx.teardown().await;
}

/// Pruning deletes claims older than the retention, in bounded batches, and nothing newer.
pub async fn prune_deletes_only_expired_claims_in_bounded_batches<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let day = Duration::from_secs(86_400);
    let clock = Arc::new(ManualClock::new(Timestamp::from_micros(
        1_750_000_000_000_000,
    )));
    let p = Processor::builder(fx.store(), "billing")
        .keep_claims_for(7 * day)
        .redelivery_window(3 * day)
        .prune_batch_size(10)
        .clock(Arc::clone(&clock))
        .build()
        .expect("valid processor");
    let old: Vec<Msg> = (0..25).map(|i| msg(&format!("p-old-{i}"), "x")).collect();
    let report = p
        .process_batch_set(&old, async |_tx, _fresh: &[&Msg]| Ok::<_, BoxError>(()))
        .await
        .expect("old batch");
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| matches!(o, Ok(Outcome::Processed(()))))
    );
    clock.advance(5 * day);
    for i in 0..5 {
        let m = msg(&format!("p-new-{i}"), "x");
        assert!(
            p.process(&m, async |_tx| Ok::<_, BoxError>(()))
                .await
                .is_ok()
        );
    }
    // Day 5: nothing has expired yet.
    assert_eq!(p.prune().await.expect("prune"), 0);
    clock.advance(3 * day);
    // Day 8: the 25 old claims are past 7 days. One bounded batch deletes at most its limit.
    let consumer = ConsumerName::new("billing").expect("valid");
    assert_eq!(
        fx.store()
            .prune_batch(Some(&consumer), Stamp::At(clock_now(&clock)), 7 * day, 10)
            .await
            .expect("batch"),
        10
    );
    assert_eq!(p.prune().await.expect("prune"), 15);
    assert_eq!(fx.count_claims().await, 5);
    // Another consumer's claims are not touched by this consumer's prune.
    let other = processor(&fx, "receipts");
    assert!(
        other
            .process(&msg("p-other", "x"), async |_tx| Ok::<_, BoxError>(()))
            .await
            .is_ok()
    );
    clock.advance(30 * day);
    assert_eq!(p.prune().await.expect("prune"), 5);
    assert_eq!(fx.count_claims().await, 1);
    fx.teardown().await;
}

fn clock_now(clock: &ManualClock) -> Timestamp {
    idem_core::Clock::now(clock)
}

/// Startup refuses a retention shorter than the declared redelivery window, naming both.
pub async fn retention_shorter_than_the_redelivery_window_is_refused<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    let day = Duration::from_secs(86_400);
    let err = Processor::builder(fx.store(), "billing")
        .keep_claims_for(day)
        .redelivery_window(7 * day)
        .build()
        .expect_err("must refuse");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    let text = err.to_string();
    assert!(text.contains("1d") && text.contains("7d"), "{text}");
    let err = Processor::builder(fx.store(), "billing")
        .keep_claims_for(day)
        .build()
        .expect_err("retention without a declared window must be refused");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    // A validated `Retention` goes through whole, clock margin included.
    let retention = idem_core::Retention::new(10 * day, 3 * day)
        .expect("valid retention")
        .with_clock_margin(Duration::from_secs(120));
    let p = Processor::builder(fx.store(), "billing")
        .retention(retention)
        .build()
        .expect("valid processor");
    assert_eq!(p.retention(), retention);
    fx.teardown().await;
}

/// `migrate` can run again; `stats` reports claims per consumer with oldest and newest.
pub async fn migrate_is_idempotent_and_stats_report_per_consumer<F: StoreFixture>(test: &str) {
    let fx = fixture!(test);
    fx.store().migrate().await.expect("second migrate");
    fx.store().migrate().await.expect("third migrate");
    let clock = Arc::new(ManualClock::new(Timestamp::from_micros(1_000_000)));
    let b = Processor::builder(fx.store(), "billing")
        .clock(Arc::clone(&clock))
        .build()
        .expect("valid");
    let r = Processor::builder(fx.store(), "receipts")
        .clock(Arc::clone(&clock))
        .build()
        .expect("valid");
    for i in 0..3 {
        let _ = b
            .process(&msg(&format!("st-{i}"), "x"), async |_tx| {
                Ok::<_, BoxError>(())
            })
            .await;
        clock.advance(Duration::from_secs(1));
    }
    let _ = r
        .process(&msg("st-0", "x"), async |_tx| Ok::<_, BoxError>(()))
        .await;
    let stats = fx.store().stats().await.expect("stats");
    assert_eq!(stats.len(), 2, "{stats:?}");
    assert_eq!(
        (stats[0].consumer.as_str(), stats[0].claims),
        ("billing", 3)
    );
    assert_eq!(stats[0].oldest, Timestamp::from_micros(1_000_000));
    assert_eq!(stats[0].newest, Timestamp::from_micros(3_000_000));
    assert_eq!(
        (stats[1].consumer.as_str(), stats[1].claims),
        ("receipts", 1)
    );
    fx.teardown().await;
}
