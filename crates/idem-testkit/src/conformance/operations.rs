//! What operators run ([`Migrate`], [`Stats`]): migrating again is harmless, and the stats
//! report each consumer's claims.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{BoxError, ManualClock, Migrate, Processor, Stats, Timestamp};

use super::msg;
use crate::fixture::StoreFixture;

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
