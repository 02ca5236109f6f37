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
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::delivery::{KafkaDelivery, Shared};
use crate::membership::{self, Membership};
use crate::offsets::{Offsets, PartitionKey};
use crate::{MESSAGE_ID_HEADER, error};

pub(crate) fn lock(offsets: &Mutex<Offsets>) -> MutexGuard<'_, Offsets> {
    // The tracker's invariants hold between statements, so a panic elsewhere cannot leave it
    // half-updated in a way that matters more than losing the process would.
    offsets.lock().unwrap_or_else(|p| p.into_inner())
}

/// librdkafka's log facility for "the broker cannot take a `group.instance.id`" (JoinGroup
/// before v5): it then joins without one and says so at notice level — but at most once a day
/// counted from the host's boot, so not at all during a host's first day up.
const NO_STATIC_MEMBERSHIP_FACILITY: &str = "STATICMEMBER";
/// librdkafka's `cgrp` debug facility for "the coordinator assigned this member ID", which
/// tells whether the broker kept the static member ID ([`Membership`]).
const MEMBER_ID_FACILITY: &str = "MEMBERID";
/// librdkafka's `cgrp` debug facility for "sending LeaveGroup".
const LEAVE_FACILITY: &str = "LEAVE";
/// How long a close waits for librdkafka to send a LeaveGroup it had to be asked for.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Consumer-group callbacks: commit what is settled before a partition goes away, and keep
/// [`Membership`] current.
pub(crate) struct GroupContext {
    pub(crate) offsets: Arc<Mutex<Offsets>>,
    pub(crate) membership: Membership,
}

impl GroupContext {
    fn static_membership_refused(&self) {
        tracing::warn!(
            "the Kafka broker does not keep static members (KIP-345, Kafka 2.3+); this member \
             is a dynamic one: a restart rebalances the group, and closing leaves it"
        );
    }
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        match fac {
            NO_STATIC_MEMBERSHIP_FACILITY if self.membership.refuse() => {
                self.static_membership_refused()
            }
            LEAVE_FACILITY => self.membership.note_leave(),
            MEMBER_ID_FACILITY => {
                if let Some(id) = membership::member_id_from_log(message)
                    && self.membership.joined_as(id)
                {
                    self.static_membership_refused();
                }
            }
            _ => {}
        }
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
        self.membership.revoked(revoked);
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
                self.membership.assigned(tpl);
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
/// * [`close`](Source::close) commits the settled prefix, then leaves the group — except a
///   [static member](crate::KafkaSourceBuilder::static_member), which keeps its partitions
///   for the session timeout so that its restart takes them back without a rebalance.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<GroupContext>>,
    shared: Arc<Shared>,
    membership: Membership,
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
        membership: Membership,
        group_id: String,
        topics: Vec<String>,
        commit_interval: Duration,
    ) -> Self {
        Self {
            consumer: Arc::new(consumer),
            shared: Arc::new(shared),
            membership,
            group_id,
            topics,
            commit_interval,
        }
    }

    /// The consumer group this source belongs to.
    pub fn group_id(&self) -> &str {
        &self.group_id
    }

    /// What the group does to this member (assignments, revocations, the partitions held) and
    /// whether it is a static member; a live view that stays valid after the source is handed
    /// to the runner.
    pub fn membership(&self) -> Membership {
        self.membership.clone()
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

    /// A member configured static that the broker made dynamic must leave like one, but
    /// librdkafka's close never sends LeaveGroup for a configured `group.instance.id`; only
    /// `unsubscribe` does, once the application has served the revocation it starts. Serve it
    /// here, and wait (briefly) until librdkafka says it left.
    async fn leave_as_dynamic(&self) {
        self.consumer.unsubscribe();
        let mut stream = self.consumer.stream();
        let deadline = tokio::time::Instant::now() + LEAVE_TIMEOUT;
        while !self.membership.has_left() && tokio::time::Instant::now() < deadline {
            // Polling runs the revoke callback; messages still queued are not settled here
            // and come again to the partitions' next owner.
            let _ = tokio::time::timeout(Duration::from_millis(100), stream.next()).await;
        }
        if !self.membership.has_left() {
            tracing::warn!(group = %self.group_id, "leaving the group took over {LEAVE_TIMEOUT:?}; its partitions move on once the session times out");
        }
    }

    /// A fatal client error ends this consumer for good (librdkafka stops it), so it is no
    /// outage to wait out. The one a group member meets is `FENCED_INSTANCE_ID`: another
    /// process joined with the same static member ID.
    fn fetch_error(&self, e: KafkaError) -> Error {
        if !matches!(e, KafkaError::MessageConsumptionFatal(_)) {
            return error::unavailable("fetching", e);
        }
        let (code, reason) = self
            .consumer
            .client()
            .fatal_error()
            .unwrap_or((RDKafkaErrorCode::Fatal, String::new()));
        if code == RDKafkaErrorCode::FencedInstanceId {
            let id = self.membership.static_member().unwrap_or_default();
            tracing::error!(group = %self.group_id, static_member = id, "fenced: another consumer joined the group with this static member ID; each replica needs an ID of its own");
            return error::fatal(
                format_args!(
                    "fetching: another consumer of group {} joined with static member ID {id:?}",
                    self.group_id
                ),
                e,
            );
        }
        error::fatal(format_args!("fetching: {code:?} {reason}"), e)
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
                    Some(Err(e)) => return Err(self.fetch_error(e)),
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
        // A static member does not leave (KIP-345): the group keeps its partitions for the
        // session timeout, so a restart with the same ID takes them back without rebalancing
        // the others; the settled prefix is committed above either way.
        let leave = match self.membership.static_member() {
            Some(id) => {
                tracing::info!(group = %self.group_id, static_member = id, "closing as a static member: its partitions wait for its return until the session times out");
                false
            }
            None => true,
        };
        if leave && self.membership.configured_static() {
            self.leave_as_dynamic().await;
        }
        let KafkaSource { consumer, .. } = self;
        // Leaving the group waits for the coordinator; keep that off the async workers. With a
        // `group.instance.id` configured, librdkafka's close sends no LeaveGroup.
        let left = tokio::task::spawn_blocking(move || {
            if leave {
                consumer.unsubscribe();
            }
            drop(consumer);
        })
        .await;
        if let Err(e) = left {
            tracing::warn!(error = %e, "closing the Kafka consumer failed");
        }
        committed
    }
}
