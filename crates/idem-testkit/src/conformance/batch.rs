//! Batches with a handler per message ([`BatchClaimStore`](idem_core::BatchClaimStore) and
//! `process_batch`): one claim statement, and a failure isolated to its own message unless it
//! is not that message's.

use idem_core::{BoxError, Error, ErrorKind, Handler, Identified, Outcome};

use super::{Msg, msg, processor};
use crate::fixture::{StoreFixture, TxOf};

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
