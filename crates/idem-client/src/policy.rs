//! When to retry (which answers and errors are worth another attempt) and how long to wait
//! (capped exponential backoff with full jitter, or the server's `Retry-After`).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header::RETRY_AFTER};
use rand::Rng;

/// Stripe's hint that overrides the status: `true` retry, `false` do not.
pub(crate) const STRIPE_SHOULD_RETRY: &str = "stripe-should-retry";

/// How much randomness goes into a backoff delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Jitter {
    /// Exactly the capped exponential delay: clients that failed together retry together.
    None,
    /// A uniform delay between zero and the capped exponential delay (the default), which
    /// spreads a crowd of clients that failed together.
    Full,
}

/// The bounds and backoff of the retries; a consuming builder.
///
/// ```
/// use std::time::Duration;
/// use idem_client::{Jitter, RetryPolicy};
///
/// let policy = RetryPolicy::default()
///     .max_attempts(3)
///     .max_elapsed(Duration::from_secs(10))
///     .backoff(Duration::from_millis(50), Duration::from_secs(2))
///     .jitter(Jitter::Full);
/// assert_eq!(policy.attempts(), 3);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    max_elapsed: Duration,
    base: Duration,
    cap: Duration,
    jitter: Jitter,
}

/// 4 attempts, 30 s in all, backoff 100 ms doubling up to 5 s, full jitter.
impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            max_elapsed: Duration::from_secs(30),
            base: Duration::from_millis(100),
            cap: Duration::from_secs(5),
            jitter: Jitter::Full,
        }
    }
}

impl RetryPolicy {
    /// No retry at all: one attempt (a key is still added).
    pub fn never() -> Self {
        Self::default().max_attempts(1)
    }

    /// At most `n` attempts, the first included (at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// No retry starts after `total` from the first attempt: a delay (backoff or
    /// `Retry-After`) that would end past it ends the call with the last answer.
    pub fn max_elapsed(mut self, total: Duration) -> Self {
        self.max_elapsed = total;
        self
    }

    /// The first retry waits up to `base`, each next one twice as long, never more than `cap`.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base = base;
        self.cap = cap.max(base);
        self
    }

    /// The randomness of the backoff ([`Jitter::Full`] by default).
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The attempt bound.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The total-time bound.
    pub fn elapsed_bound(&self) -> Duration {
        self.max_elapsed
    }

    /// The delay before retry number `retry` (1 for the first retry).
    pub(crate) fn delay(&self, retry: u32, rng: &mut impl Rng) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << (retry.saturating_sub(1)).min(20))
            .min(self.cap);
        match self.jitter {
            Jitter::None => exp,
            Jitter::Full => {
                let nanos = u64::try_from(exp.as_nanos()).unwrap_or(u64::MAX);
                Duration::from_nanos(rng.gen_range(0..=nanos))
            }
        }
    }
}

/// What an answer says about another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Final: hand it to the caller.
    Done,
    /// Worth another attempt; after the server's delay if it gave one.
    Retry(Option<Duration>),
}

/// 408, 425, 429 and 5xx (but 501 and 505, which another attempt cannot fix) are retried; a
/// 409 only when it says an execution with the key is in progress (`Retry-After`, as
/// idem-http sends, or `Stripe-Should-Retry: true`). Stripe's header decides when present.
pub(crate) fn classify(status: StatusCode, headers: &HeaderMap) -> Verdict {
    let after = retry_after(headers);
    match stripe_should_retry(headers) {
        Some(false) => return Verdict::Done,
        Some(true) => return Verdict::Retry(after),
        None => {}
    }
    let retry = match status.as_u16() {
        408 | 425 | 429 => true,
        409 => after.is_some(),
        501 | 505 => false,
        500..=599 => true,
        _ => false,
    };
    if retry {
        Verdict::Retry(after)
    } else {
        Verdict::Done
    }
}

/// A transport error worth another attempt: no connection, a timeout, or a request that
/// failed in flight (the connection closed before an answer: the server may have acted, which
/// is exactly what the key is for).
pub(crate) fn transient(error: &reqwest::Error) -> bool {
    error.is_connect() || error.is_timeout() || error.is_request()
}

fn stripe_should_retry(headers: &HeaderMap) -> Option<bool> {
    let v = headers.get(STRIPE_SHOULD_RETRY)?.to_str().ok()?.trim();
    if v.eq_ignore_ascii_case("true") {
        Some(true)
    } else if v.eq_ignore_ascii_case("false") {
        Some(false)
    } else {
        None
    }
}

/// `Retry-After` as delay-seconds or an HTTP date (RFC 9110 §10.2.3); a date in the past is
/// zero, an unreadable value is ignored.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use rand::{SeedableRng, rngs::SmallRng};

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn statuses_retried_and_not() {
        let none = HeaderMap::new();
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            let s = StatusCode::from_u16(s).unwrap();
            assert_eq!(classify(s, &none), Verdict::Retry(None), "{s}");
        }
        for s in [200, 201, 400, 401, 404, 409, 422, 501, 505] {
            let s = StatusCode::from_u16(s).unwrap();
            assert_eq!(classify(s, &none), Verdict::Done, "{s}");
        }
    }

    #[test]
    fn conflict_in_progress_and_stripe_hint() {
        let in_progress = headers(&[("retry-after", "2")]);
        assert_eq!(
            classify(StatusCode::CONFLICT, &in_progress),
            Verdict::Retry(Some(Duration::from_secs(2)))
        );
        let stripe_yes = headers(&[("stripe-should-retry", "true")]);
        assert_eq!(
            classify(StatusCode::CONFLICT, &stripe_yes),
            Verdict::Retry(None)
        );
        let stripe_no = headers(&[("stripe-should-retry", "false")]);
        assert_eq!(
            classify(StatusCode::SERVICE_UNAVAILABLE, &stripe_no),
            Verdict::Done
        );
    }

    #[test]
    fn retry_after_as_date() {
        let later = SystemTime::now() + Duration::from_secs(120);
        let mut h = HeaderMap::new();
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_str(&httpdate::fmt_http_date(later)).unwrap(),
        );
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(110) && d <= Duration::from_secs(120),
            "{d:?}"
        );
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn backoff_is_capped_and_jittered() {
        let p = RetryPolicy::default()
            .backoff(Duration::from_millis(100), Duration::from_secs(1))
            .jitter(Jitter::None);
        let mut rng = SmallRng::seed_from_u64(7);
        assert_eq!(p.delay(1, &mut rng), Duration::from_millis(100));
        assert_eq!(p.delay(3, &mut rng), Duration::from_millis(400));
        assert_eq!(p.delay(10, &mut rng), Duration::from_secs(1));
        assert_eq!(p.delay(u32::MAX, &mut rng), Duration::from_secs(1));
        let full = p.jitter(Jitter::Full);
        let delays: Vec<_> = (0..50).map(|_| full.delay(4, &mut rng)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(800)));
        assert!(delays.iter().any(|d| *d != delays[0]), "full jitter varies");
    }
}
