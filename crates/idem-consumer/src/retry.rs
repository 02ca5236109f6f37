//! How long to wait before retrying a message, and how many times.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff with equal jitter, bounded attempts.
///
/// Attempt `n` (1-based) waits a random time in `[c/2, c]` where `c = base·2^(n-1)`, capped at
/// `max_delay`: the jitter keeps consumers that failed together (a database restart) from
/// retrying in lockstep. It is *equal* jitter, not full jitter (`[0, c]`), on purpose: never
/// retrying sooner than half the cap keeps a thundering herd off a database that is still
/// recovering. After `max_attempts` the message is dead-lettered with
/// `retries-exhausted`.
///
/// Keep `max_attempts × max_delay` well under the broker's ack deadline (JetStream `AckWait`,
/// Redis Streams reclaim idle time), or the broker redelivers the message to another consumer
/// while this one still retries it. That is safe (the claim makes one of them a duplicate) but
/// wasteful.
///
/// A store outage costs no attempts: the message waits in place, retrying with the same
/// backoff. The wait is bounded by [`outage_limit`](Self::outage_limit) (default 5 minutes):
/// past it the runner says so once (a `warn` line, `idem_store_outage_limit_exceeded_total`),
/// and a message whose connection keeps breaking while it runs starts spending its attempts
/// even though the store does not answer a probe — a message that crashes the database
/// (an out-of-memory kill restarts PostgreSQL) looks like an outage every time it runs. A
/// message that never got to run (the store refused `BEGIN` or the claim) still waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base: Duration,
    max_delay: Duration,
    outage_limit: Duration,
}

/// [`RetryPolicy::outage_limit`]'s default: longer than a restart or a failover takes.
const DEFAULT_OUTAGE_LIMIT: Duration = Duration::from_secs(5 * 60);

impl Default for RetryPolicy {
    /// 5 attempts, 100 ms doubling to at most 5 s; outages waited out for 5 minutes before a
    /// lost connection spends attempts.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            outage_limit: DEFAULT_OUTAGE_LIMIT,
        }
    }
}

impl RetryPolicy {
    /// `max_attempts` attempts in all (at least 1), waiting `base` doubling up to `max_delay`;
    /// the default outage limit.
    pub fn exponential(max_attempts: u32, base: Duration, max_delay: Duration) -> Self {
        Self {
            max_attempts: max_attempts.max(1),
            base,
            max_delay: max_delay.max(base),
            outage_limit: DEFAULT_OUTAGE_LIMIT,
        }
    }

    /// How long one message waits out a store outage before the runner reports that the wait
    /// is over its limit and the message's lost connections spend its attempts (see the type's
    /// docs).
    pub fn with_outage_limit(mut self, limit: Duration) -> Self {
        self.outage_limit = limit;
        self
    }

    /// Attempts in all, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long one message waits out a store outage before its lost connections count
    /// against it.
    pub fn outage_limit(&self) -> Duration {
        self.outage_limit
    }

    /// The wait before attempt `next_attempt` (2 for the first retry).
    pub fn delay(&self, next_attempt: u32) -> Duration {
        let exp = next_attempt.saturating_sub(2).min(20);
        let ceiling = self.base.saturating_mul(1u32 << exp).min(self.max_delay);
        let floor = ceiling / 2;
        if ceiling <= floor {
            return ceiling;
        }
        rand::thread_rng().gen_range(floor..=ceiling)
    }
}

/// Backoff for reconnecting to a broker or a store: exponential with the same equal jitter
/// as [`RetryPolicy`], reset after a success. The runner uses 100 ms doubling to 10 s
/// ([`Default`]); broker adapters that reconnect on their own (MQTT) use it too, so every
/// reconnect in idem backs off the same way.
#[derive(Debug, Clone)]
pub struct ReconnectBackoff {
    failures: u32,
    policy: RetryPolicy,
}

impl Default for ReconnectBackoff {
    /// 100 ms doubling to 10 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }
}

impl ReconnectBackoff {
    /// `min` doubling to at most `max` (each wait jittered within its upper half).
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            failures: 0,
            policy: RetryPolicy::exponential(u32::MAX, min, max),
        }
    }

    /// After a success: the next failure waits the shortest time again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// The wait after one more failure.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.policy.delay(self.failures.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_within_jitter_bounds_and_cap() {
        let p = RetryPolicy::exponential(10, Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..100 {
            let d2 = p.delay(2);
            assert!(
                d2 >= Duration::from_millis(50) && d2 <= Duration::from_millis(100),
                "{d2:?}"
            );
            let d4 = p.delay(4);
            assert!(
                d4 >= Duration::from_millis(200) && d4 <= Duration::from_millis(400),
                "{d4:?}"
            );
            let d9 = p.delay(9);
            assert!(
                d9 >= Duration::from_millis(500) && d9 <= Duration::from_secs(1),
                "{d9:?}"
            );
        }
    }

    #[test]
    fn jitter_varies() {
        let p = RetryPolicy::default();
        let seen: std::collections::HashSet<_> = (0..50).map(|_| p.delay(3)).collect();
        assert!(seen.len() > 1);
    }

    #[test]
    fn at_least_one_attempt() {
        assert_eq!(
            RetryPolicy::exponential(0, Duration::ZERO, Duration::ZERO).max_attempts(),
            1
        );
    }

    #[test]
    fn reconnect_backs_off_then_resets() {
        let mut r = ReconnectBackoff::default();
        let first = r.next_delay();
        for _ in 0..10 {
            r.next_delay();
        }
        assert!(r.next_delay() > first);
        assert!(r.next_delay() <= Duration::from_secs(10));
        r.reset();
        assert!(r.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn reconnect_is_jittered_within_its_bounds() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            let mut r = ReconnectBackoff::new(Duration::from_millis(100), Duration::from_secs(5));
            let first = r.next_delay();
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            seen.insert(first);
            for _ in 0..20 {
                r.next_delay();
            }
            let capped = r.next_delay();
            assert!(capped >= Duration::from_millis(2500) && capped <= Duration::from_secs(5));
        }
        assert!(seen.len() > 1, "no jitter: {seen:?}");
    }
}
