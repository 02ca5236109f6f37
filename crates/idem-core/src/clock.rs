//! Injected time, so retention and leases are testable without sleeping.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time as microseconds since the Unix epoch: what stores keep in `processed_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// From microseconds since the Unix epoch.
    pub const fn from_micros(micros: i64) -> Self {
        Self(micros)
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> i64 {
        self.0
    }

    /// This instant minus `d`, saturating.
    pub fn saturating_sub(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_sub(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
        )
    }

    /// This instant plus `d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_add(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
        )
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Self(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
            Err(e) => Self(-i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX)),
        }
    }
}

impl fmt::Display for Timestamp {
    /// RFC 3339 in UTC, e.g. `2026-11-30T01:02:03.000004Z`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.div_euclid(1_000_000);
        let micros = self.0.rem_euclid(1_000_000);
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Which clock stamps a claim's `processed_at`, and which one a prune cutoff is measured on.
///
/// Both must be the same clock. Stamped by each consumer host and pruned by another, a host
/// whose clock runs behind would record claims that already look old and lose them early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    /// The store's own clock: the database server's where there is one (PostgreSQL, MySQL),
    /// this host's for an embedded store (SQLite), so every host agrees on it.
    StoreClock,
    /// An explicit time from an injected [`Clock`] (tests, or an application that keeps its
    /// own synchronised clock).
    At(Timestamp),
}

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// Now, by this clock.
    fn now(&self) -> Timestamp;

    /// What claims are stamped with and prune cutoffs measured on: by default this clock's
    /// [`now`](Clock::now).
    fn stamp(&self) -> Stamp {
        Stamp::At(self.now())
    }
}

/// The default: claims are stamped, and prune cutoffs measured, by the store's clock
/// ([`Stamp::StoreClock`]); [`now`](Clock::now) is this host's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreClock;

impl Clock for StoreClock {
    fn now(&self) -> Timestamp {
        SystemTime::now().into()
    }

    fn stamp(&self) -> Stamp {
        Stamp::StoreClock
    }
}

/// This host's wall clock, for stamps too. Prefer [`StoreClock`] (the default) unless every
/// host that writes or prunes claims keeps a synchronised clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        SystemTime::now().into()
    }
}

/// A clock that only moves when told to; for tests of retention and pruning.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock frozen at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self(AtomicI64::new(start.as_micros()))
    }

    /// Moves the clock forward.
    pub fn advance(&self, d: Duration) {
        let micros = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        self.0.fetch_add(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }

    fn stamp(&self) -> Stamp {
        (**self).stamp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_print_as_rfc3339() {
        assert_eq!(
            Timestamp::from_micros(0).to_string(),
            "1970-01-01T00:00:00.000000Z"
        );
        // 2024-02-29T12:34:56.000007Z
        assert_eq!(
            Timestamp::from_micros(1_709_210_096_000_007).to_string(),
            "2024-02-29T12:34:56.000007Z"
        );
    }

    #[test]
    fn the_default_clock_defers_stamps_to_the_store() {
        assert_eq!(StoreClock.stamp(), Stamp::StoreClock);
        assert!(matches!(SystemClock.stamp(), Stamp::At(_)));
        let manual = std::sync::Arc::new(ManualClock::new(Timestamp::from_micros(7)));
        assert_eq!(manual.stamp(), Stamp::At(Timestamp::from_micros(7)));
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(Timestamp::from_micros(10));
        assert_eq!(c.now().as_micros(), 10);
        c.advance(Duration::from_millis(1));
        assert_eq!(c.now().as_micros(), 1010);
    }
}
