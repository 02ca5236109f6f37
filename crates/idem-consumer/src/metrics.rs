//! What the runner counts and times, exported through the `metrics` facade, plus (feature
//! `prometheus`) a Prometheus endpoint services can expose.
//!
//! Names (all labelled `consumer` and `broker`):
//! - `idem_messages_total{outcome}`: `processed`, `duplicate`, `conflict`, `dead_lettered`;
//!   the outcomes do not overlap (a conflict's dead letter counts only as `conflict`), so their
//!   sum is the number of settled deliveries
//! - `idem_dead_letters_total{reason}`: per [`DeadLetterReason`] code
//! - `idem_retries_total`: processing attempts after the first
//! - `idem_abandoned_total`: deliveries left to broker redelivery (shutdown, database down)
//! - `idem_ack_failures_total`: acknowledgements that failed after a commit (the broker will
//!   redeliver; the claim turns that into a duplicate)
//! - `idem_broker_errors_total`: failed fetches and failed dead-letter publishes
//! - `idem_store_unavailable` (gauge): 1 while messages wait out a store outage (unreachable,
//!   read-only, disk full, out of connections), 0 otherwise
//! - `idem_store_outages_total`: how many such outages began
//! - `idem_store_outage_limit_exceeded_total`: messages that waited out an outage longer than
//!   [`RetryPolicy::outage_limit`](crate::RetryPolicy::outage_limit)
//! - `idem_connections_lost_total`: lost database connections counted against the message that
//!   was running (the store answered a probe right after, or the outage was past its limit)
//! - `idem_phased_held_elsewhere_total`: retries of a phased message (`phased`, feature
//!   `phases`) that waited because another consumer held its record (a live lease)
//! - `idem_phased_abandoned_total`: phased operations that ended with `Step::Abandon` (acked)
//! - `idem_local_cache_hits_total`: duplicates answered from the local cache
//!   ([`Consumer::local_cache`](crate::Consumer::local_cache)) without a round trip to the
//!   store; each is also counted in `idem_messages_total{outcome="duplicate"}`
//! - `idem_handler_seconds`: handler latency, inside the transaction (a phased message's
//!   whole operation)
//! - `idem_commit_seconds`: from the handler's return to the commit's return
//!
//! Without an installed recorder the `metrics` calls are no-ops; [`RunStats`] counts the same
//! events for the caller either way. Any `metrics` recorder works; the `prometheus` feature
//! adds one with an HTTP endpoint (`serve_prometheus`, `install_prometheus_recorder`).

#[cfg(feature = "prometheus")]
mod prometheus;

#[cfg(feature = "prometheus")]
pub use prometheus::{PrometheusHandle, install_prometheus_recorder, serve_prometheus};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::Error;
use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

use crate::dead_letter::DeadLetterReason;

/// Counts of what one [`Consumer::run`](crate::Consumer::run) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunStats {
    /// Handler ran and committed.
    pub processed: u64,
    /// Found already processed; acknowledged without running the handler.
    pub duplicates: u64,
    /// Same ID, different payload; dead-lettered.
    pub conflicts: u64,
    /// Sent to the dead-letter destination (conflicts included).
    pub dead_lettered: u64,
    /// Attempts after the first.
    pub retries: u64,
    /// Left unacknowledged for the broker to redeliver.
    pub abandoned: u64,
    /// Acknowledgements that failed after their commit.
    pub ack_failures: u64,
    /// Fetch and dead-letter publish failures.
    pub broker_errors: u64,
    /// Store outages waited out (each began when a first message met one while none was).
    pub store_outages: u64,
    /// Messages whose wait on a store outage outlasted the retry policy's outage limit.
    pub outage_limit_exceeded: u64,
    /// Lost database connections counted against the message that was running.
    pub connections_lost: u64,
    /// Retries of a phased message that waited because another consumer held its record.
    pub held_elsewhere: u64,
    /// Phased operations that ended with `Step::Abandon`; acknowledged, stored abandoned.
    pub operations_abandoned: u64,
    /// Duplicates answered from the local cache without a round trip to the store (each is
    /// also counted in `duplicates`).
    pub cache_hits: u64,
}

#[derive(Debug, Default)]
struct Counts {
    processed: AtomicU64,
    duplicates: AtomicU64,
    conflicts: AtomicU64,
    dead_lettered: AtomicU64,
    retries: AtomicU64,
    abandoned: AtomicU64,
    ack_failures: AtomicU64,
    broker_errors: AtomicU64,
    store_outages: AtomicU64,
    outage_limit_exceeded: AtomicU64,
    connections_lost: AtomicU64,
    held_elsewhere: AtomicU64,
    operations_abandoned: AtomicU64,
    cache_hits: AtomicU64,
    /// Messages waiting out a store outage right now.
    waiting_on_store: AtomicU64,
    /// Whether the current outage's overrun was reported.
    overrun_reported: std::sync::atomic::AtomicBool,
}

/// The runner's instruments: `metrics` handles registered once per run, and the plain counts
/// behind [`RunStats`].
#[derive(Debug, Clone)]
pub(crate) struct Instruments {
    consumer: String,
    broker: &'static str,
    counts: Arc<Counts>,
    processed: Counter,
    duplicates: Counter,
    conflicts: Counter,
    dead_lettered: Counter,
    retries: Counter,
    abandoned: Counter,
    ack_failures: Counter,
    broker_errors: Counter,
    store_outages: Counter,
    outage_limit_exceeded: Counter,
    connections_lost: Counter,
    held_elsewhere: Counter,
    operations_abandoned: Counter,
    cache_hits: Counter,
    store_unavailable: Gauge,
    handler: Histogram,
    commit: Histogram,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Instruments {
    pub(crate) fn new(consumer: &str, broker: &'static str) -> Self {
        let labels = |outcome: &'static str| counter!("idem_messages_total", "consumer" => consumer.to_owned(), "broker" => broker, "outcome" => outcome);
        let plain = |name: &'static str| counter!(name, "consumer" => consumer.to_owned(), "broker" => broker);
        Self {
            consumer: consumer.to_owned(),
            broker,
            counts: Arc::default(),
            processed: labels("processed"),
            duplicates: labels("duplicate"),
            conflicts: labels("conflict"),
            dead_lettered: labels("dead_lettered"),
            retries: plain("idem_retries_total"),
            abandoned: plain("idem_abandoned_total"),
            ack_failures: plain("idem_ack_failures_total"),
            broker_errors: plain("idem_broker_errors_total"),
            store_outages: plain("idem_store_outages_total"),
            outage_limit_exceeded: plain("idem_store_outage_limit_exceeded_total"),
            connections_lost: plain("idem_connections_lost_total"),
            held_elsewhere: plain("idem_phased_held_elsewhere_total"),
            operations_abandoned: plain("idem_phased_abandoned_total"),
            cache_hits: plain("idem_local_cache_hits_total"),
            store_unavailable: gauge!("idem_store_unavailable", "consumer" => consumer.to_owned(), "broker" => broker),
            handler: histogram!("idem_handler_seconds", "consumer" => consumer.to_owned(), "broker" => broker),
            commit: histogram!("idem_commit_seconds", "consumer" => consumer.to_owned(), "broker" => broker),
        }
    }

    pub(crate) fn processed(&self) {
        bump(&self.counts.processed);
        self.processed.increment(1);
    }
    pub(crate) fn duplicate(&self) {
        bump(&self.counts.duplicates);
        self.duplicates.increment(1);
    }
    pub(crate) fn conflict(&self) {
        bump(&self.counts.conflicts);
        self.conflicts.increment(1);
    }
    pub(crate) fn dead_lettered(&self, reason: DeadLetterReason) {
        bump(&self.counts.dead_lettered);
        if reason != DeadLetterReason::Conflict {
            self.dead_lettered.increment(1);
        }
        counter!("idem_dead_letters_total", "consumer" => self.consumer.clone(), "broker" => self.broker, "reason" => reason.code())
            .increment(1);
    }
    pub(crate) fn retry(&self) {
        bump(&self.counts.retries);
        self.retries.increment(1);
    }
    pub(crate) fn abandoned(&self) {
        bump(&self.counts.abandoned);
        self.abandoned.increment(1);
    }
    pub(crate) fn ack_failure(&self) {
        bump(&self.counts.ack_failures);
        self.ack_failures.increment(1);
    }
    pub(crate) fn broker_error(&self) {
        bump(&self.counts.broker_errors);
        self.broker_errors.increment(1);
    }
    /// A message met a store outage. The first one waiting raises the gauge and says so once;
    /// the others are counted silently.
    pub(crate) fn outage_began(&self, error: &Error) {
        if self.counts.waiting_on_store.fetch_add(1, Ordering::SeqCst) == 0 {
            bump(&self.counts.store_outages);
            self.counts.overrun_reported.store(false, Ordering::SeqCst);
            self.store_outages.increment(1);
            self.store_unavailable.set(1.0);
            tracing::info!(consumer = %self.consumer, broker = self.broker, %error, "store unavailable: messages wait in place, spending none of their attempts, until it recovers");
        }
    }

    /// A message has waited out a store outage longer than `limit`. Counted per message; the
    /// first one of an outage says so.
    pub(crate) fn outage_limit_exceeded(&self, waited: Duration, limit: Duration) {
        bump(&self.counts.outage_limit_exceeded);
        self.outage_limit_exceeded.increment(1);
        if !self.counts.overrun_reported.swap(true, Ordering::SeqCst) {
            tracing::warn!(consumer = %self.consumer, broker = self.broker, ?waited, ?limit, "store outage outlasted its limit: messages keep waiting, but one whose connection keeps breaking while it runs now spends its attempts");
        }
    }

    /// A lost connection was counted against the message that was running.
    pub(crate) fn connection_lost(&self) {
        bump(&self.counts.connections_lost);
        self.connections_lost.increment(1);
    }

    /// A message that waited on the store got past the outage (or gave up at shutdown).
    pub(crate) fn held_elsewhere(&self) {
        bump(&self.counts.held_elsewhere);
        self.held_elsewhere.increment(1);
    }

    // Counted only by the phased mode.
    #[cfg_attr(not(feature = "phases"), allow(dead_code))]
    pub(crate) fn operation_abandoned(&self) {
        bump(&self.counts.operations_abandoned);
        self.operations_abandoned.increment(1);
    }

    pub(crate) fn outage_ended(&self) {
        if self.counts.waiting_on_store.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.store_unavailable.set(0.0);
            tracing::info!(consumer = %self.consumer, broker = self.broker, "store available again");
        }
    }

    /// A duplicate answered from the local cache (counted as a duplicate when it settles).
    pub(crate) fn cache_hit(&self) {
        bump(&self.counts.cache_hits);
        self.cache_hits.increment(1);
    }
    pub(crate) fn handler_time(&self, d: Duration) {
        self.handler.record(d.as_secs_f64());
    }
    pub(crate) fn commit_time(&self, d: Duration) {
        self.commit.record(d.as_secs_f64());
    }

    pub(crate) fn snapshot(&self) -> RunStats {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RunStats {
            processed: get(&c.processed),
            duplicates: get(&c.duplicates),
            conflicts: get(&c.conflicts),
            dead_lettered: get(&c.dead_lettered),
            retries: get(&c.retries),
            abandoned: get(&c.abandoned),
            ack_failures: get(&c.ack_failures),
            broker_errors: get(&c.broker_errors),
            store_outages: get(&c.store_outages),
            outage_limit_exceeded: get(&c.outage_limit_exceeded),
            connections_lost: get(&c.connections_lost),
            held_elsewhere: get(&c.held_elsewhere),
            operations_abandoned: get(&c.operations_abandoned),
            cache_hits: get(&c.cache_hits),
        }
    }
}
