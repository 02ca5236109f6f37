//! Set batches ([`BatchClaimStore`](idem_core::BatchClaimStore) and `process_batch_set`): one
//! claim statement, one handler call with exactly the new messages, one outcome per input.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BoxError, Error, ErrorKind, Fingerprint, Identified, Message, MessageId, Outcome, Processor,
};

use super::{Msg, msg, processor};
use crate::fixture::{StoreFixture, TxOf};

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
