//! An in-memory fake broker, for unit tests of the runner and of users' handlers. Not a broker:
//! no persistence, one process. Real adapters are tested against real brokers.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

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
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Stored>,
    /// Handed out and not yet settled, by source: a dropped source's are redelivered, as a
    /// broker does when a consumer's connection closes.
    in_flight: HashMap<u64, HashMap<u64, Stored>>,
    next_source: u64,
    settled: Vec<(u64, Vec<u8>, Settled)>,
    next_seq: u64,
    closed: bool,
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

    /// Enqueues a message with these headers.
    pub fn publish(&self, headers: &[(&str, &[u8])], payload: impl Into<Vec<u8>>) {
        let mut s = self.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        s.queue.push_back(Stored {
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
                .collect(),
            payload: payload.into(),
            deliveries: 0,
            seq,
        });
        drop(s);
        self.ready.notify_waiters();
    }

    /// After the queue drains, `next` returns an empty batch: the source has ended.
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
            for (_, mut m) in unsettled {
                m.deliveries += 1;
                s.queue.push_back(m);
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
            {
                let mut s = self.broker.lock();
                if !s.queue.is_empty() {
                    let n = max.min(s.queue.len());
                    let taken: Vec<Stored> = s.queue.drain(..n).collect();
                    let mine = s.in_flight.entry(self.id).or_default();
                    for m in &taken {
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
                if s.closed {
                    return Ok(Vec::new());
                }
            }
            notified.await;
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
    /// Settles it unless its source was dropped first (then it is already back in the queue,
    /// as on a real broker after the connection closed).
    fn settle(self, how: Settled) -> Result<(), Error> {
        let mut s = self.broker.lock();
        let held = s
            .in_flight
            .get_mut(&self.source)
            .and_then(|m| m.remove(&self.msg.seq))
            .is_some();
        if !held {
            return Err(Error::new(
                idem_core::ErrorKind::Unavailable,
                "the in-memory source was dropped; the message was redelivered",
            ));
        }
        s.settled.push((self.msg.seq, self.msg.payload, how));
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

    fn origin(&self) -> String {
        format!("in-memory #{}", self.msg.seq)
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
        if let Some(mut msg) = held {
            msg.deliveries += 1;
            s.queue.push_back(msg);
        }
        drop(s);
        self.broker.ready.notify_waiters();
    }
}
