//! The consumer-group [`Source`]: fetching, offset commits, and the rebalance hook.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use idem_consumer::{IdSource, Source};
use idem_core::{Error, ErrorKind};
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::delivery::{KafkaDelivery, Shared};
use crate::offsets::{Offsets, PartitionKey};
use crate::{MESSAGE_ID_HEADER, error};

pub(crate) fn lock(offsets: &Mutex<Offsets>) -> MutexGuard<'_, Offsets> {
    // The tracker's invariants hold between statements, so a panic elsewhere cannot leave it
    // half-updated in a way that matters more than losing the process would.
    offsets.lock().unwrap_or_else(|p| p.into_inner())
}

/// Consumer-group callbacks: commit what is settled before a partition goes away.
pub(crate) struct GroupContext {
    pub(crate) offsets: Arc<Mutex<Offsets>>,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{message}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", fac, "{message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "kafka client error");
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(revoked) = rebalance else {
            return;
        };
        // A lost assignment (session timed out) already belongs to someone else: a commit now
        // would be fenced by the coordinator, so only drop the tracking.
        let lost = consumer.assignment_lost();
        let mut commit = TopicPartitionList::new();
        {
            let mut offsets = lock(&self.offsets);
            for elem in revoked.elements() {
                let key: PartitionKey = (Arc::from(elem.topic()), elem.partition());
                // Forget the partition even when the assignment was lost.
                let advanced = offsets.revoke(&key);
                if let Some(pos) = advanced
                    && !lost
                {
                    // Only fails for a negative offset, which a delivered offset is not.
                    let _ = commit.add_partition_offset(
                        elem.topic(),
                        elem.partition(),
                        Offset::Offset(pos),
                    );
                }
            }
        }
        if commit.count() > 0 {
            // Synchronous: the next owner starts from the committed offset, so it must be
            // stored before this member gives the partitions up. Anything not committed here
            // is redelivered to the new owner as a duplicate.
            match consumer.commit(&commit, CommitMode::Sync) {
                Ok(()) => {
                    tracing::debug!(
                        partitions = commit.count(),
                        "committed settled offsets of revoked partitions"
                    )
                }
                Err(e) => {
                    tracing::warn!(error = %e, "committing revoked partitions failed; their settled messages will be redelivered as duplicates")
                }
            }
        }
        tracing::info!(partitions = revoked.count(), lost, "partitions revoked");
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                tracing::info!(partitions = tpl.count(), "partitions assigned")
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, committed: &TopicPartitionList) {
        if let Err(e) = result {
            tracing::warn!(error = %e, "offset commit failed; it will be sent again");
            let mut offsets = lock(&self.offsets);
            for elem in committed.elements() {
                if let Offset::Offset(pos) = elem.offset() {
                    offsets.commit_failed(&(Arc::from(elem.topic()), elem.partition()), pos);
                }
            }
        }
    }
}

/// A Kafka consumer-group member feeding the idem runner.
///
/// * Offsets are committed only up to the lowest offset of each partition that is not yet
///   settled, so out-of-order acknowledgements (runner concurrency above 1) never commit past
///   an unfinished message. Commits happen on every fetch, every
///   [`commit_interval`](crate::KafkaSourceBuilder::commit_interval) while idle, when a partition is
///   revoked, and on [`close`](Source::close).
/// * On a rebalance, the settled prefix of every revoked partition is committed before it is
///   released; messages of that partition still being processed here will be redelivered to
///   the new owner and found to be duplicates.
/// * An abandoned delivery (shutdown, store outage) and one whose dead letter could not be
///   published stay unsettled for the life of this consumer: the committed offset of its
///   partition stops there, so the message (and the ones after it, as duplicates) is consumed
///   again after a restart or rebalance. Kafka has no per-message negative acknowledgement.
/// * Kafka does not count deliveries, so [`Delivery::previous_deliveries`
///   ](idem_consumer::Delivery::previous_deliveries) is always 0.
/// * The rebalance callback and the offset commits run inside [`Source::next`]: a runner that
///   spends longer than `max.poll.interval.ms` (default 5 min) between fetches is removed from
///   the group, which costs redeliveries, never correctness.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<GroupContext>>,
    shared: Arc<Shared>,
    group_id: String,
    topics: Vec<String>,
    commit_interval: Duration,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dead_letter_topic", &self.shared.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// A member subscribed by [`KafkaSourceBuilder::connect`
    /// ](crate::KafkaSourceBuilder::connect).
    pub(crate) fn new(
        consumer: StreamConsumer<GroupContext>,
        shared: Shared,
        group_id: String,
        topics: Vec<String>,
        commit_interval: Duration,
    ) -> Self {
        Self {
            consumer: Arc::new(consumer),
            shared: Arc::new(shared),
            group_id,
            topics,
            commit_interval,
        }
    }

    /// The consumer group this source belongs to.
    pub fn group_id(&self) -> &str {
        &self.group_id
    }

    /// Commits the settled prefix of every partition now and waits for the broker's answer.
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when the commit failed; it is sent again on the next round.
    pub async fn commit(&self) -> Result<(), Error> {
        self.commit_sync(false).await
    }

    async fn commit_sync(&self, all: bool) -> Result<(), Error> {
        let Some((tpl, commits)) = self.pending(all) else {
            return Ok(());
        };
        let consumer = self.consumer.clone();
        let result = tokio::task::spawn_blocking(move || consumer.commit(&tpl, CommitMode::Sync))
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    format!("the offset commit task failed: {e}"),
                )
            })?;
        result.map_err(|e| {
            let mut offsets = lock(&self.shared.offsets);
            for (key, pos) in &commits {
                offsets.commit_failed(key, *pos);
            }
            error::unavailable("committing offsets", e)
        })
    }

    /// Sends the settled prefix without waiting; a failure is reported to the commit callback,
    /// which makes the next round send it again.
    fn commit_async(&self) {
        if let Some((tpl, commits)) = self.pending(false)
            && let Err(e) = self.consumer.commit(&tpl, CommitMode::Async)
        {
            tracing::warn!(error = %e, "offset commit could not be sent; retrying on the next round");
            let mut offsets = lock(&self.shared.offsets);
            for (key, pos) in &commits {
                offsets.commit_failed(key, *pos);
            }
        }
    }

    fn pending(&self, all: bool) -> Option<(TopicPartitionList, Vec<(PartitionKey, i64)>)> {
        let commits = lock(&self.shared.offsets).take_commits(all);
        if commits.is_empty() {
            return None;
        }
        let mut tpl = TopicPartitionList::with_capacity(commits.len());
        for ((topic, partition), pos) in &commits {
            // Only fails for a negative offset; positions come from delivered offsets.
            let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*pos));
        }
        Some((tpl, commits))
    }

    fn track(&self, msg: &BorrowedMessage<'_>) -> KafkaDelivery {
        let msg = msg.detach();
        let topic: Arc<str> = Arc::from(msg.topic());
        let ticket = lock(&self.shared.offsets).deliver(&topic, msg.partition(), msg.offset());
        KafkaDelivery::new(msg, ticket, self.shared.clone())
    }
}

impl Source for KafkaSource {
    type Delivery = KafkaDelivery;

    fn broker(&self) -> &'static str {
        "kafka"
    }

    fn default_id_source(&self) -> IdSource {
        IdSource::header(MESSAGE_ID_HEADER)
    }

    async fn next(&mut self, max: usize) -> Result<Vec<KafkaDelivery>, Error> {
        self.commit_async();
        let mut stream = self.consumer.stream();
        let mut tick = tokio::time::interval_at(
            tokio::time::Instant::now() + self.commit_interval,
            self.commit_interval,
        );
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Cancel-safe: a message leaves librdkafka's queue only in the poll that returns it,
        // and everything after that is synchronous.
        let first = loop {
            tokio::select! {
                m = stream.next() => match m {
                    Some(Err(KafkaError::PartitionEOF(_))) => continue,
                    Some(Ok(m)) => break m,
                    Some(Err(e)) => return Err(error::unavailable("fetching", e)),
                    None => return Err(Error::new(ErrorKind::Unavailable, "the Kafka message stream ended")),
                },
                _ = tick.tick() => self.commit_async(),
            }
        };
        let mut out = Vec::with_capacity(max.clamp(1, 64));
        out.push(self.track(&first));
        while out.len() < max {
            match stream.next().now_or_never() {
                Some(Some(Ok(m))) => out.push(self.track(&m)),
                Some(Some(Err(KafkaError::PartitionEOF(_)))) => {}
                Some(Some(Err(e))) => {
                    // Return what was fetched; a persistent failure surfaces on the next call.
                    tracing::warn!(error = %e, "kafka fetch error");
                    break;
                }
                Some(None) | None => break,
            }
        }
        Ok(out)
    }

    async fn close(self) -> Result<(), Error> {
        let committed = self.commit_sync(true).await;
        let KafkaSource { consumer, .. } = self;
        // Leaving the group waits for the coordinator; keep that off the async workers.
        let left = tokio::task::spawn_blocking(move || {
            consumer.unsubscribe();
            drop(consumer);
        })
        .await;
        if let Err(e) = left {
            tracing::warn!(error = %e, "closing the Kafka consumer failed");
        }
        committed
    }
}
