//! The layer's own error responses: `application/problem+json` (RFC 9457) with `type`,
//! `title`, `status`, `detail` and a short machine-readable `code`.
//!
//! ```json
//! {
//!   "type": "https://docs.rs/idem-http/latest/idem_http/problem/index.html#conflict",
//!   "title": "Request in progress",
//!   "status": 409,
//!   "detail": "a request with this idempotency key is still being processed; retry after 1 s",
//!   "code": "conflict"
//! }
//! ```
//!
//! `type` is the [`problem_type_base`](crate::IdempotencyLayer::problem_type_base) followed by
//! the code; by default it points at the sections below.
//!
//! ### missing-key
//! `400`: the route requires an `Idempotency-Key` and the request has none. The handler did
//! not run.
//!
//! ### invalid-key
//! `400`: the header is not a key (see the [crate docs](crate#the-key) for the format), or
//! it was sent twice. The handler did not run.
//!
//! ### missing-principal
//! `401`, with `WWW-Authenticate` (`Bearer` unless
//! [`www_authenticate`](crate::IdempotencyLayer::www_authenticate) says otherwise): the request
//! carries a key but the layer's principal function found no principal (no authenticated
//! account) to scope it to. Put authentication in front of the layer.
//!
//! ### invalid-body
//! `400`: the request body could not be read to its end.
//!
//! ### body-too-large
//! `413`: the request body is over the layer's limit; nothing was recorded.
//!
//! ### fingerprint-mismatch
//! `422`: the key was already used, by the same principal on the same method and path (those
//! are the record's scope), for a request with another fingerprint: by default another query
//! string, `Content-Type` or body. The original record is untouched: a retry of the original
//! request still replays it.
//!
//! ### conflict
//! `409`, with `Retry-After` (a hint, 1 s by default, see
//! [`retry_after`](crate::IdempotencyLayer::retry_after)): a request with this key is still
//! being processed. The handler did not run.
//!
//! ### lease-lost
//! `409`, with `Retry-After: 1`: this request ran past its lease and a retry took the key over,
//! so this execution's response was not stored; the retry's response is the one that will be
//! replayed. What this execution wrote through [`IdemTx`](crate::IdemTx) on a SQL store was
//! rolled back; on Redis, and for writes that did not go through `IdemTx` (your own pool, an
//! external call), nothing was undone.
//!
//! ### store-unavailable
//! `503`, with `Retry-After` (the same hint as for `conflict`): the idempotency store could
//! not be reached, refused the work, or was busy past its bound (SQLite's write lock held by
//! another request longer than the store's busy timeout); the handler did not run, or its
//! response was not stored (writes through `IdemTx` on a SQL store rolled back). The key is
//! free: retry later with the same key.
//!
//! ### internal-error
//! `500`: the layer could not finish the request: a stored response it cannot read, a handler
//! that kept the transaction past its end, a response body that failed while being stored.
//! Nothing was stored; writes through `IdemTx` on a SQL store were rolled back, anything else
//! the handler did stands.
//!
//! ### phase-failed
//! `503`, with `Retry-After: 1`: the request runs as recovery points
//! ([`IdemPhases`](crate::IdemPhases)) and one of its phases failed (a third party did not
//! answer, a write was refused). That phase's writes through its transaction were rolled back;
//! the phases before it committed and stand, and the record keeps their last recovery point:
//! retry with the same key, and the request resumes there (a committed phase never runs
//! again). Nothing was stored as the response.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

/// The default [`problem_type_base`](crate::IdempotencyLayer::problem_type_base): this
/// module's documentation.
pub const DEFAULT_TYPE_BASE: &str =
    "https://docs.rs/idem-http/latest/idem_http/problem/index.html#";

/// `application/problem+json`.
pub const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The machine-readable `code` of a problem response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemCode {
    /// `400 missing-key`.
    MissingKey,
    /// `400 invalid-key`.
    InvalidKey,
    /// `401 missing-principal`.
    MissingPrincipal,
    /// `400 invalid-body`.
    InvalidBody,
    /// `413 body-too-large`.
    BodyTooLarge,
    /// `422 fingerprint-mismatch`.
    FingerprintMismatch,
    /// `409 conflict`: the key is in flight.
    Conflict,
    /// `409 lease-lost`: this execution's lease was taken over.
    LeaseLost,
    /// `503 store-unavailable`.
    StoreUnavailable,
    /// `500 internal-error`.
    InternalError,
    /// `503 phase-failed`: a phase of a request run as recovery points failed; its committed
    /// phases stand and the retry resumes after them.
    PhaseFailed,
}

impl ProblemCode {
    /// Every code, in the order of the documentation.
    pub const ALL: [ProblemCode; 11] = [
        Self::MissingKey,
        Self::InvalidKey,
        Self::MissingPrincipal,
        Self::InvalidBody,
        Self::BodyTooLarge,
        Self::FingerprintMismatch,
        Self::Conflict,
        Self::LeaseLost,
        Self::StoreUnavailable,
        Self::InternalError,
        Self::PhaseFailed,
    ];

    /// The `code` member, e.g. `"missing-key"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey => "invalid-key",
            Self::MissingPrincipal => "missing-principal",
            Self::InvalidBody => "invalid-body",
            Self::BodyTooLarge => "body-too-large",
            Self::FingerprintMismatch => "fingerprint-mismatch",
            Self::Conflict => "conflict",
            Self::LeaseLost => "lease-lost",
            Self::StoreUnavailable => "store-unavailable",
            Self::InternalError => "internal-error",
            Self::PhaseFailed => "phase-failed",
        }
    }

    /// The response status.
    pub const fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::InvalidBody => StatusCode::BAD_REQUEST,
            Self::MissingPrincipal => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Conflict | Self::LeaseLost => StatusCode::CONFLICT,
            Self::StoreUnavailable | Self::PhaseFailed => StatusCode::SERVICE_UNAVAILABLE,
            Self::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `title` member: the same for every occurrence of the code.
    pub const fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key required",
            Self::InvalidKey => "Invalid Idempotency-Key",
            Self::MissingPrincipal => "No principal for the Idempotency-Key",
            Self::InvalidBody => "Unreadable request body",
            Self::BodyTooLarge => "Request body too large",
            Self::FingerprintMismatch => "Idempotency-Key reused for a different request",
            Self::Conflict => "Request in progress",
            Self::LeaseLost => "Lease lost to a retry",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::InternalError => "Idempotent request failed",
            Self::PhaseFailed => "A phase of the request failed",
        }
    }
}

impl std::fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A problem response of `code` with `detail`, its `type` under `type_base` (use
/// [`DEFAULT_TYPE_BASE`] unless the layer was configured otherwise): for a framework
/// integration that answers for the layer (an extractor finding no transaction, say).
pub fn problem_response(
    code: ProblemCode,
    detail: impl Into<String>,
    type_base: &str,
) -> Response<Bytes> {
    Problem::new(code, detail).render(type_base)
}

/// One problem response, before it is rendered.
#[derive(Debug)]
pub(crate) struct Problem {
    pub(crate) code: ProblemCode,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<u64>,
}

impl Problem {
    pub(crate) fn new(code: ProblemCode, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }

    pub(crate) fn render(self, type_base: &str) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": format!("{type_base}{}", self.code.as_str()),
            "title": self.code.title(),
            "status": self.code.status().as_u16(),
            "detail": self.detail,
            "code": self.code.as_str(),
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = self.code.status();
        response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_rfc9457_with_a_code() {
        let r = Problem::new(ProblemCode::Conflict, "still \"running\"")
            .retry_after(0)
            .render("urn:x:");
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.headers()[RETRY_AFTER], "1");
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["type"], "urn:x:conflict");
        assert_eq!(v["status"], 409);
        assert_eq!(v["code"], "conflict");
        assert_eq!(v["detail"], "still \"running\"");
        assert_eq!(v["title"], "Request in progress");
    }

    #[test]
    fn codes_are_distinct_kebab_case() {
        let mut seen = std::collections::HashSet::new();
        for c in ProblemCode::ALL {
            assert!(seen.insert(c.as_str()));
            assert!(
                c.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'-')
            );
            assert!(c.status().is_client_error() || c.status().is_server_error());
        }
    }
}
