//! The opt-in local cache of completed claims ([`Consumer::local_cache`]): a redelivery of a
//! message this process committed is acknowledged as a duplicate without a round trip to the
//! store.
//!
//! What it may hold is the whole design:
//! - **only claims whose commit this process saw succeed** — never a claim in progress, a
//!   lookup that found nothing, a transaction that rolled back, or a commit whose outcome is
//!   unknown (a connection lost during `COMMIT`): those go to the store every time, which is
//!   the only place that knows. A duplicate the store reports is not added either: its claim
//!   may be near the end of its retention, and a store without a shared transaction could
//!   report one still in progress.
//! - **the fingerprint with the ID**: a cached ID whose delivery carries another fingerprint
//!   is not answered from the cache; it goes to the store, which reports the conflict (a dead
//!   letter, reason `conflict`) as without the cache.
//! - **no entry outlives its claim**: each entry expires at the retention's `keep_for` (and the
//!   store's own [`kept_for`](idem_core::ClaimStore::kept_for), when shorter) counted from
//!   before the claim was taken, so pruning never leaves an ID the cache still answers for.
//! - **bounded**: at most [`LocalCache::new`]'s number of entries (moka's TinyLFU eviction);
//!   a miss costs what it costs without the cache.
//!
//! The trade-off: the cache knows only this process's commits, so it saves round trips on
//! same-process redeliveries (a nack, an ack lost after commit, a redelivery to the same
//! consumer) and nothing on a duplicate committed by another process; and a claim deleted
//! behind the consumer's back (an operator's `DELETE`, a prune with a shorter age than the
//! retention) is still answered "duplicate" from the cache until its entry expires.

use std::time::{Duration, Instant};

use idem_core::{ClaimStore, Clock, Identified, MessageId, Processor};

/// Configures the opt-in local cache of completed claims ([`Consumer::local_cache`]).
///
/// ```
/// use std::time::Duration;
/// use idem_consumer::LocalCache;
///
/// // 100k IDs, at most an hour old (and never older than the claims' retention).
/// let cache = LocalCache::new(100_000).max_age(Duration::from_secs(3600));
/// # let _ = cache;
/// ```
///
/// [`Consumer::local_cache`]: crate::Consumer::local_cache
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCache {
    max_entries: u64,
    max_age: Option<Duration>,
}

impl LocalCache {
    /// A cache of at most `max_entries` message IDs (with their fingerprints: about 100 bytes
    /// each plus the ID). Entries live as long as the claims' retention at most.
    pub fn new(max_entries: u64) -> Self {
        Self {
            max_entries,
            max_age: None,
        }
    }

    /// Expires entries after `age` when that is shorter than the retention: a bound on how
    /// long a claim deleted behind the consumer's back is still answered from the cache.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = Some(age);
        self
    }

    /// The most entries the cache holds.
    pub fn max_entries(&self) -> u64 {
        self.max_entries
    }
}

/// A cached claim: the fingerprint it was committed with, and when the entry must be gone.
#[derive(Debug, Clone, Copy)]
struct Entry {
    fingerprint: idem_core::Fingerprint,
    expires: Instant,
}

/// Per-entry expiry: each entry at its own deadline, taken before its claim was.
struct AtDeadline;

impl moka::Expiry<MessageId, Entry> for AtDeadline {
    fn expire_after_create(
        &self,
        _id: &MessageId,
        entry: &Entry,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.expires.saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _id: &MessageId,
        entry: &Entry,
        updated_at: Instant,
        _left: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.expires.saturating_duration_since(updated_at))
    }
}

/// One run's cache of completed claims (built from [`LocalCache`] when the run starts).
#[derive(Clone)]
pub(crate) struct ClaimCache {
    entries: moka::sync::Cache<MessageId, Entry>,
    /// The longest an entry lives, counted from before its claim was taken.
    max_age: Duration,
}

impl std::fmt::Debug for ClaimCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimCache")
            .field("entries", &self.entries.entry_count())
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl ClaimCache {
    /// The cache for a run of `processor`, or `None` when nothing may be cached: the
    /// processor writes no claims (naturally idempotent: a redelivery runs again), or the
    /// retention leaves no time.
    pub(crate) fn for_processor<S: ClaimStore, C: Clock>(
        config: LocalCache,
        processor: &Processor<S, C>,
    ) -> Option<Self> {
        if !processor.writes_claims() {
            return None;
        }
        Self::new(
            config,
            processor.retention().keep_for(),
            processor.store().kept_for(),
        )
    }

    /// A cache whose entries live at most `keep_for` (the retention), `kept_for` (the
    /// store's own floor, when it drops claims itself) and the configured age.
    pub(crate) fn new(
        config: LocalCache,
        keep_for: Duration,
        kept_for: Option<Duration>,
    ) -> Option<Self> {
        let max_age = [Some(keep_for), kept_for, config.max_age]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(keep_for);
        if max_age.is_zero() || config.max_entries == 0 {
            return None;
        }
        let entries = moka::sync::Cache::builder()
            .max_capacity(config.max_entries)
            .expire_after(AtDeadline)
            .build();
        Some(Self { entries, max_age })
    }

    /// Whether `msg` is a duplicate of a claim this process committed: its ID is cached with
    /// the same fingerprint. Another fingerprint (a conflict) or no entry: `false`, and the
    /// store decides.
    pub(crate) fn answers(&self, msg: &impl Identified) -> bool {
        self.entries
            .get(msg.message_id())
            .is_some_and(|e| e.fingerprint == msg.fingerprint() && Instant::now() < e.expires)
    }

    /// Records `msg`'s claim, whose commit succeeded; `claimed_since` is an instant taken
    /// before the claim was (its store stamp is later), so the entry expires before the claim
    /// may be pruned.
    pub(crate) fn fill(&self, msg: &impl Identified, claimed_since: Instant) {
        let expires = claimed_since + self.max_age;
        if expires <= Instant::now() {
            return;
        }
        self.entries.insert(
            msg.message_id().clone(),
            Entry {
                fingerprint: msg.fingerprint(),
                expires,
            },
        );
    }

    /// Moves the deliveries this cache answers (see [`answers`](Self::answers)) out of a
    /// batch, keeping the rest in order: they are acked as duplicates, and the batch's claim
    /// statement is sent for the others only.
    pub(crate) fn take_answered<Dl, M: Identified>(
        &self,
        deliveries: &mut Vec<Dl>,
        msgs: &mut Vec<M>,
    ) -> Vec<(Dl, M)> {
        if !msgs.iter().any(|m| self.answers(m)) {
            return Vec::new();
        }
        let mut answered = Vec::new();
        let (mut keep_d, mut keep_m) = (
            Vec::with_capacity(msgs.len()),
            Vec::with_capacity(msgs.len()),
        );
        for (d, m) in deliveries.drain(..).zip(msgs.drain(..)) {
            if self.answers(&m) {
                answered.push((d, m));
            } else {
                keep_d.push(d);
                keep_m.push(m);
            }
        }
        *deliveries = keep_d;
        *msgs = keep_m;
        answered
    }

    /// Entries held now, after pending evictions ran (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.entry_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Fingerprint, Message};

    fn msg(id: &str, payload: &str) -> Message<()> {
        Message::with_fingerprint(MessageId::new(id).unwrap(), Fingerprint::of(payload), ())
    }

    fn cache(entries: u64, keep_for: Duration) -> ClaimCache {
        ClaimCache::new(LocalCache::new(entries), keep_for, None).unwrap()
    }

    #[test]
    fn a_filled_id_answers_only_with_its_own_fingerprint() {
        let c = cache(10, Duration::from_secs(60));
        assert!(!c.answers(&msg("a", "A")), "a miss is not an answer");
        c.fill(&msg("a", "A"), Instant::now());
        assert!(c.answers(&msg("a", "A")));
        assert!(
            !c.answers(&msg("a", "A2")),
            "another payload goes to the store, which reports the conflict"
        );
        assert!(!c.answers(&msg("b", "A")));
    }

    #[test]
    fn entries_never_outlive_the_shortest_of_retention_store_floor_and_max_age() {
        let d = Duration::from_secs;
        let age =
            |config: LocalCache, keep, kept| ClaimCache::new(config, keep, kept).unwrap().max_age;
        assert_eq!(age(LocalCache::new(1), d(600), None), d(600));
        assert_eq!(age(LocalCache::new(1), d(600), Some(d(300))), d(300));
        assert_eq!(
            age(LocalCache::new(1).max_age(d(60)), d(600), Some(d(300))),
            d(60)
        );
        assert!(ClaimCache::new(LocalCache::new(1), Duration::ZERO, None).is_none());
        assert!(ClaimCache::new(LocalCache::new(0), d(1), None).is_none());
    }

    #[test]
    fn an_entry_expires_at_its_claims_retention_counted_from_before_the_claim() {
        let c = cache(10, Duration::from_millis(150));
        // Claimed 100 ms ago: 50 ms left of its retention, not 150.
        let claimed = Instant::now() - Duration::from_millis(100);
        c.fill(&msg("a", "A"), claimed);
        assert!(c.answers(&msg("a", "A")));
        std::thread::sleep(Duration::from_millis(80));
        assert!(!c.answers(&msg("a", "A")), "the entry outlived its claim");
        // A claim already past its retention is not cached at all.
        c.fill(&msg("b", "B"), Instant::now() - Duration::from_millis(200));
        assert!(!c.answers(&msg("b", "B")));
    }

    #[test]
    fn the_bound_on_entries_is_respected() {
        let c = cache(100, Duration::from_secs(60));
        for i in 0..1_000 {
            c.fill(&msg(&format!("m-{i}"), "x"), Instant::now());
        }
        assert!(c.len() <= 100, "{} entries held", c.len());
    }
}
