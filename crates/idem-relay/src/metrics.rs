//! What the relay counts, through the `metrics` facade (labelled `relay`), and the same counts
//! as a [`RelayStats`] for the caller.
//!
//! - `idem_relay_published_total`: rows the broker confirmed (marked sent)
//! - `idem_relay_failed_total`: publishes that failed and were given back to retry later
//! - `idem_relay_dead_lettered_total{reason}`: rows moved to the outbox's dead letters
//!   (`rejected`, `invalid-id`, `invalid-destination`, `retries-exhausted`)
//! - `idem_outbox_unsent` (gauge): rows not yet published, read every backlog interval
//! - `idem_outbox_oldest_unsent_seconds` (gauge): age of the oldest of them (0 when none)

use std::time::Duration;

use idem_core::outbox::Backlog;
use metrics::{Counter, Gauge, counter, gauge};

/// Counts of what one [`Relay::run`](crate::Relay::run) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Rounds that leased at least one row.
    pub rounds: u64,
    /// Rows published and marked sent.
    pub published: u64,
    /// Publishes that failed and were released to retry.
    pub failed: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// Rows released without a publish: held behind a failed row of their ordering key, or
    /// not started when the relay stopped.
    pub released_unpublished: u64,
    /// Store errors waited out (lease, mark, release, dead letter).
    pub store_errors: u64,
    /// Broker outages waited out (rounds in which every publish failed to reach the broker).
    pub broker_outages: u64,
    /// Sent rows deleted.
    pub purged: u64,
    /// The last backlog read, if any.
    pub backlog: Option<BacklogSnapshot>,
}

impl RelayStats {
    /// Adds a round's counts (everything but the run-level ones: rounds, outages, store
    /// errors, purges, the backlog).
    pub(crate) fn absorb(&mut self, round: &RelayStats) {
        self.published += round.published;
        self.failed += round.failed;
        self.dead_lettered += round.dead_lettered;
        self.released_unpublished += round.released_unpublished;
    }
}

/// [`Backlog`] as last read by the relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BacklogSnapshot {
    /// Rows not yet published.
    pub unsent: u64,
    /// Age of the oldest of them.
    pub oldest_unsent: Option<Duration>,
    /// Rows in the outbox's dead letters.
    pub dead_lettered: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct Instruments {
    relay: String,
    published: Counter,
    failed: Counter,
    unsent: Gauge,
    oldest: Gauge,
}

impl Instruments {
    pub(crate) fn new(relay: &str) -> Self {
        let label = || ("relay", relay.to_owned());
        Self {
            relay: relay.to_owned(),
            published: counter!("idem_relay_published_total", &[label()]),
            failed: counter!("idem_relay_failed_total", &[label()]),
            unsent: gauge!("idem_outbox_unsent", &[label()]),
            oldest: gauge!("idem_outbox_oldest_unsent_seconds", &[label()]),
        }
    }

    pub(crate) fn published(&self, stats: &mut RelayStats, n: usize) {
        stats.published += n as u64;
        self.published.increment(n as u64);
    }

    pub(crate) fn failed(&self, stats: &mut RelayStats) {
        stats.failed += 1;
        self.failed.increment(1);
    }

    pub(crate) fn dead_lettered(&self, stats: &mut RelayStats, reason: &'static str) {
        stats.dead_lettered += 1;
        counter!("idem_relay_dead_lettered_total", "relay" => self.relay.clone(), "reason" => reason)
            .increment(1);
    }

    pub(crate) fn backlog(&self, stats: &mut RelayStats, b: &Backlog) {
        self.unsent.set(b.unsent as f64);
        self.oldest
            .set(b.oldest_unsent.unwrap_or_default().as_secs_f64());
        stats.backlog = Some(BacklogSnapshot {
            unsent: b.unsent,
            oldest_unsent: b.oldest_unsent,
            dead_lettered: b.dead_lettered,
        });
    }
}
