//! A consumer-group member run by idem's runner in a task of its own, for the tests that make
//! members join and leave: what it settled and its group membership, readable from outside.

use std::time::Duration;

use idem_consumer::{CancellationToken, Consumer, Observer, Raw, RunStats};
use idem_kafka::{KafkaSourceBuilder, Membership};

use super::{Db, RecordEffect};

/// One member: `consumer`'s claims in `db`, four messages at a time, one effect row each.
pub struct Member {
    pub observer: Observer,
    pub membership: Membership,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<RunStats, idem_core::Error>>,
}

impl Member {
    pub async fn start(
        db: &Db,
        consumer: &str,
        brokers: &str,
        builder: KafkaSourceBuilder,
    ) -> Member {
        let source = builder.connect(brokers).await.expect("source");
        let membership = source.membership();
        let stop = CancellationToken::new();
        let consumer = Consumer::new(db.processor(consumer), source).concurrency(4);
        let observer = consumer.observer();
        let task = tokio::spawn(consumer.run(Raw, RecordEffect, stop.clone()));
        Member {
            observer,
            membership,
            stop,
            task,
        }
    }

    /// Messages it processed or found duplicate.
    pub fn settled(&self) -> u64 {
        let s = self.observer.snapshot();
        s.processed + s.duplicates
    }

    /// Stops the runner, which closes the source (committing, then leaving the group or, as a
    /// static member, not).
    pub async fn stop(self) -> RunStats {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("stops in time")
            .expect("no panic")
            .expect("no fatal error")
    }
}

/// Whether `cond` holds within `timeout`, polled every 50 ms.
pub async fn wait_until(timeout: Duration, mut cond: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond().await
}
