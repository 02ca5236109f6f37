//! The relay's settings: a consuming builder whose `settings()` checks every value, so a
//! service refuses a bad configuration at start-up rather than in its first round.

use std::time::Duration;

use idem_core::{Error, ErrorKind};

/// The most rows one lease takes: a round holds them all in memory.
pub const MAX_BATCH: usize = 10_000;

/// The most rounds one relay keeps in flight ([`RelayBuilder::pipeline`]).
pub const MAX_PIPELINE: usize = 16;

/// The lease owner of pipeline slot `slot`: the relay's name for the first (so a relay that
/// does not pipeline, or restarts, finds the rows leased under its name as before), the name
/// and `#<slot>` for the others. The store keeps one owner from taking another's rows, and a
/// later row of a key whose earlier rows another owner holds: slots are what keeps two rounds
/// in flight from publishing one key's rows out of order, or one row twice.
pub(crate) fn lease_owner(name: &str, slot: usize) -> String {
    if slot == 0 {
        name.to_owned()
    } else {
        format!("{name}#{slot}")
    }
}

/// The relay's checked settings; make them with [`RelayBuilder`].
#[derive(Debug, Clone)]
pub struct RelaySettings {
    pub(crate) name: String,
    pub(crate) batch: usize,
    pub(crate) lease: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) concurrency: usize,
    pub(crate) pipeline: usize,
    pub(crate) retry_base: Duration,
    pub(crate) retry_max: Duration,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) purge_interval: Duration,
    pub(crate) purge_batch: usize,
    pub(crate) backlog_interval: Duration,
    pub(crate) create_destinations: bool,
}

impl RelaySettings {
    /// The relay's name: the lease owner in the outbox table, the `relay` label of its metrics.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Rows leased per round.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Rounds in flight at once.
    pub fn pipeline(&self) -> usize {
        self.pipeline
    }

    /// How often the relay looks for rows without a wake-up.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }
}

/// Builds [`RelaySettings`] (and with [`build`](Self::build) a [`Relay`](crate::Relay)).
///
/// | setting | default | what it bounds |
/// |---|---|---|
/// | [`batch`](Self::batch) | 100 | rows leased per round |
/// | [`lease`](Self::lease) | 60 s | how long a leased row is this relay's; make it longer than a round takes (a group's rows publish one after another) |
/// | [`poll_interval`](Self::poll_interval) | 1 s | the fallback when no wake-up comes |
/// | [`concurrency`](Self::concurrency) | 16 | publishes in flight at once, across the rounds in flight (each ordering key's rows one at a time) |
/// | [`pipeline`](Self::pipeline) | 2 | rounds in flight at once: the next batch is leased while the current one publishes |
/// | [`retry_backoff`](Self::retry_backoff) | 500 ms doubling to 60 s | how long a row waits after a failed publish, by its attempt count, jittered |
/// | [`max_attempts`](Self::max_attempts) | none | failed publishes after which a row is dead-lettered, reason `retries-exhausted` |
/// | [`purge_interval`](Self::purge_interval), [`purge_batch`](Self::purge_batch) | 60 s, 1000 | deleting sent rows |
/// | [`backlog_interval`](Self::backlog_interval) | 15 s | reading the backlog into the gauges |
/// | [`create_destinations`](Self::create_destinations) | on | [`Publish::ensure_destination`](crate::Publish::ensure_destination) before a destination's first publish |
#[derive(Debug, Clone)]
pub struct RelayBuilder {
    settings: RelaySettings,
}

impl RelayBuilder {
    /// A relay named `name` with the defaults above.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            settings: RelaySettings {
                name: name.into(),
                batch: 100,
                lease: Duration::from_secs(60),
                poll_interval: Duration::from_secs(1),
                concurrency: 16,
                pipeline: 2,
                retry_base: Duration::from_millis(500),
                retry_max: Duration::from_secs(60),
                max_attempts: None,
                purge_interval: Duration::from_secs(60),
                purge_batch: 1000,
                backlog_interval: Duration::from_secs(15),
                create_destinations: true,
            },
        }
    }

    /// Rows leased per round (1 to [`MAX_BATCH`]). A round that leases a full batch is
    /// followed by the next at once.
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n;
        self
    }

    /// How long a leased row stays this relay's before another relay may take it over.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// How often to look for rows when no wake-up came (wake-ups are not durable: a commit's
    /// wake can be lost with the process that sent it).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.settings.poll_interval = every;
        self
    }

    /// Publishes in flight at once, across ordering keys and unkeyed rows.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n;
        self
    }

    /// Rounds in flight at once (1 to [`MAX_PIPELINE`]): while one round's rows publish, the
    /// relay leases the next batch, and each round marks its rows sent in chunks as the broker
    /// confirms them, so the database's work overlaps the broker's. 1 is a strictly
    /// sequential relay. Each round leases under an owner of its own (the name, then
    /// `<name>#1`, `<name>#2`, …, all within 255 bytes), which the store keeps apart: a round
    /// never takes a row of a key whose earlier rows another round still holds. Rows leased
    /// by a slot a later run does not have (run with a smaller pipeline) wait out their
    /// [`lease`](Self::lease).
    pub fn pipeline(mut self, rounds: usize) -> Self {
        self.settings.pipeline = rounds;
        self
    }

    /// A row's wait after its `n`-th failed publish: `base·2^(n-1)` capped at `max`, jittered
    /// within its upper half (as [`idem_consumer::RetryPolicy`]).
    pub fn retry_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.settings.retry_base = base;
        self.settings.retry_max = max;
        self
    }

    /// Dead-letters a row, reason `retries-exhausted`, when its publish failed this many times
    /// (at least 1). Unset (the default), a row is retried until the broker takes it.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.settings.max_attempts = Some(n);
        self
    }

    /// How often sent rows are deleted. A turn runs up to 10 statements of
    /// [`purge_batch`](Self::purge_batch) rows; one that finds more sent rows is followed by
    /// the next turn between rounds rather than an interval later, so the purge keeps up with
    /// any publishing rate.
    pub fn purge_interval(mut self, every: Duration) -> Self {
        self.settings.purge_interval = every;
        self
    }

    /// Sent rows deleted per statement (the purge repeats until a statement deletes fewer).
    pub fn purge_batch(mut self, n: usize) -> Self {
        self.settings.purge_batch = n;
        self
    }

    /// How often the backlog is read into the gauges.
    pub fn backlog_interval(mut self, every: Duration) -> Self {
        self.settings.backlog_interval = every;
        self
    }

    /// Whether to create each destination before its first publish (default on).
    pub fn create_destinations(mut self, create: bool) -> Self {
        self.settings.create_destinations = create;
        self
    }

    /// The checked settings.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the setting: an empty name, one over 255 bytes or
    /// with a control character; a batch of 0 or over [`MAX_BATCH`]; a zero lease, poll
    /// interval, concurrency, purge interval, purge batch, backlog interval or backoff base; a
    /// backoff cap under its base; `max_attempts` 0; a pipeline of 0 or over [`MAX_PIPELINE`],
    /// or one whose last lease owner (`<name>#<n>`) would be over 255 bytes.
    pub fn settings(self) -> Result<RelaySettings, Error> {
        let s = self.settings;
        let bad = |why: String| Err(Error::new(ErrorKind::InvalidConfig, why));
        if s.name.is_empty() || s.name.len() > 255 || s.name.chars().any(char::is_control) {
            return bad(format!(
                "relay name {:?} must be 1 to 255 bytes without control characters",
                s.name
            ));
        }
        if s.batch == 0 || s.batch > MAX_BATCH {
            return bad(format!("relay batch {} must be 1 to {MAX_BATCH}", s.batch));
        }
        for (what, d) in [
            ("lease", s.lease),
            ("poll interval", s.poll_interval),
            ("purge interval", s.purge_interval),
            ("backlog interval", s.backlog_interval),
            ("retry backoff base", s.retry_base),
        ] {
            if d.is_zero() {
                return bad(format!("relay {what} must be longer than zero"));
            }
        }
        if s.retry_max < s.retry_base {
            return bad(format!(
                "relay retry backoff cap {:?} is under its base {:?}",
                s.retry_max, s.retry_base
            ));
        }
        if s.pipeline == 0 || s.pipeline > MAX_PIPELINE {
            return bad(format!(
                "relay pipeline {} must be 1 to {MAX_PIPELINE}",
                s.pipeline
            ));
        }
        if lease_owner(&s.name, s.pipeline - 1).len() > 255 {
            return bad(format!(
                "relay name {:?} is too long for its pipeline's lease owners ({:?})",
                s.name,
                lease_owner(&s.name, s.pipeline - 1)
            ));
        }
        if s.concurrency == 0 {
            return bad("relay concurrency must be at least 1".into());
        }
        if s.purge_batch == 0 {
            return bad("relay purge batch must be at least 1".into());
        }
        if s.max_attempts == Some(0) {
            return bad("relay max attempts must be at least 1".into());
        }
        Ok(s)
    }

    /// The relay over `store` and `publisher` with these settings.
    ///
    /// # Errors
    /// As [`settings`](Self::settings).
    pub fn build<S, P>(self, store: S, publisher: P) -> Result<crate::Relay<S, P>, Error>
    where
        S: idem_core::outbox::RelayStore + 'static,
        P: crate::Publish,
    {
        Ok(crate::Relay::new(store, publisher, self.settings()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_setting_is_refused_by_name() {
        let ok = || RelayBuilder::new("orders-relay");
        assert!(ok().settings().is_ok());
        for (builder, word) in [
            (RelayBuilder::new(""), "name"),
            (RelayBuilder::new("a\nb"), "name"),
            (ok().batch(0), "batch"),
            (ok().batch(MAX_BATCH + 1), "batch"),
            (ok().lease(Duration::ZERO), "lease"),
            (ok().poll_interval(Duration::ZERO), "poll interval"),
            (ok().concurrency(0), "concurrency"),
            (ok().pipeline(0), "pipeline"),
            (ok().pipeline(MAX_PIPELINE + 1), "pipeline"),
            (RelayBuilder::new("r".repeat(254)).pipeline(2), "name"),
            (ok().purge_batch(0), "purge batch"),
            (ok().purge_interval(Duration::ZERO), "purge interval"),
            (ok().backlog_interval(Duration::ZERO), "backlog interval"),
            (ok().max_attempts(0), "max attempts"),
            (
                ok().retry_backoff(Duration::from_secs(2), Duration::from_secs(1)),
                "cap",
            ),
            (ok().retry_backoff(Duration::ZERO, Duration::ZERO), "base"),
        ] {
            let err = builder.settings().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidConfig);
            assert!(err.to_string().contains(word), "{word}: {err}");
        }
    }
}
