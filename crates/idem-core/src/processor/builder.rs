//! Configuration of a [`Processor`], validated once at startup.

use std::time::Duration;

use crate::clock::{Clock, StoreClock};
use crate::error::{Error, ErrorKind};
use crate::id::{ConsumerName, DEFAULT_MAX_ID_LEN};
use crate::retention::{Retention, format_duration};
use crate::store::ClaimStore;

use super::{ClaimMode, Processor};

/// Builds a [`Processor`]; [`build`](Self::build) refuses unsafe configurations.
#[derive(Debug)]
pub struct ProcessorBuilder<S, C = StoreClock> {
    store: S,
    consumer: String,
    keep_for: Option<Duration>,
    redelivery_window: Option<Duration>,
    max_id_len: usize,
    mode: ClaimMode,
    prune_batch: u32,
    clock: C,
    clock_margin: Option<Duration>,
}

impl<S: ClaimStore> ProcessorBuilder<S, StoreClock> {
    pub(super) fn new(store: S, consumer: impl Into<String>) -> Self {
        Self {
            store,
            consumer: consumer.into(),
            keep_for: None,
            redelivery_window: None,
            max_id_len: DEFAULT_MAX_ID_LEN,
            mode: ClaimMode::Claim,
            prune_batch: 10_000,
            clock: StoreClock,
            clock_margin: None,
        }
    }
}

impl<S: ClaimStore, C: Clock> ProcessorBuilder<S, C> {
    /// How long claims are kept before [`Processor::prune`] may delete them.
    pub fn keep_claims_for(mut self, keep_for: Duration) -> Self {
        self.keep_for = Some(keep_for);
        self
    }

    /// A retention validated already ([`Retention::new`], e.g. parsed from configuration):
    /// its keep-for, its redelivery window and its clock margin, in one.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.keep_for = Some(retention.keep_for());
        self.redelivery_window = Some(retention.redelivery_window());
        self.clock_margin = Some(retention.clock_margin());
        self
    }

    /// The broker's longest redelivery window. [`build`](Self::build) refuses a retention
    /// shorter than this, and a store that drops claims by itself sooner (see
    /// [`ClaimStore::kept_for`]).
    pub fn redelivery_window(mut self, window: Duration) -> Self {
        self.redelivery_window = Some(window);
        self
    }

    /// Longest accepted message ID in bytes (default 255). Longer IDs are rejected as
    /// [`ErrorKind::InvalidMessageId`]; the store must be able to hold it.
    pub fn max_message_id_len(mut self, len: usize) -> Self {
        self.max_id_len = len;
        self
    }

    /// Rows deleted per transaction when pruning (default 10 000).
    pub fn prune_batch_size(mut self, n: u32) -> Self {
        self.prune_batch = n.max(1);
        self
    }

    /// For naturally idempotent handlers ("set status to shipped"): same API, but no claim row
    /// is written, so every delivery runs the handler. Only correct when running it twice has
    /// the effect of running it once.
    pub fn naturally_idempotent(mut self) -> Self {
        self.mode = ClaimMode::Skip;
        self
    }

    /// What pruning keeps beyond the redelivery window (default
    /// [`Retention::DEFAULT_CLOCK_MARGIN`], one hour), against clocks that disagree.
    pub fn clock_margin(mut self, margin: Duration) -> Self {
        self.clock_margin = Some(margin);
        self
    }

    /// Replaces the store's clock with an injected one (tests of retention): claims are then
    /// stamped, and prune cutoffs measured, by `clock` instead of the database server's.
    pub fn clock<C2: Clock>(self, clock: C2) -> ProcessorBuilder<S, C2> {
        ProcessorBuilder {
            store: self.store,
            consumer: self.consumer,
            keep_for: self.keep_for,
            redelivery_window: self.redelivery_window,
            max_id_len: self.max_id_len,
            mode: self.mode,
            prune_batch: self.prune_batch,
            clock,
            clock_margin: self.clock_margin,
        }
    }

    /// Validates and builds.
    pub fn build(self) -> Result<Processor<S, C>, Error> {
        let consumer = ConsumerName::new(&self.consumer)?;
        let default = Retention::default();
        let retention = match (self.keep_for, self.redelivery_window) {
            (None, None) => default,
            (Some(_), None) => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    "a retention was set without declaring the broker's redelivery window; \
                     call redelivery_window() so a too-short retention can be refused",
                ));
            }
            (None, Some(window)) => Retention::new(default.keep_for().max(window), window)?,
            (Some(keep), Some(window)) => Retention::new(keep, window)?,
        };
        let retention = match self.clock_margin {
            Some(margin) => retention.with_clock_margin(margin),
            None => retention,
        };
        // A store that drops claims by itself (a partitioned table's retention) must keep them
        // as long as pruning would: through the redelivery window and the clock margin. Without
        // claims (naturally idempotent handlers) there is nothing to keep.
        let kept_for = match self.mode {
            ClaimMode::Claim => self.store.kept_for(),
            ClaimMode::Skip => None,
        };
        if let Some(kept) = kept_for {
            let needed = retention
                .redelivery_window()
                .saturating_add(retention.clock_margin());
            if kept < needed {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "the store drops claims after {} (its table's retention), shorter than \
                         the broker's redelivery window of {} plus the clock margin of {}: a \
                         message redelivered after its claim was dropped would be processed \
                         twice; give the table a retention of at least {}",
                        format_duration(kept),
                        format_duration(retention.redelivery_window()),
                        format_duration(retention.clock_margin()),
                        format_duration(needed)
                    ),
                ));
            }
        }
        if self.max_id_len == 0 || self.max_id_len > self.store.max_message_id_len() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "max message ID length {} is outside what this store holds (1..={})",
                    self.max_id_len,
                    self.store.max_message_id_len()
                ),
            ));
        }
        Ok(Processor {
            store: self.store,
            consumer,
            retention,
            max_id_len: self.max_id_len,
            mode: self.mode,
            prune_batch: self.prune_batch,
            clock: self.clock,
        })
    }
}
