//! Calling idempotent APIs (Stripe, a service behind idem-http, any `Idempotency-Key` API)
//! with retries that cannot double an effect: a [`reqwest_middleware`] middleware.
//!
//! A network error after the server acted is the dangerous case: the charge happened, the
//! answer was lost, and a naive retry charges again. [`IdempotencyMiddleware`] gives each
//! logical `POST`/`PATCH` one `Idempotency-Key` — a fresh UUID v4, the caller's
//! ([`IdempotentRequestExt::idempotency_key`]) or one idem derived
//! ([`IdempotentRequestExt::derived_key`], what a foreign phase sends) — and sends **the same
//! key on every retry**, so the server runs the operation once and replays its answer.
//!
//! - Retried: connection errors, timeouts, a connection closed before the answer, `408`,
//!   `425`, `429`, `5xx` except `501`/`505`, and `409` only while the key is in progress
//!   (`Retry-After` present, or `Stripe-Should-Retry: true`). `Stripe-Should-Retry: false`
//!   stops. A `POST`/`PATCH` without a key is never retried.
//! - Waits: capped exponential backoff with full jitter ([`RetryPolicy`]), or the server's
//!   `Retry-After` (seconds or an HTTP date) when it fits in the time left; a longer one
//!   ends the call with that answer. Sleeps on tokio's clock (paused-time tests work) and
//!   the jitter can be seeded ([`IdempotencyMiddleware::seed`]).
//! - Bounds: attempts and total time ([`RetryPolicy::max_attempts`],
//!   [`RetryPolicy::max_elapsed`]). Each attempt's own time limit is reqwest's
//!   (`ClientBuilder::timeout`, `RequestBuilder::timeout`); a timed-out attempt is retried.
//! - Tells what happened: an [`Outcome`] (attempts, replayed, key, gave up, time waited) in
//!   the response's extensions.
//! - A streaming body cannot be sent twice: the first retry it needs fails with
//!   [`ErrorKind::BodyNotReplayable`] instead of a confusing transport error. An invalid
//!   key fails with [`ErrorKind::InvalidKey`] before anything is sent.
//! - Retries are logged at debug level, URLs redacted, keys never logged.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, Outcome, RetryPolicy};
//! use idem_testkit::fake_processor::{FakeProcessor, Fault};
//!
//! // A card processor that charges, then loses the connection before answering.
//! let processor = FakeProcessor::start().await?;
//! processor.fault_next(Fault::ChargeThenDrop);
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new(RetryPolicy::default()))
//!     .build();
//! let response = client
//!     .post(processor.charges_url())
//!     .idempotency_key("order-42-charge")
//!     .header("content-type", "application/json")
//!     .body(r#"{"account":"acct_1","amount_cents":1250}"#)
//!     .send()
//!     .await?;
//!
//! let outcome = Outcome::of(&response).expect("the middleware records an outcome");
//! assert_eq!(outcome.attempts, 2); // the first answer was lost...
//! assert!(outcome.replayed); // ...so the second got the stored charge,
//! assert_eq!(processor.stats().effects_for("order-42-charge"), 1); // charged once.
//! assert!(response.status().is_success());
//! # Ok(())
//! # }
//! ```

mod error;
mod key;
mod middleware;
mod outcome;
mod policy;

pub use error::{Error, ErrorKind};
pub use idem_core::{DerivedKey, IdempotencyKey};
pub use key::{IdempotentRequestExt, KeyChoice};
pub use middleware::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyMiddleware};
pub use outcome::Outcome;
pub use policy::{Jitter, RetryPolicy};
