//! The middleware: picks the key, sends it on every attempt, retries what is worth retrying
//! within the policy's bounds, and records the [`Outcome`].

use std::sync::Mutex;
use std::time::Duration;

use http::{Extensions, HeaderName, HeaderValue, Method};
use idem_core::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
use rand::{SeedableRng, rngs::SmallRng};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tokio::time::Instant;

use crate::error::{Error, ErrorKind};
use crate::key::KeyChoice;
use crate::outcome::Outcome;
use crate::policy::{RetryPolicy, Verdict, classify, transient};

/// The header the key travels in, as Stripe, idem-http and the IETF draft name it.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The replay marker idem-http and Stripe set on a stored answer: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A [`reqwest_middleware`] middleware for calling idempotent APIs.
///
/// - `POST` and `PATCH` get an `Idempotency-Key`: the caller's
///   ([`idempotency_key`](crate::IdempotentRequestExt::idempotency_key)), a derived one
///   ([`derived_key`](crate::IdempotentRequestExt::derived_key)), or a fresh UUID v4.
/// - Every retry sends the same key, so the server runs the operation once and replays it.
/// - Retried: connection errors, timeouts, a connection closed before the answer, `408`,
///   `425`, `429`, `5xx` but `501` and `505`, and `409` while the key is in progress
///   (`Retry-After` or `Stripe-Should-Retry: true`); `Stripe-Should-Retry: false` stops.
///   Only `POST`/`PATCH` with a key and the idempotent methods (`GET`, `PUT`, `DELETE`, …)
///   are retried.
/// - Waits capped exponential backoff with full jitter, or the server's `Retry-After`, on
///   tokio's clock; stops at the policy's attempt and total-time bounds.
/// - Records an [`Outcome`] in the response's extensions.
#[derive(Debug)]
pub struct IdempotencyMiddleware {
    policy: RetryPolicy,
    max_key_len: usize,
    rng: Mutex<SmallRng>,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

impl IdempotencyMiddleware {
    /// A middleware retrying by `policy`, its jitter seeded from the operating system.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            max_key_len: MAX_IDEMPOTENCY_KEY_LEN,
            rng: Mutex::new(SmallRng::from_entropy()),
        }
    }

    /// Seeds the jitter, so a test or a replayed schedule sees the same delays. Keys stay
    /// random: they never come from this generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.rng = Mutex::new(SmallRng::seed_from_u64(seed));
        self
    }

    /// The longest key accepted from the caller, in bytes (255 by default, idem-http's).
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Chooses the key and puts it in the request's header.
    fn key(&self, req: &mut Request, ext: &Extensions) -> Result<Option<IdempotencyKey>, Error> {
        let invalid = |e: idem_core::Error| {
            Error::new(
                ErrorKind::InvalidKey,
                format!("invalid idempotency key: {e}"),
            )
            .with_source(e)
        };
        let chosen = match ext.get::<KeyChoice>() {
            Some(KeyChoice::None) => return Ok(None),
            Some(KeyChoice::Given(k)) => {
                IdempotencyKey::with_limit(k, self.max_key_len).map_err(invalid)?
            }
            Some(KeyChoice::Derived(d)) => {
                IdempotencyKey::new(&d.to_uuid_string()).map_err(invalid)?
            }
            None => match req.headers().get(&IDEMPOTENCY_KEY) {
                Some(v) => {
                    let s = v.to_str().map_err(|_| {
                        Error::new(
                            ErrorKind::InvalidKey,
                            "invalid idempotency key: the Idempotency-Key header is not visible ASCII",
                        )
                    })?;
                    return IdempotencyKey::with_limit(s, self.max_key_len)
                        .map(Some)
                        .map_err(invalid);
                }
                None if *req.method() == Method::POST || *req.method() == Method::PATCH => {
                    let fresh = uuid::Uuid::new_v4();
                    IdempotencyKey::new(
                        fresh
                            .hyphenated()
                            .encode_lower(&mut uuid::Uuid::encode_buffer()),
                    )
                    .map_err(invalid)?
                }
                None => return Ok(None),
            },
        };
        let value = HeaderValue::from_str(chosen.as_str()).map_err(|e| {
            Error::new(ErrorKind::InvalidKey, "invalid idempotency key").with_source(e)
        })?;
        req.headers_mut().insert(IDEMPOTENCY_KEY, value);
        Ok(Some(chosen))
    }

    fn next_delay(&self, retry: u32) -> Duration {
        match self.rng.lock() {
            Ok(mut rng) => self.policy.delay(retry, &mut *rng),
            // A panic elsewhere while holding the lock leaves a usable generator.
            Err(poisoned) => self.policy.delay(retry, &mut *poisoned.into_inner()),
        }
    }
}

/// Methods that HTTP defines as idempotent (RFC 9110 §9.2.2): safe to repeat without a key.
fn idempotent_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

fn replayed(resp: &Response) -> bool {
    resp.headers()
        .get(&IDEMPOTENT_REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        ext: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let key = self.key(&mut req, ext).map_err(Error::into_middleware)?;
        let may_retry = key.is_some() || idempotent_method(req.method());
        let start = Instant::now();
        let mut outcome = Outcome {
            attempts: 0,
            replayed: false,
            key,
            gave_up: false,
            waited: Duration::ZERO,
        };
        loop {
            outcome.attempts += 1;
            let more = may_retry && outcome.attempts < self.policy.attempts();
            // Cloned before sending: the attempt consumes the request. `None` inside means a
            // streaming body, reported only if a retry turns out to be needed.
            let spare = more.then(|| req.try_clone());
            let method = req.method().clone();
            let result = next.clone().run(req, ext).await;

            let verdict = match &result {
                Ok(resp) => classify(resp.status(), resp.headers()),
                Err(reqwest_middleware::Error::Reqwest(e)) if transient(e) => Verdict::Retry(None),
                Err(_) => Verdict::Done,
            };
            let after = match verdict {
                Verdict::Done => return finish(result, outcome, ext),
                Verdict::Retry(after) => after,
            };
            let Some(maybe_spare) = spare else {
                outcome.gave_up = true;
                if !may_retry {
                    tracing::debug!(%method, answer = %describe(&result), "not retried: a POST or PATCH without an idempotency key");
                }
                return finish(result, outcome, ext);
            };
            let delay = after.unwrap_or_else(|| self.next_delay(outcome.attempts));
            if start.elapsed() + delay > self.policy.elapsed_bound() {
                outcome.gave_up = true;
                tracing::debug!(%method, answer = %describe(&result), delay_ms = delay.as_millis() as u64, "not retried: the delay reaches past the total-time bound");
                return finish(result, outcome, ext);
            }
            let Some(spare) = maybe_spare else {
                let attempts = outcome.attempts;
                ext.insert(outcome);
                let mut err = Error::new(
                    ErrorKind::BodyNotReplayable,
                    format!(
                        "{method} needs a retry ({}) but its body is a stream, which cannot be sent again; \
                         attempt {attempts} may have taken effect",
                        describe(&result)
                    ),
                );
                if let Err(reqwest_middleware::Error::Reqwest(e)) = result {
                    err = err.with_source(e.without_url());
                }
                return Err(err.into_middleware());
            };
            tracing::debug!(
                %method,
                url = %idem_redact::redact_url(spare.url().as_str()),
                attempt = outcome.attempts,
                answer = %describe(&result),
                delay_ms = delay.as_millis() as u64,
                "retrying with the same idempotency key"
            );
            // Let go of the failed answer (and the connection it holds) before sleeping.
            drop(result);
            tokio::time::sleep(delay).await;
            outcome.waited += delay;
            req = spare;
        }
    }
}

/// The answer or error, in words for a log line: no URL (reqwest's error text has one).
fn describe(result: &reqwest_middleware::Result<Response>) -> String {
    match result {
        Ok(resp) => resp.status().to_string(),
        Err(reqwest_middleware::Error::Reqwest(e)) if e.is_timeout() => "timeout".to_owned(),
        Err(reqwest_middleware::Error::Reqwest(e)) if e.is_connect() => {
            "connection failed".to_owned()
        }
        Err(reqwest_middleware::Error::Reqwest(_)) => {
            "connection closed before the answer".to_owned()
        }
        Err(reqwest_middleware::Error::Middleware(_)) => "middleware error".to_owned(),
    }
}

fn finish(
    result: reqwest_middleware::Result<Response>,
    outcome: Outcome,
    ext: &mut Extensions,
) -> reqwest_middleware::Result<Response> {
    match result {
        Ok(mut resp) => {
            let outcome = Outcome {
                replayed: replayed(&resp),
                ..outcome
            };
            ext.insert(outcome.clone());
            resp.extensions_mut().insert(outcome);
            Ok(resp)
        }
        Err(e) => {
            ext.insert(outcome);
            Err(e)
        }
    }
}
