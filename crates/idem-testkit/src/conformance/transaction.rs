//! The claim and the handler's writes share one transaction ([`TransactionalStore`]): they
//! commit together or not at all, whether `process` owns the transaction or the caller does.

use idem_core::{BoxError, Disposition, Error, ErrorKind, Outcome, TransactionalStore};

use super::{msg, processor};
use crate::fixture::StoreFixture;

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
