//! What happened to one logical request: how many attempts, how long the middleware waited
//! between them, whether the answer was a replay, and whether it gave up.

use std::time::Duration;

use idem_core::IdempotencyKey;

/// What the middleware did for one logical request. Found in the response's extensions
/// ([`Outcome::of`]) and, when the call ended in an error, in the extensions passed to
/// [`ClientWithMiddleware::execute_with_extensions`](reqwest_middleware::ClientWithMiddleware::execute_with_extensions).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outcome {
    /// Requests sent, the first included (1 when no retry happened).
    pub attempts: u32,
    /// The server said the answer is a stored one (`Idempotent-Replayed: true`, as idem-http
    /// and Stripe send): the effect happened earlier, on an attempt whose answer was lost, or
    /// on an earlier logical request with the same key.
    pub replayed: bool,
    /// The `Idempotency-Key` every attempt carried; `None` when the request had none.
    pub key: Option<IdempotencyKey>,
    /// The last answer (or error) was worth retrying but a bound stopped the middleware: the
    /// attempts or the total time ran out, the server's `Retry-After` reached past the time
    /// left, or the request had no key to make a retry safe.
    pub gave_up: bool,
    /// Time spent sleeping between attempts.
    pub waited: Duration,
}

impl Outcome {
    /// The outcome the middleware recorded on `response`.
    pub fn of(response: &reqwest::Response) -> Option<&Self> {
        response.extensions().get::<Self>()
    }
}
