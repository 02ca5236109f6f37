//! One message, one claim ([`ClaimStore`](idem_core::ClaimStore)): a redelivery is a
//! duplicate, concurrent deliveries commit one effect, a reused ID with another payload is a
//! conflict, claims are per consumer, and IDs the store cannot hold never reach the handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    BoxError, Disposition, ErrorKind, Fingerprint, Message, MessageId, Outcome, Processor,
};

use super::{msg, processor};
use crate::fixture::StoreFixture;

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
