//! Per-partition offset tracking: which offsets are handed out and not yet settled, and how far
//! the committed offset may safely advance.
//!
//! The runner settles deliveries out of order when its concurrency is above 1, but a Kafka
//! offset commit means "everything below this is done". So the commit position of a partition
//! is the lowest offset still in flight, or one past the highest delivered offset when nothing
//! is. Offsets that were abandoned (or whose dead letter could not be published) simply stay in
//! flight: the committed offset never passes them in this process, and the next owner of the
//! partition (after a restart or rebalance) receives them again.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// A partition's identity: topic and partition number.
pub(crate) type PartitionKey = (Arc<str>, i32);

/// A handle naming one tracked delivery, used to settle it later. The epoch ties it to one
/// assignment of its partition, so a late settlement after a revoke is recognised and ignored.
#[derive(Debug, Clone)]
pub(crate) struct Ticket {
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    epoch: u64,
}

#[derive(Debug)]
struct PartitionState {
    epoch: u64,
    in_flight: BTreeSet<i64>,
    /// One past the highest offset delivered in this assignment.
    next: i64,
    /// The last position sent in a commit (or the first delivered offset, which the group
    /// already had as its position).
    committed: i64,
}

impl PartitionState {
    fn position(&self) -> i64 {
        self.in_flight.first().copied().unwrap_or(self.next)
    }
}

/// All partitions this consumer currently holds deliveries from.
#[derive(Debug, Default)]
pub(crate) struct Offsets {
    partitions: HashMap<PartitionKey, PartitionState>,
    next_epoch: u64,
}

impl Offsets {
    /// Records that `offset` was handed out.
    pub(crate) fn deliver(&mut self, topic: &Arc<str>, partition: i32, offset: i64) -> Ticket {
        let key = (topic.clone(), partition);
        let next_epoch = &mut self.next_epoch;
        let state = self.partitions.entry(key).or_insert_with(|| {
            *next_epoch += 1;
            PartitionState {
                epoch: *next_epoch,
                in_flight: BTreeSet::new(),
                next: offset,
                committed: offset,
            }
        });
        state.in_flight.insert(offset);
        state.next = state.next.max(offset.saturating_add(1));
        Ticket {
            topic: topic.clone(),
            partition,
            offset,
            epoch: state.epoch,
        }
    }

    /// Marks a delivery done (acknowledged or dead-lettered). Returns false when its partition
    /// was revoked since it was handed out: the new owner receives it again, and a duplicate is
    /// harmless.
    pub(crate) fn settle(&mut self, ticket: &Ticket) -> bool {
        match self
            .partitions
            .get_mut(&(ticket.topic.clone(), ticket.partition))
        {
            Some(state) if state.epoch == ticket.epoch => state.in_flight.remove(&ticket.offset),
            _ => false,
        }
    }

    /// The positions to commit: every partition whose contiguous settled prefix grew since the
    /// last commit (or every partition, with `all`). They are recorded as committed.
    pub(crate) fn take_commits(&mut self, all: bool) -> Vec<(PartitionKey, i64)> {
        let mut out = Vec::new();
        for (key, state) in &mut self.partitions {
            let pos = state.position();
            if pos > state.committed || (all && pos >= state.committed) {
                state.committed = pos;
                out.push((key.clone(), pos));
            }
        }
        out
    }

    /// A commit of `position` failed: allow the next round to send it again.
    pub(crate) fn commit_failed(&mut self, key: &PartitionKey, position: i64) {
        if let Some(state) = self.partitions.get_mut(key)
            && state.committed == position
        {
            state.committed = position.saturating_sub(1);
        }
    }

    /// Forgets a revoked partition and returns its position if it advanced since the last
    /// commit. Deliveries still in flight from it will be ignored when they settle.
    pub(crate) fn revoke(&mut self, key: &PartitionKey) -> Option<i64> {
        let state = self.partitions.remove(key)?;
        let pos = state.position();
        (pos > state.committed).then_some(pos)
    }
}

#[cfg(test)]
mod schedules;

#[cfg(test)]
mod tests {
    use super::*;

    fn topic() -> Arc<str> {
        Arc::from("orders")
    }

    #[test]
    fn commits_only_the_contiguous_settled_prefix() {
        let mut o = Offsets::default();
        let t: Vec<Ticket> = (10..15).map(|off| o.deliver(&topic(), 0, off)).collect();
        assert!(o.take_commits(false).is_empty(), "nothing settled yet");
        assert!(o.settle(&t[1]));
        assert!(o.settle(&t[3]));
        assert!(
            o.take_commits(false).is_empty(),
            "offset 10 still in flight"
        );
        assert!(o.settle(&t[0]));
        assert_eq!(o.take_commits(false), vec![((topic(), 0), 12)]);
        assert!(o.settle(&t[2]));
        assert!(o.settle(&t[4]));
        assert_eq!(o.take_commits(false), vec![((topic(), 0), 15)]);
        assert!(o.take_commits(false).is_empty(), "nothing new");
        assert_eq!(o.take_commits(true), vec![((topic(), 0), 15)]);
    }

    #[test]
    fn an_unsettled_offset_blocks_later_ones_and_gaps_are_skipped() {
        let mut o = Offsets::default();
        let a = o.deliver(&topic(), 1, 5);
        let b = o.deliver(&topic(), 1, 9); // 6..8 compacted away
        assert!(o.settle(&b));
        assert!(o.take_commits(false).is_empty());
        assert!(o.settle(&a));
        assert_eq!(o.take_commits(false), vec![((topic(), 1), 10)]);
    }

    #[test]
    fn settlements_after_a_revoke_are_ignored() {
        let mut o = Offsets::default();
        let a = o.deliver(&topic(), 0, 0);
        let b = o.deliver(&topic(), 0, 1);
        assert!(o.settle(&a));
        assert_eq!(o.revoke(&(topic(), 0)), Some(1));
        // Reassigned to us: the group position is 1, so offset 1 arrives again.
        let b2 = o.deliver(&topic(), 0, 1);
        assert!(
            !o.settle(&b),
            "the old delivery belongs to the previous assignment"
        );
        assert!(o.take_commits(false).is_empty());
        assert!(o.settle(&b2));
        assert_eq!(o.take_commits(false), vec![((topic(), 0), 2)]);
    }

    #[test]
    fn a_failed_commit_is_sent_again() {
        let mut o = Offsets::default();
        let a = o.deliver(&topic(), 0, 0);
        assert!(o.settle(&a));
        assert_eq!(o.take_commits(false), vec![((topic(), 0), 1)]);
        o.commit_failed(&(topic(), 0), 1);
        assert_eq!(o.take_commits(false), vec![((topic(), 0), 1)]);
    }
}
