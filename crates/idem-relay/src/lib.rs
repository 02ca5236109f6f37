//! The transactional outbox's relay: publishes the rows a handler enqueued
//! ([`idem_core::outbox`]) through a broker, and marks each sent only after the broker
//! confirmed it.
//!
//! A [`Relay`] runs as a task beside the service (or alone: `idem relay --database URL
//! --broker URL`). Each round it leases a batch of committed rows from a [`RelayStore`],
//! publishes them through a [`Publish`]er ([`BrokerPublisher`] for any broker a URL names,
//! reconnecting; or an [`idem_any::AnyProducer`] of your own), and settles every row:
//!
//! | what the publish returned | what happens to the row |
//! |---|---|
//! | confirmed by the broker | marked sent (`mark_sent`), deleted later by the purge |
//! | `Unavailable`, a timeout, any other kind (the broker may take it later) | released (`release`) to be leased again after a capped, jittered exponential backoff by its attempt count ([`RelayBuilder::retry_backoff`]) |
//! | `Rejected` (too large, refused), `InvalidMessageId`, `InvalidConfig` (a destination or header the broker can never take) | dead-lettered (`dead_letter`) with the reason `rejected: …`, `invalid-id: …`, `invalid-destination: …` |
//! | failed [`max_attempts`](RelayBuilder::max_attempts) times (unset by default: retry forever) | dead-lettered, reason `retries-exhausted after N attempts: …` |
//! | the store is down or read-only (lease, mark or release fails) | the relay pauses with backoff; nothing is lost or dead-lettered: rows it could not mark are published again when their lease lapses |
//! | the store is misconfigured (`Misconfigured`: no outbox table, no privilege) | [`Relay::run`] returns the error |
//!
//! Outages are logged at `info` once when they begin and once when they end; per-row lines are
//! `debug`.
//!
//! Rounds overlap: while one round's rows publish, the relay leases the next batch (at most
//! [`pipeline`](RelayBuilder::pipeline) rounds in flight, 2 by default), and each round marks
//! its rows sent in chunks as the broker confirms them rather than after its slowest publish.
//! The [`concurrency`](RelayBuilder::concurrency) bound is shared by all rounds in flight. Each
//! round leases under a lease owner of its own, so the store's per-key rule (below) keeps a
//! round from taking a row whose key's earlier rows another round still holds.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::outbox::{Emitter, Outgoing};
//! use idem_core::{ConsumerName, Error, MessageId};
//! use idem_relay::testing::{FakeRelayStore, FakeRowState};
//! use idem_relay::{CancellationToken, Publish, Relay};
//!
//! /// A broker that prints what it is given; a service uses `idem_any::AnyProducer`.
//! struct Print;
//! impl Publish for Print {
//!     async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
//!         println!("{} <- {:?}", msg.destination(), msg.id());
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! // What a handler's transaction enqueued: an in-memory fake outbox here, a SQL store's
//! // outbox table in a service.
//! let store = FakeRelayStore::new();
//! let billing = ConsumerName::new("billing")?;
//! let mut emitter = Emitter::for_message(&billing, &MessageId::new("payment-42")?);
//! let charged = emitter
//!     .message("payments.charged", br#"{"cents":500}"#.to_vec())?
//!     .ordering_key("account-7")?;
//! let seq = store.enqueue([charged])[0];
//!
//! let relay = Relay::builder("billing-relay")
//!     .poll_interval(Duration::from_millis(200))
//!     .build(store.clone(), Print)?;
//! let waker = relay.waker();
//! let stop = CancellationToken::new();
//! let running = tokio::spawn(relay.run(stop.clone()));
//! waker.wake(); // after the commit
//! while store.state_of(seq) != Some(FakeRowState::Sent) {
//!     tokio::time::sleep(Duration::from_millis(5)).await;
//! }
//! stop.cancel();
//! let stats = running.await.expect("the relay task")?;
//! assert_eq!(stats.published, 1);
//! # Ok(()) }
//! ```
//!
//! # Wake-ups
//!
//! A relay looks for rows when woken and, failing that, every
//! [`poll_interval`](RelayBuilder::poll_interval) (1 s by default): wake-ups are not durable
//! (one sent by a process that died is gone), so polling is the floor. Three sources wake it:
//! a [`RelayWaker`] the application calls after committing (in-process, free); any stream of
//! notifications plugged in with [`Relay::wake_on`] — on PostgreSQL, idem-sql's
//! `PostgresStore::outbox_wakeups()` (or `AnyStore::outbox_wakeups()`), which `LISTEN`s on the
//! channel every enqueuing transaction notifies, delivered on commit only; and a round that
//! leased a full batch, which is followed by the next at once.
//!
//! # Order: FIFO per (destination, ordering key)
//!
//! Rows with the same destination and [ordering key](idem_core::outbox::Outgoing::ordering_key)
//! are published one after another in sequence order; different keys, and rows without a key,
//! publish concurrently (at most [`concurrency`](RelayBuilder::concurrency) at once). When a
//! row fails, the rows after it of the same key are not tried in that round: they are released
//! with at least the failed row's wait, so the store hands the failed row out first. What
//! breaks the order, knowingly:
//!
//! - **A row that keeps failing holds its key.** Nothing after it is published until it goes
//!   through or is dead-lettered (then the next row goes, out of the failed one's order). Set
//!   `max_attempts` to bound the hold; rows held behind it count an attempt per release too.
//! - **The sequence is taken at insert, not at commit.** Two transactions writing the same key
//!   concurrently may commit in the opposite order to their sequence numbers; the relay
//!   publishes in sequence order, and can even publish the later row before the earlier one is
//!   visible. Write one key's messages from one transaction at a time (lock the aggregate
//!   they belong to) when the order matters.
//! - **The store must keep a key's rows together.** A lease must not hand out a keyed row while
//!   an earlier unsent row of its key is leased elsewhere or waiting out a retry
//!   ([`RelayStore::lease`]).
//! - **Redelivery.** A row published and not marked (a crash, the store down at the mark) is
//!   published again after its lease, possibly after later rows of its key.
//!
//! # At least once, with derived IDs
//!
//! A row is published at least once: a crash between the broker's confirm and the mark
//! publishes it again. Its ID is derived ([`Emitter`](idem_core::outbox::Emitter)), the same
//! on every resend, so the next idem consumer finds its claim and acknowledges the repeat as a
//! duplicate. Broker de-duplication (JetStream's `Nats-Msg-Id` window, two minutes by
//! default) catches only resends inside its window: it saves redeliveries, it is not the
//! guarantee.
//!
//! # Metrics
//!
//! Through the `metrics` facade, labelled `relay` (see [`metrics`] for the list):
//! `idem_relay_published_total`, `idem_relay_failed_total`,
//! `idem_relay_dead_lettered_total{reason}`, and the gauges `idem_outbox_unsent` and
//! `idem_outbox_oldest_unsent_seconds` (read every
//! [`backlog_interval`](RelayBuilder::backlog_interval)). [`Relay::run`] returns the same counts
//! as [`RelayStats`]. Sent rows are deleted every [`purge_interval`](RelayBuilder::purge_interval)
//! in statements of [`purge_batch`](RelayBuilder::purge_batch) rows.

mod broker;
mod inflight;
pub mod metrics;
mod publish;
mod relay;
mod round;
mod settings;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
#[cfg(test)]
mod tests;
mod verdict;
mod waker;

pub use broker::BrokerPublisher;
pub use idem_core::outbox::RelayStore;
pub use metrics::{BacklogSnapshot, RelayStats};
pub use publish::Publish;
pub use relay::Relay;
pub use settings::{MAX_BATCH, MAX_PIPELINE, RelayBuilder, RelaySettings};
pub use tokio_util::sync::CancellationToken;
pub use waker::{RelayWaker, WakeStream};
