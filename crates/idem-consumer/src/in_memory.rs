//! An in-memory fake broker, for unit tests of the runner and of users' handlers, and for the
//! `idem demo` (feature `test-util`). Not a broker: no persistence, one process. Real adapters
//! are tested against real brokers.
//!
//! It behaves at least once the way real brokers do: a dropped source's unsettled deliveries
//! come back (a closed connection), and with [`InMemoryBroker::visibility_timeout`] so does a
//! delivery left unsettled too long (SQS's visibility timeout, JetStream's `AckWait`).
//! [`InMemoryBroker::lose_acks`] makes chosen acks vanish on the way, which is what a consumer
//! crashing between its commit and its ack looks like from the broker.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use idem_core::Error;
use tokio::sync::Notify;

use crate::dead_letter::DeadLetter;
use crate::id_source::IdSource;
use crate::source::{Delivery, Source};

/// How a fake delivery was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Acknowledged.
    Acked,
    /// Dead-lettered with these headers (reason, detail, consumer, attempts).
    DeadLettered(Vec<(&'static str, String)>),
}

#[derive(Debug, Clone)]
struct Stored {
    headers: HashMap<String, Vec<u8>>,
    payload: Vec<u8>,
    deliveries: u32,
    seq: u64,
    /// When it was last handed out.
    handed_out: Option<Instant>,
}

/// Decides which acks are lost: called with the message's publish sequence and the delivery's
/// attempt (1 for the first delivery).
type LoseAck = Arc<dyn Fn(u64, u32) -> bool + Send + Sync>;

/// What an [`InMemoryBroker`] did, for reports and progress lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InMemoryStats {
    /// Messages published.
    pub published: u64,
    /// Deliveries handed out again: after an abandon, a dropped source, or the visibility
    /// timeout.
    pub redelivered: u64,
    /// Deliveries whose visibility timeout passed before they were settled.
    pub expired: u64,
    /// Settlements refused because the delivery had been handed out again meanwhile.
    pub refused: u64,
    /// Acks lost on the way ([`InMemoryBroker::lose_acks`]).
    pub lost_acks: u64,
    /// Settled (acked or dead-lettered).
    pub settled: u64,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Stored>,
    /// Handed out and not yet settled, by source: a dropped source's are redelivered, as a
    /// broker does when a consumer's connection closes.
    in_flight: HashMap<u64, HashMap<u64, Stored>>,
    visibility: Option<Duration>,
    lose_ack: Option<LoseAck>,
    stats: InMemoryStats,
    next_source: u64,
    settled: Vec<(u64, Vec<u8>, Settled)>,
    next_seq: u64,
    closed: bool,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("queued", &self.queue.len())
            .field("visibility", &self.visibility)
            .field("loses_acks", &self.lose_ack.is_some())
            .field("stats", &self.stats)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl State {
    /// Puts a delivery back at the end of the queue.
    fn requeue(&mut self, mut m: Stored) {
        m.deliveries += 1;
        m.handed_out = None;
        self.stats.redelivered += 1;
        self.queue.push_back(m);
    }

    /// Requeues every delivery unsettled for longer than the visibility timeout; returns when
    /// the next one expires, if any is in flight.
    fn expire(&mut self, now: Instant) -> Option<Instant> {
        let visibility = self.visibility?;
        let mut expired = Vec::new();
        let mut next: Option<Instant> = None;
        for held in self.in_flight.values_mut() {
            held.retain(|_, m| {
                let due = m.handed_out.map_or(now, |t| t + visibility);
                if due <= now {
                    expired.push(m.clone());
                    false
                } else {
                    next = Some(next.map_or(due, |n| n.min(due)));
                    true
                }
            });
        }
        expired.sort_by_key(|m| m.seq);
        self.stats.expired += expired.len() as u64;
        for m in expired {
            self.requeue(m);
        }
        next
    }

    fn any_in_flight(&self) -> bool {
        self.in_flight.values().any(|m| !m.is_empty())
    }
}

/// The fake broker: publish into it, consume from it with [`InMemoryBroker::source`], then
/// inspect what was settled.
#[derive(Debug, Clone, Default)]
pub struct InMemoryBroker {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
}

impl InMemoryBroker {
    /// An empty fake broker.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A delivery left unsettled this long is handed out again, to any source, as SQS does
    /// after its visibility timeout and JetStream after `AckWait`. An ack or dead letter for it
    /// that arrives afterwards is refused ([`Delivery::ack`] returns an error). While
    /// deliveries are in flight, a closed broker's sources wait for them instead of ending.
    pub fn visibility_timeout(self, timeout: Duration) -> Self {
        self.lock().visibility = Some(timeout);
        self
    }

    /// Loses the acks `lose(sequence, attempt)` picks: the ack reports success to the consumer
    /// and never reaches the broker, as when the consumer crashes after its commit and before
    /// its ack. The message stays in flight and comes back after the visibility timeout (set
    /// one) or when its source is dropped.
    pub fn lose_acks(self, lose: impl Fn(u64, u32) -> bool + Send + Sync + 'static) -> Self {
        self.lock().lose_ack = Some(Arc::new(lose));
        self
    }

    /// What the broker did so far.
    pub fn stats(&self) -> InMemoryStats {
        self.lock().stats
    }

    /// Enqueues a message with these headers; returns its publish sequence (0, 1, …).
    pub fn publish(&self, headers: &[(&str, &[u8])], payload: impl Into<Vec<u8>>) -> u64 {
        let mut s = self.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        s.stats.published += 1;
        s.queue.push_back(Stored {
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
                .collect(),
            payload: payload.into(),
            deliveries: 0,
            seq,
            handed_out: None,
        });
        drop(s);
        self.ready.notify_waiters();
        seq
    }

    /// After the queue drains (and, with a visibility timeout, nothing is in flight any more),
    /// `next` returns an empty batch: the source has ended.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_waiters();
    }

    /// Messages not yet settled (queued or redelivered).
    pub fn pending(&self) -> usize {
        self.lock().queue.len()
    }

    /// Every settlement so far: (publish sequence, payload, how).
    pub fn settled(&self) -> Vec<(u64, Vec<u8>, Settled)> {
        self.lock().settled.clone()
    }

    /// A source over this broker whose default ID source is the header `message-id`.
    pub fn source(&self) -> InMemorySource {
        let id = {
            let mut s = self.lock();
            s.next_source += 1;
            s.next_source
        };
        InMemorySource {
            broker: self.clone(),
            id,
        }
    }
}

/// Consumes from an [`InMemoryBroker`].
#[derive(Debug)]
pub struct InMemorySource {
    broker: InMemoryBroker,
    id: u64,
}

impl Drop for InMemorySource {
    fn drop(&mut self) {
        let mut s = self.broker.lock();
        if let Some(unsettled) = s.in_flight.remove(&self.id) {
            let mut unsettled: Vec<Stored> = unsettled.into_values().collect();
            unsettled.sort_by_key(|m| m.seq);
            for m in unsettled {
                s.requeue(m);
            }
        }
        drop(s);
        self.broker.ready.notify_waiters();
    }
}

impl Source for InMemorySource {
    type Delivery = InMemoryDelivery;

    fn broker(&self) -> &'static str {
        "in-memory"
    }

    fn default_id_source(&self) -> IdSource {
        IdSource::header("message-id")
    }

    async fn next(&mut self, max: usize) -> Result<Vec<InMemoryDelivery>, Error> {
        loop {
            let notified = self.broker.ready.notified();
            let wake_at = {
                let mut s = self.broker.lock();
                let now = Instant::now();
                let next_expiry = s.expire(now);
                if !s.queue.is_empty() {
                    let n = max.min(s.queue.len());
                    let mut taken: Vec<Stored> = s.queue.drain(..n).collect();
                    let mine = s.in_flight.entry(self.id).or_default();
                    for m in &mut taken {
                        m.handed_out = Some(now);
                        mine.insert(m.seq, m.clone());
                    }
                    return Ok(taken
                        .into_iter()
                        .map(|m| InMemoryDelivery {
                            broker: self.broker.clone(),
                            source: self.id,
                            msg: m,
                        })
                        .collect());
                }
                // With a visibility timeout, what is in flight may still come back.
                if s.closed && !(s.visibility.is_some() && s.any_in_flight()) {
                    return Ok(Vec::new());
                }
                next_expiry
            };
            match wake_at {
                Some(at) => {
                    let _ = tokio::time::timeout_at(at.into(), notified).await;
                }
                None => notified.await,
            }
        }
    }
}

/// One delivery from an [`InMemoryBroker`]; abandoning it puts it back at the end of the queue.
#[derive(Debug)]
pub struct InMemoryDelivery {
    broker: InMemoryBroker,
    source: u64,
    msg: Stored,
}

impl InMemoryDelivery {
    /// The message's publish sequence, as [`InMemoryBroker::publish`] returned it.
    pub fn sequence(&self) -> u64 {
        self.msg.seq
    }

    /// Settles it unless its source was dropped first (then it is already back in the queue,
    /// as on a real broker after the connection closed).
    fn settle(self, how: Settled) -> Result<(), Error> {
        let mut s = self.broker.lock();
        let attempt = self.msg.deliveries.saturating_add(1);
        if matches!(how, Settled::Acked)
            && let Some(lose) = &s.lose_ack
            && lose(self.msg.seq, attempt)
        {
            // Lost on the way: the broker never hears of it and the delivery stays in flight.
            s.stats.lost_acks += 1;
            return Ok(());
        }
        let held = s
            .in_flight
            .get_mut(&self.source)
            .and_then(|m| m.remove(&self.msg.seq))
            .is_some();
        if !held {
            s.stats.refused += 1;
            return Err(Error::new(
                idem_core::ErrorKind::Unavailable,
                "the in-memory delivery was handed out again (its source was dropped or its                  visibility timeout passed)",
            ));
        }
        s.stats.settled += 1;
        s.settled.push((self.msg.seq, self.msg.payload, how));
        drop(s);
        // A closed broker's sources may be waiting for the last in-flight delivery to settle.
        self.broker.ready.notify_waiters();
        Ok(())
    }
}

impl Delivery for InMemoryDelivery {
    fn payload(&self) -> &[u8] {
        &self.msg.payload
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.msg
            .headers
            .get(name)
            .map(|v| Cow::Borrowed(v.as_slice()))
    }

    fn previous_deliveries(&self) -> u32 {
        self.msg.deliveries
    }

    fn fmt_origin(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "in-memory #{}", self.msg.seq)
    }

    async fn ack(self) -> Result<(), Error> {
        self.settle(Settled::Acked)
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        self.settle(Settled::DeadLettered(reason.headers()))
    }

    async fn abandon(self) {
        let mut s = self.broker.lock();
        let held = s
            .in_flight
            .get_mut(&self.source)
            .and_then(|m| m.remove(&self.msg.seq));
        if let Some(msg) = held {
            s.requeue(msg);
        }
        drop(s);
        self.broker.ready.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(ds: &[InMemoryDelivery]) -> Vec<(u64, u32)> {
        ds.iter()
            .map(|d| (d.msg.seq, d.previous_deliveries()))
            .collect()
    }

    #[tokio::test]
    async fn an_unsettled_delivery_comes_back_after_the_visibility_timeout_to_any_source() {
        let broker = InMemoryBroker::new().visibility_timeout(Duration::from_millis(50));
        broker.publish(&[("message-id", b"a")], "1");
        broker.publish(&[("message-id", b"b")], "2");
        broker.close();
        let mut first = broker.source();
        let mut second = broker.source();
        let held = first.next(10).await.expect("fetch");
        assert_eq!(seqs(&held), [(0, 0), (1, 0)]);
        // Nothing queued, both in flight: the other source waits for the timeout, then gets
        // both again, marked as redeliveries.
        let started = Instant::now();
        let again = second.next(10).await.expect("fetch");
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(seqs(&again), [(0, 1), (1, 1)]);
        assert_eq!(broker.stats().redelivered, 2);
        // The late holder's settlement is refused; the new holder's counts.
        let mut held = held.into_iter();
        assert!(held.next().expect("a").ack().await.is_err());
        for d in again {
            d.ack().await.expect("ack");
        }
        assert_eq!(broker.stats().settled, 2);
        // Closed, nothing queued or in flight: the sources end.
        assert!(second.next(10).await.expect("end").is_empty());
        assert!(first.next(10).await.expect("end").is_empty());
    }

    #[tokio::test]
    async fn a_lost_ack_leaves_the_delivery_in_flight_until_it_is_redelivered() {
        let broker = InMemoryBroker::new()
            .visibility_timeout(Duration::from_millis(30))
            .lose_acks(|seq, attempt| seq == 0 && attempt == 1);
        broker.publish(&[("message-id", b"a")], "1");
        broker.close();
        let mut source = broker.source();
        let first = source.next(1).await.expect("fetch");
        for d in first {
            // The consumer believes it acked.
            d.ack().await.expect("a lost ack reports success");
        }
        assert_eq!(broker.stats().lost_acks, 1);
        assert!(broker.settled().is_empty(), "the broker never heard of it");
        let again = source.next(1).await.expect("redelivered");
        assert_eq!(seqs(&again), [(0, 1)]);
        for d in again {
            d.ack().await.expect("ack");
        }
        assert_eq!(broker.settled().len(), 1);
        assert!(source.next(1).await.expect("end").is_empty());
    }
}
