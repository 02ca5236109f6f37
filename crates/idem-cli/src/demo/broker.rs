//! An in-process, at-least-once broker simulation: the delivery semantics of SQS or a
//! RabbitMQ queue with manual acks, small enough to read in one sitting.
//!
//! It owns the queue, the in-flight set and the visibility timeout. It never loses a
//! message and it never promises to deliver one only once: a delivery that is not acked
//! before its visibility timeout becomes visible again and is handed to some consumer later,
//! whether that consumer is slow, crashed or simply forgot. A producer publishing the same
//! message twice yields two independent copies, each delivered and acked on its own.
//!
//! A late ack (after the visibility timeout) still settles its copy, as Google Pub/Sub may
//! honour one; by then the copy has usually been handed out again, and that redelivery reaches
//! a consumer as a duplicate. Honouring late acks also guarantees the run ends: under heavy
//! contention a slow worker would otherwise never settle anything.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::producer::Envelope;

/// The simulated queue. Shared by the producer and every worker through an `Arc`.
#[derive(Debug)]
pub(crate) struct SimulatedBroker {
    state: Mutex<State>,
    /// Wakes consumers blocked in [`SimulatedBroker::receive`]: one per copy made visible
    /// (publish, nack), all of them when the run may be over (close, last ack, abort). Waking
    /// everyone on every event would make each publish cost O(workers).
    changed: Notify,
    visibility_timeout: Duration,
}

/// One delivery handed to a consumer: the message plus what the consumer needs to ack it.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    /// Identifies this delivery (not the message), like an SQS receipt handle.
    tag: u64,
    /// Which published copy this is, in publish order; stable across redeliveries.
    copy: usize,
    /// 1 for the first delivery of this copy, 2 for its first redelivery, and so on.
    attempt: u32,
    envelope: Arc<Envelope>,
}

impl Delivery {
    /// The published copy this delivery belongs to (publish order, stable across redeliveries).
    pub(crate) fn copy(&self) -> usize {
        self.copy
    }

    /// How many times this copy has now been delivered, this delivery included.
    pub(crate) fn attempt(&self) -> u32 {
        self.attempt
    }

    /// What the producer sent.
    pub(crate) fn envelope(&self) -> &Envelope {
        &self.envelope
    }
}

/// What the broker counted; a consistent snapshot taken under its lock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BrokerStats {
    /// Copies published, duplicate publishes included.
    pub(crate) published: u64,
    /// Deliveries handed to consumers, redeliveries included.
    pub(crate) deliveries: u64,
    /// Deliveries of a copy that had been delivered before (visibility timeout or nack).
    pub(crate) redeliveries: u64,
    /// Deliveries whose visibility timeout expired before an ack.
    pub(crate) timeouts: u64,
    /// Negative acks: the consumer asked for a redelivery.
    pub(crate) nacks: u64,
    /// Acks that arrived after their delivery's visibility timeout (they still settle).
    pub(crate) late_acks: u64,
    /// Distinct producer messages with at least one settled copy (drives the progress bar).
    pub(crate) messages_settled: u64,
}

#[derive(Debug)]
struct State {
    copies: Vec<QueuedCopy>,
    /// Copies visible to consumers, oldest first.
    ready: VecDeque<usize>,
    /// Deliveries handed out and not yet acked, by tag.
    in_flight: HashMap<u64, InFlight>,
    /// Per producer message number: whether one of its copies has been settled.
    message_settled: Vec<bool>,
    next_tag: u64,
    unsettled: usize,
    producer_closed: bool,
    aborted: bool,
    stats: BrokerStats,
}

#[derive(Debug)]
struct QueuedCopy {
    envelope: Arc<Envelope>,
    deliveries: u32,
    settled: bool,
}

#[derive(Debug)]
struct InFlight {
    copy: usize,
    visible_again_at: Instant,
}

impl SimulatedBroker {
    /// An empty queue for `messages` distinct producer messages whose deliveries become
    /// visible again `visibility_timeout` after being handed out unless acked.
    pub(crate) fn new(messages: usize, visibility_timeout: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                copies: Vec::new(),
                ready: VecDeque::new(),
                in_flight: HashMap::new(),
                message_settled: vec![false; messages],
                next_tag: 0,
                unsettled: 0,
                producer_closed: false,
                aborted: false,
                stats: BrokerStats::default(),
            }),
            changed: Notify::new(),
            visibility_timeout,
        }
    }

    /// Appends one copy of `envelope` to the queue. Publishing the same envelope twice makes two
    /// copies: the broker does not deduplicate, exactly like a real at-least-once broker.
    pub(crate) fn publish(&self, envelope: Arc<Envelope>) {
        let mut st = self.lock();
        let copy = st.copies.len();
        st.copies.push(QueuedCopy {
            envelope,
            deliveries: 0,
            settled: false,
        });
        st.ready.push_back(copy);
        st.unsettled += 1;
        st.stats.published += 1;
        drop(st);
        self.changed.notify_one();
    }

    /// The producer is done: once every copy is settled, [`receive`](Self::receive) returns
    /// `None` and the workers stop.
    pub(crate) fn close(&self) {
        self.lock().producer_closed = true;
        self.changed.notify_waiters();
    }

    /// Stops every consumer now, settled or not (a worker hit an error the run cannot survive).
    pub(crate) fn abort(&self) {
        self.lock().aborted = true;
        self.changed.notify_waiters();
    }

    /// Waits for the next visible copy; `None` once the producer is closed and every copy has
    /// been acked (or the run was aborted).
    pub(crate) async fn receive(&self) -> Option<Delivery> {
        loop {
            // Created before looking at the state, so a change made between the look and the
            // wait still wakes us (`notify_waiters` reaches it at once, `notify_one` leaves a
            // permit).
            let changed = self.changed.notified();
            let next_timeout = {
                let mut st = self.lock();
                if st.aborted {
                    return None;
                }
                let now = Instant::now();
                st.expire_visibility(now);
                while let Some(copy) = st.ready.pop_front() {
                    // A late ack may have settled a copy that was already queued again.
                    if !st.copies[copy].settled {
                        return Some(st.deliver(copy, now + self.visibility_timeout));
                    }
                }
                if st.producer_closed && st.unsettled == 0 {
                    return None;
                }
                st.in_flight.values().map(|f| f.visible_again_at).min()
            };
            match next_timeout {
                Some(at) => {
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// Settles the copy: it will not be delivered again. A late ack counts as one and still
    /// settles it (see the module docs).
    pub(crate) fn ack(&self, delivery: &Delivery) {
        let mut st = self.lock();
        if st.in_flight.remove(&delivery.tag).is_none() && !st.copies[delivery.copy].settled {
            st.stats.late_acks += 1;
        }
        st.settle(delivery.copy);
        let finished = st.producer_closed && st.unsettled == 0;
        drop(st);
        if finished {
            self.changed.notify_waiters();
        }
    }

    /// Makes the copy visible again right away, for another attempt. After the visibility
    /// timeout there is nothing to do: the copy is visible again already.
    pub(crate) fn nack(&self, delivery: &Delivery) {
        let mut st = self.lock();
        st.stats.nacks += 1;
        if let Some(flight) = st.in_flight.remove(&delivery.tag) {
            st.ready.push_back(flight.copy);
        }
        drop(st);
        self.changed.notify_one();
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> BrokerStats {
        self.lock().stats
    }

    /// A panic while holding the lock cannot leave the state half-updated in a way that matters
    /// here (every update is a few field writes), so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// Puts every delivery whose visibility timeout passed back in the queue.
    fn expire_visibility(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.visible_again_at <= now)
            .map(|(&tag, _)| tag)
            .collect();
        for tag in expired {
            if let Some(flight) = self.in_flight.remove(&tag) {
                self.stats.timeouts += 1;
                self.ready.push_back(flight.copy);
            }
        }
    }

    fn deliver(&mut self, copy: usize, visible_again_at: Instant) -> Delivery {
        let tag = self.next_tag;
        self.next_tag += 1;
        let entry = &mut self.copies[copy];
        entry.deliveries += 1;
        let delivery = Delivery {
            tag,
            copy,
            attempt: entry.deliveries,
            envelope: Arc::clone(&entry.envelope),
        };
        self.stats.deliveries += 1;
        if delivery.attempt > 1 {
            self.stats.redeliveries += 1;
        }
        self.in_flight.insert(
            tag,
            InFlight {
                copy,
                visible_again_at,
            },
        );
        delivery
    }

    fn settle(&mut self, copy: usize) {
        let entry = &mut self.copies[copy];
        if entry.settled {
            return;
        }
        entry.settled = true;
        let number = entry.envelope.number;
        self.unsettled -= 1;
        // Its other outstanding deliveries (after a timeout) must not come back once more.
        self.in_flight.retain(|_, f| f.copy != copy);
        if let Some(done) = self.message_settled.get_mut(number)
            && !*done
        {
            *done = true;
            self.stats.messages_settled += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::producer::payment_requests;

    fn envelope() -> anyhow::Result<Arc<Envelope>> {
        payment_requests(1, 0)?
            .pop()
            .ok_or_else(|| anyhow::anyhow!("no request generated"))
    }

    #[tokio::test]
    async fn an_unacked_delivery_comes_back_after_the_visibility_timeout() -> anyhow::Result<()> {
        let broker = SimulatedBroker::new(1, Duration::from_millis(20));
        broker.publish(envelope()?);
        broker.close();
        let first = broker.receive().await;
        assert!(first.as_ref().is_some_and(|d| d.attempt() == 1));
        // Never acked: the "consumer" crashed.
        let Some(again) = broker.receive().await else {
            panic!("the copy was not redelivered")
        };
        assert_eq!(again.attempt(), 2);
        broker.ack(&again);
        assert!(broker.receive().await.is_none());
        let stats = broker.stats();
        assert_eq!(
            (stats.deliveries, stats.redeliveries, stats.timeouts),
            (2, 1, 1)
        );
        assert_eq!(stats.late_acks, 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_late_ack_still_settles_the_copy() -> anyhow::Result<()> {
        let broker = SimulatedBroker::new(1, Duration::from_millis(20));
        broker.publish(envelope()?);
        broker.close();
        let Some(slow) = broker.receive().await else {
            panic!("nothing delivered")
        };
        let Some(redelivered) = broker.receive().await else {
            panic!("the copy was not redelivered")
        };
        broker.ack(&slow); // after the timeout, while the redelivery is out
        assert_eq!(broker.stats().late_acks, 1);
        assert!(broker.receive().await.is_none(), "a settled copy came back");
        broker.ack(&redelivered); // the consumer found a duplicate: a no-op
        let stats = broker.stats();
        assert_eq!((stats.late_acks, stats.messages_settled), (1, 1));
        Ok(())
    }

    #[tokio::test]
    async fn a_duplicate_publish_is_two_copies_each_acked_on_its_own() -> anyhow::Result<()> {
        let broker = SimulatedBroker::new(1, Duration::from_millis(20));
        let e = envelope()?;
        broker.publish(Arc::clone(&e));
        broker.publish(e);
        broker.close();
        let mut seen = 0;
        while let Some(d) = broker.receive().await {
            seen += 1;
            broker.ack(&d);
        }
        assert_eq!(seen, 2);
        assert_eq!(broker.stats().messages_settled, 1);
        Ok(())
    }

    #[tokio::test]
    async fn a_nack_makes_the_copy_visible_at_once() -> anyhow::Result<()> {
        let broker = SimulatedBroker::new(1, Duration::from_secs(3600));
        broker.publish(envelope()?);
        broker.close();
        let Some(d) = broker.receive().await else {
            panic!("nothing delivered")
        };
        broker.nack(&d);
        let Some(d) = broker.receive().await else {
            panic!("not redelivered after nack")
        };
        assert_eq!(d.attempt(), 2);
        broker.ack(&d);
        assert!(broker.receive().await.is_none());
        Ok(())
    }
}
