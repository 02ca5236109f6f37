//! `prune_periodically` against a real SQLite store: expired claims go at the first round, a
//! fresh claim stays, and the loop ends with its shutdown token.

use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{CancellationToken, prune_periodically};
use idem_core::{ManualClock, Message, MessageId, Migrate, Processor, Timestamp};
use idem_sql::{SqliteOptions, SqliteStore};

async fn claims(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_processed")
        .fetch_one(store.pool())
        .await
        .expect("count claims")
}

#[tokio::test]
async fn expired_claims_are_pruned_in_rounds_until_shutdown() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("p.db"), SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    let day = Duration::from_secs(86_400);
    let clock = Arc::new(ManualClock::new(Timestamp::from_micros(
        1_750_000_000_000_000,
    )));
    let processor = Arc::new(
        Processor::builder(store.clone(), "pruned")
            .keep_claims_for(2 * day)
            .redelivery_window(day)
            .clock(Arc::clone(&clock))
            .build()
            .expect("processor"),
    );
    let process = async |id: &str| {
        let msg = Message::new(MessageId::new(id).expect("id"), b"x".to_vec());
        processor
            .process(&msg, async |_tx| Ok::<_, idem_core::BoxError>(()))
            .await
            .expect("processed")
    };
    for id in ["old-1", "old-2", "old-3"] {
        let _ = process(id).await;
    }
    clock.advance(30 * day);
    let _ = process("fresh").await;
    assert_eq!(claims(&store).await, 4);

    let shutdown = CancellationToken::new();
    let pruner = tokio::spawn(prune_periodically(
        Arc::clone(&processor),
        Duration::from_millis(20),
        shutdown.clone(),
    ));
    let mut left = claims(&store).await;
    for _ in 0..250 {
        if left == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = claims(&store).await;
    }
    assert_eq!(
        left, 1,
        "the three expired claims are pruned, the fresh one stays"
    );
    // Later rounds find nothing more to delete.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(claims(&store).await, 1);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), pruner)
        .await
        .expect("the pruner stops on shutdown")
        .expect("the pruner task did not panic");
}
