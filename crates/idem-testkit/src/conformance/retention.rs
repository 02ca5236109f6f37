//! Retention ([`Prune`]): claims are kept for the configured time and then pruned in bounded
//! batches, and a retention too short for the redelivery window is refused.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BoxError, ConsumerName, ErrorKind, ManualClock, Outcome, Processor, Prune, Stamp, Timestamp,
};

use super::{Msg, msg, processor};
use crate::fixture::StoreFixture;

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
