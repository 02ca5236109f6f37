//! Retention: how long claims are kept, and the rule that it must outlast redelivery.
//!
//! A claim pruned while the broker may still redeliver its message turns that redelivery into a
//! second effect. So the configuration declares the broker's longest redelivery window and
//! [`Retention::new`] refuses anything shorter. Pruning also keeps a clock margin on top of the
//! window ([`Retention::DEFAULT_CLOCK_MARGIN`], one hour): the window is measured on the broker's
//! clock and claims on the store's, and the two never agree exactly.

use std::time::Duration;

use crate::error::{Error, ErrorKind};

/// How long processed IDs are kept, checked against the broker's redelivery window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    keep_for: Duration,
    redelivery_window: Duration,
    clock_margin: Duration,
}

impl Retention {
    /// What pruning keeps beyond the redelivery window unless told otherwise: one hour, far
    /// more than NTP-synchronised clocks drift apart and less than any window worth declaring.
    pub const DEFAULT_CLOCK_MARGIN: Duration = Duration::from_secs(3600);

    /// Keeps claims for `keep_for`; refuses when that is shorter than `redelivery_window`, the
    /// longest time after first delivery that the broker may still deliver the same message
    /// (Kafka topic retention, JetStream `max_age`, a DLQ replay policy…).
    pub fn new(keep_for: Duration, redelivery_window: Duration) -> Result<Self, Error> {
        if keep_for < redelivery_window {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "retention of {} is shorter than the broker's redelivery window of {}: a \
                     message redelivered after its claim was pruned would be processed twice",
                    format_duration(keep_for),
                    format_duration(redelivery_window)
                ),
            ));
        }
        Ok(Self {
            keep_for,
            redelivery_window,
            clock_margin: Self::DEFAULT_CLOCK_MARGIN,
        })
    }

    /// Replaces the clock margin pruning keeps beyond the redelivery window.
    pub fn with_clock_margin(mut self, margin: Duration) -> Self {
        self.clock_margin = margin;
        self
    }

    /// How long claims are kept.
    pub fn keep_for(&self) -> Duration {
        self.keep_for
    }

    /// The declared redelivery window.
    pub fn redelivery_window(&self) -> Duration {
        self.redelivery_window
    }

    /// The margin pruning keeps beyond the redelivery window.
    pub fn clock_margin(&self) -> Duration {
        self.clock_margin
    }

    /// The age past which a claim may be pruned: the retention, and never less than the
    /// redelivery window plus the clock margin.
    pub fn prune_age(&self) -> Duration {
        self.keep_for
            .max(self.redelivery_window.saturating_add(self.clock_margin))
    }
}

impl Default for Retention {
    /// Seven days, against a declared redelivery window of seven days — Kafka's default topic
    /// retention, the longest of the common broker defaults.
    fn default() -> Self {
        let week = Duration::from_secs(7 * 86_400);
        Self {
            keep_for: week,
            redelivery_window: week,
            clock_margin: Self::DEFAULT_CLOCK_MARGIN,
        }
    }
}

/// Parses `7d`, `36h`, `90m`, `45s`, `500ms`, or a combination such as `1d12h`.
pub fn parse_duration(text: &str) -> Result<Duration, Error> {
    let bad = || {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("invalid duration {text:?}: expected e.g. 7d, 36h, 90m, 45s or 1d12h"),
        )
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let secs_per = match &rest[..unit_len] {
            "ms" => None,
            "s" => Some(1),
            "m" => Some(60),
            "h" => Some(3600),
            "d" => Some(86_400),
            "w" => Some(7 * 86_400),
            _ => return Err(bad()),
        };
        let part = match secs_per {
            None => Duration::from_millis(n),
            Some(s) => Duration::from_secs(n.checked_mul(s).ok_or_else(bad)?),
        };
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Formats a duration, to the millisecond, in the units [`parse_duration`] reads: `7d`,
/// `1d12h`, `90s`, `1s500ms`; [`parse_duration`] reads it back as the same duration.
pub fn format_duration(d: Duration) -> String {
    let mut secs = d.as_secs();
    let millis = d.subsec_millis();
    if secs == 0 {
        return format!("{millis}ms");
    }
    let mut out = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if secs >= size {
            out.push_str(&format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    // Dropping them would make `1s500ms` read back as `1s` (found by fuzz/duration).
    if millis > 0 {
        out.push_str(&format!("{millis}ms"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
        assert_eq!(parse_duration("36h").unwrap(), Duration::from_secs(129_600));
        assert_eq!(
            parse_duration("1d12h").unwrap(),
            Duration::from_secs(129_600)
        );
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        for bad in ["", "7", "d", "7x", "-1d", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn formats_round_trip() {
        for text in ["7d", "1d12h", "90s", "1h30m", "500ms", "0ms"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
    }

    #[test]
    fn formats_keep_the_milliseconds_beside_whole_seconds() {
        assert_eq!(format_duration(Duration::from_millis(1500)), "1s500ms");
        assert_eq!(format_duration(Duration::from_millis(90_001)), "1m30s1ms");
        assert_eq!(format_duration(Duration::from_micros(2_000_999)), "2s");
        let d = Duration::new(u64::MAX, 255_000_000);
        assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
    }

    #[test]
    fn retention_shorter_than_the_window_is_refused_naming_both() {
        let err = Retention::new(Duration::from_secs(86_400), Duration::from_secs(7 * 86_400))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidConfig);
        let msg = err.to_string();
        assert!(msg.contains("1d") && msg.contains("7d"), "{msg}");
        assert!(
            Retention::new(
                Duration::from_secs(8 * 86_400),
                Duration::from_secs(7 * 86_400)
            )
            .is_ok()
        );
    }

    #[test]
    fn pruning_keeps_the_clock_margin_beyond_the_window() {
        let day = Duration::from_secs(86_400);
        // The default retention equals its window: the margin is what protects it.
        let d = Retention::default();
        assert_eq!(d.prune_age(), 7 * day + Retention::DEFAULT_CLOCK_MARGIN);
        let long = Retention::new(14 * day, 7 * day).unwrap();
        assert_eq!(long.prune_age(), 14 * day);
        let tight = Retention::new(7 * day, 7 * day)
            .unwrap()
            .with_clock_margin(Duration::from_secs(60));
        assert_eq!(tight.prune_age(), 7 * day + Duration::from_secs(60));
    }
}
