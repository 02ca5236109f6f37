//! This member's place in its consumer group: static membership (KIP-345) — the instance ID's
//! rules, the session timeout a static member gets, whether the broker took it — and what the
//! group did to the member (assignments, revocations, the partitions it holds).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rdkafka::TopicPartitionList;

/// The session timeout of a static member unless `session.timeout.ms` is set: how long a
/// restart may take without a rebalance, and how long the partitions of a member that is gone
/// for good (crashed, scaled down) wait before another member takes them. librdkafka's own
/// default, set explicitly so the figure documented here holds whatever librdkafka's becomes.
pub const STATIC_SESSION_TIMEOUT: Duration = Duration::from_secs(45);

/// Kafka's limit on a `group.instance.id` (the broker applies its topic-name rule).
const MAX_INSTANCE_ID_LEN: usize = 249;

/// Checks `id` against the broker's rule for `group.instance.id` (Kafka's
/// `JoinGroupRequest.validateGroupInstanceId`): 1 to 249 characters of ASCII letters, digits,
/// `.`, `_` and `-`, and not `.` or `..`. librdkafka sends any string and a broker refuses a
/// bad one on every JoinGroup, so the member would never join; refusing it here says why.
pub(crate) fn validate_instance_id(id: &str) -> Result<(), Error> {
    let bad = |why: &str| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("Kafka static member ID {id:?} {why}"),
        )
    };
    if id.is_empty() {
        return Err(bad("is empty"));
    }
    if id.len() > MAX_INSTANCE_ID_LEN {
        return Err(bad(&format!(
            "is {} bytes long; Kafka allows {MAX_INSTANCE_ID_LEN}",
            id.len()
        )));
    }
    if id == "." || id == ".." {
        return Err(bad("is not allowed"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(bad(&format!(
            "holds {c:?}; Kafka allows ASCII letters, digits, '.', '_' and '-'"
        )));
    }
    Ok(())
}

/// What the group did to one [`KafkaSource`](crate::KafkaSource): how often it was handed
/// partitions or had them taken away, what it holds now, and whether it is a static member.
/// Read it with [`KafkaSource::membership`](crate::KafkaSource::membership) before handing
/// the source to the runner; clones share the counts.
///
/// The counts are librdkafka's rebalance callbacks: with the default (eager) assignors every
/// rebalance of the group revokes everything from every member and assigns afresh, so a
/// member whose [`revocations`](Self::revocations) did not move saw no rebalance.
#[derive(Clone)]
pub struct Membership {
    inner: Arc<State>,
}

struct State {
    instance_id: Option<String>,
    refused: AtomicBool,
    left: AtomicBool,
    assignments: AtomicU64,
    revocations: AtomicU64,
    held: Mutex<BTreeSet<(String, i32)>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("static_member", &self.static_member())
            .field("assignments", &self.assignments())
            .field("revocations", &self.revocations())
            .field("held", &self.held())
            .finish()
    }
}

impl Membership {
    pub(crate) fn new(instance_id: Option<String>) -> Self {
        Self {
            inner: Arc::new(State {
                instance_id,
                refused: AtomicBool::new(false),
                left: AtomicBool::new(false),
                assignments: AtomicU64::new(0),
                revocations: AtomicU64::new(0),
                held: Mutex::new(BTreeSet::new()),
            }),
        }
    }

    /// The `group.instance.id` this member joins with, while static membership is in effect:
    /// `None` when it was not asked for
    /// ([`KafkaSourceBuilder::static_member`](crate::KafkaSourceBuilder::static_member)) or the
    /// broker turned out not to support it (then the member is a dynamic one).
    pub fn static_member(&self) -> Option<&str> {
        if self.inner.refused.load(Ordering::Relaxed) {
            return None;
        }
        self.inner.instance_id.as_deref()
    }

    /// Whether a `group.instance.id` was configured, kept by the broker or not.
    pub(crate) fn configured_static(&self) -> bool {
        self.inner.instance_id.is_some()
    }

    /// librdkafka sent a LeaveGroup.
    pub(crate) fn note_leave(&self) {
        self.inner.left.store(true, Ordering::Relaxed);
    }

    pub(crate) fn has_left(&self) -> bool {
        self.inner.left.load(Ordering::Relaxed)
    }

    /// How many times the group handed this member partitions.
    pub fn assignments(&self) -> u64 {
        self.inner.assignments.load(Ordering::Relaxed)
    }

    /// How many times the group took partitions from this member (a rebalance, a lost
    /// session, or closing).
    pub fn revocations(&self) -> u64 {
        self.inner.revocations.load(Ordering::Relaxed)
    }

    /// The partitions this member holds now, as `(topic, partition)`, sorted.
    pub fn held(&self) -> Vec<(String, i32)> {
        self.lock_held().iter().cloned().collect()
    }

    fn lock_held(&self) -> MutexGuard<'_, BTreeSet<(String, i32)>> {
        // A set of names: no invariant a panic elsewhere could break.
        self.inner.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn assigned(&self, tpl: &TopicPartitionList) {
        self.inner.assignments.fetch_add(1, Ordering::Relaxed);
        let mut held = self.lock_held();
        for e in tpl.elements() {
            held.insert((e.topic().to_owned(), e.partition()));
        }
    }

    pub(crate) fn revoked(&self, tpl: &TopicPartitionList) {
        self.inner.revocations.fetch_add(1, Ordering::Relaxed);
        let mut held = self.lock_held();
        for e in tpl.elements() {
            held.remove(&(e.topic().to_owned(), e.partition()));
        }
    }

    /// librdkafka said the broker cannot take a `group.instance.id` (its JoinGroup is older
    /// than v5, Kafka before 2.3) and joins without one. Returns whether this is news.
    pub(crate) fn refuse(&self) -> bool {
        self.inner.instance_id.is_some() && !self.inner.refused.swap(true, Ordering::Relaxed)
    }

    /// The coordinator gave this member `member_id`. Brokers that keep static members name
    /// them `<group.instance.id>-<uuid>` (Apache Kafka's classic and new coordinators, Redpanda,
    /// tansu), dynamic ones `<client.id>-<uuid>`; any other ID means the instance ID was
    /// dropped or ignored on the way and this is a dynamic member. Returns whether static
    /// membership just ended (to be said once).
    pub(crate) fn joined_as(&self, member_id: &str) -> bool {
        let Some(instance) = &self.inner.instance_id else {
            return false;
        };
        if member_id.is_empty() {
            return false; // reset before a rejoin: nothing assigned yet
        }
        let is_static = member_id
            .strip_prefix(instance.as_str())
            .is_some_and(|rest| rest.starts_with('-'));
        let was_refused = self.inner.refused.swap(!is_static, Ordering::Relaxed);
        !is_static && !was_refused
    }
}

/// The new ID in librdkafka's `cgrp` debug line `Group "G": updating member id "OLD" -> "NEW"`.
pub(crate) fn member_id_from_log(message: &str) -> Option<&str> {
    let (_, new) = message.rsplit_once("-> \"")?;
    new.strip_suffix('"')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_follow_the_brokers_rule() {
        for ok in ["payments-1", "pod_7.eu-west", "A", &"x".repeat(249)] {
            assert!(validate_instance_id(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("", "is empty"),
            (".", "not allowed"),
            ("..", "not allowed"),
            ("my pod", "' '"),
            ("pod/1", "'/'"),
            ("pöd", "'ö'"),
            (&"x".repeat(250), "250 bytes"),
        ] {
            let err = validate_instance_id(bad).expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_refusal_ends_static_membership_once() {
        let m = Membership::new(Some("a".into()));
        assert_eq!(m.static_member(), Some("a"));
        assert!(m.refuse());
        assert!(!m.refuse(), "said once");
        assert_eq!(m.static_member(), None);
        assert!(!Membership::new(None).refuse(), "nothing to refuse");
    }

    #[test]
    fn the_assigned_member_id_tells_whether_the_broker_kept_the_instance_id() {
        let m = Membership::new(Some("pod-1".into()));
        assert!(!m.joined_as(""), "a reset says nothing");
        assert!(!m.joined_as("pod-1-6f1c2e"), "static");
        assert_eq!(m.static_member(), Some("pod-1"));
        assert!(m.joined_as("rdkafka-6f1c2e"), "dynamic: said once");
        assert!(!m.joined_as("0x7f3a2c"), "already said");
        assert_eq!(m.static_member(), None);
        assert!(
            !m.joined_as("pod-10-6f1c2e") && m.static_member().is_none(),
            "another instance's prefix"
        );
        assert!(
            !m.joined_as("pod-1-aa") && m.static_member() == Some("pod-1"),
            "static again"
        );
        assert!(!Membership::new(None).joined_as("rdkafka-1"));
        assert_eq!(
            member_id_from_log(r#"Group "g": updating member id "" -> "pod-1-6f1c""#),
            Some("pod-1-6f1c")
        );
        assert_eq!(
            member_id_from_log(r#"Group "g": updating member id "(not-set)" -> """#),
            Some("")
        );
        assert_eq!(member_id_from_log("Heartbeat for group"), None);
    }

    #[test]
    fn held_partitions_follow_the_callbacks() {
        let m = Membership::new(None);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition("t", 0);
        tpl.add_partition("t", 1);
        m.assigned(&tpl);
        let mut one = TopicPartitionList::new();
        one.add_partition("t", 0);
        m.revoked(&one);
        assert_eq!(m.held(), vec![("t".to_owned(), 1)]);
        assert_eq!((m.assignments(), m.revocations()), (1, 1));
    }
}
