//! The producer side: `PaymentRequested` messages with stable, producer-set IDs, published
//! through the simulated broker with the duplicate publishes a real producer makes (a publish
//! whose confirm was lost is published again, same ID, same payload).

use std::sync::Arc;

use anyhow::Context;
use idem_core::{Error, Message, MessageId};
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::broker::SimulatedBroker;
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
    /// The producer's sequence number, 0-based.
    pub(crate) number: usize,
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
                number,
                id,
                message,
                payment,
            }))
        })
        .collect()
}

/// Publishes every request, some of them twice, then closes the broker. Returns how many
/// duplicate publishes it made.
pub(crate) async fn publish_all(
    broker: &SimulatedBroker,
    requests: &[Arc<Envelope>],
    duplicate_rate: f64,
    seed: u64,
) -> u64 {
    let mut rng = seeded_rng(seed, Stream::Publishing, 0, 0);
    // Duplicates waiting for their turn: (publish count at which they go out, message).
    let mut pending: Vec<(usize, Arc<Envelope>)> = Vec::new();
    let mut published = 0usize;
    let mut duplicates = 0u64;
    for envelope in requests {
        broker.publish(Arc::clone(envelope));
        published += 1;
        if rng.gen_bool(duplicate_rate) {
            duplicates += 1;
            let lag = rng.gen_range(0..=MAX_DUPLICATE_LAG);
            pending.push((published + lag, Arc::clone(envelope)));
        }
        while let Some(i) = pending.iter().position(|(due, _)| *due <= published) {
            let (_, again) = pending.remove(i);
            broker.publish(again);
            published += 1;
        }
        // Let the workers start on the queue while it fills, as with a live producer.
        if published.is_multiple_of(16) {
            tokio::task::yield_now().await;
        }
    }
    for (_, again) in pending {
        broker.publish(again);
    }
    broker.close();
    duplicates
}
