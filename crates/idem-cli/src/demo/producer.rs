//! The producer side: `PaymentRequested` messages with stable, producer-set IDs, published
//! through the in-memory broker (header `message-id`) with the duplicate publishes a real producer makes (a publish
//! whose confirm was lost is published again, same ID, same payload).

use std::sync::Arc;

use anyhow::Context;
use idem_core::{Error, Message, MessageId};
use rand::Rng;
use serde::{Deserialize, Serialize};

use idem_consumer::InMemoryBroker;

use super::faults::{Stream, seeded_rng};

/// How many accounts the traffic spreads over: few enough that workers contend on the same
/// balance rows, as real payment traffic does.
pub(crate) const ACCOUNTS: usize = 25;

/// A duplicate publish lands up to this many publishes after the original: sometimes right
/// behind it (two workers race on the same ID), sometimes a little later.
const MAX_DUPLICATE_LAG: usize = 8;

/// The payload: charge `amount_cents` to `account`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PaymentRequested {
    /// The account to charge.
    pub(crate) account: String,
    /// How much, in cents.
    pub(crate) amount_cents: i64,
}

impl PaymentRequested {
    /// Decodes a payload; one that does not decode never will, so it is rejected (dead-letter)
    /// rather than retried.
    pub(crate) fn decode(payload: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(payload).map_err(Error::reject)
    }
}

/// A message as the producer hands it to the broker.
#[derive(Debug)]
pub(crate) struct Envelope {
    /// The producer-set ID as text, for the ledger's `message_id` column.
    pub(crate) id: String,
    /// ID, payload bytes and their fingerprint, as the core processes them.
    pub(crate) message: Message<Vec<u8>>,
    /// The decoded payload, kept so the ledger can record what was requested.
    pub(crate) payment: PaymentRequested,
}

/// The name of account `i`.
pub(crate) fn account_name(i: usize) -> String {
    format!("acct-{i:03}")
}

/// The `messages` payment requests of this seed, in the order the producer sends them.
pub(crate) fn payment_requests(messages: usize, seed: u64) -> anyhow::Result<Vec<Arc<Envelope>>> {
    let mut rng = seeded_rng(seed, Stream::Payments, 0, 0);
    (0..messages)
        .map(|number| {
            let payment = PaymentRequested {
                account: account_name(rng.gen_range(0..ACCOUNTS)),
                amount_cents: rng.gen_range(100..=50_000),
            };
            let id = format!("payment-{number:06}");
            let payload = serde_json::to_vec(&payment).context("encoding a payment")?;
            let message = Message::new(MessageId::new(&id)?, payload);
            Ok(Arc::new(Envelope {
                id,
                message,
                payment,
            }))
        })
        .collect()
}

/// What the producer published: every copy by its publish sequence (duplicates included), and
/// how many were duplicate publishes.
#[derive(Debug, Default)]
pub(crate) struct Published {
    pub(crate) copies: Vec<Arc<Envelope>>,
    pub(crate) duplicates: u64,
}

impl Published {
    fn publish(&mut self, broker: &InMemoryBroker, envelope: &Arc<Envelope>) {
        let seq = broker.publish(
            &[("message-id", envelope.id.as_bytes())],
            envelope.message.payload().clone(),
        );
        debug_assert_eq!(seq as usize, self.copies.len());
        self.copies.push(Arc::clone(envelope));
    }

    /// The message published as copy `seq`.
    pub(crate) fn copy(&self, seq: u64) -> Option<&Envelope> {
        usize::try_from(seq)
            .ok()
            .and_then(|i| self.copies.get(i))
            .map(|e| &**e)
    }
}

/// Publishes every request, some of them twice, then closes the broker.
pub(crate) async fn publish_all(
    broker: &InMemoryBroker,
    requests: &[Arc<Envelope>],
    duplicate_rate: f64,
    seed: u64,
) -> Published {
    let mut out = Published::default();
    let mut rng = seeded_rng(seed, Stream::Publishing, 0, 0);
    // Duplicates waiting for their turn: (publish count at which they go out, message).
    let mut pending: Vec<(usize, Arc<Envelope>)> = Vec::new();
    let mut published = 0usize;
    for envelope in requests {
        out.publish(broker, envelope);
        published += 1;
        if rng.gen_bool(duplicate_rate) {
            out.duplicates += 1;
            let lag = rng.gen_range(0..=MAX_DUPLICATE_LAG);
            pending.push((published + lag, Arc::clone(envelope)));
        }
        while let Some(i) = pending.iter().position(|(due, _)| *due <= published) {
            let (_, again) = pending.remove(i);
            out.publish(broker, &again);
            published += 1;
        }
        // Let the workers start on the queue while it fills, as with a live producer.
        if published.is_multiple_of(16) {
            tokio::task::yield_now().await;
        }
    }
    for (_, again) in pending {
        out.publish(broker, &again);
    }
    broker.close();
    out
}
