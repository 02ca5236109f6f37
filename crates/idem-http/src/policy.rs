//! Which responses are stored (and replayed to every retry) and which are thrown away, the key
//! freed so that a retry executes again (and, on a SQL store, the writes through `IdemTx`
//! rolled back).

use std::fmt;
use std::sync::Arc;

use http::StatusCode;

/// Decides from the handler's status whether its response is the request's outcome.
///
/// The default ([`StorePolicy::default`], [`stored_by_default`]): 2xx, 3xx and 4xx are stored,
/// except 408, 409, 425 and 429, which say "not now" rather than "this is the answer"; 1xx and
/// 5xx are not. A gRPC reply is judged by its `grpc-status`, mapped to the HTTP status of the
/// same meaning. A 4xx is moreover stored only when the handler started executing (see
/// [`execution`](crate::execution)).
///
/// A response that is not stored is still sent to the client and its key is freed, so the
/// retry runs again. Writes the handler made through [`IdemTx`](crate::IdemTx) on a SQL store
/// roll back with it; on Redis, and for writes that did not go through `IdemTx`, nothing is
/// undone (see the [crate docs](crate#what-is-rolled-back-per-store)).
#[derive(Clone, Default)]
pub struct StorePolicy(Policy);

#[derive(Clone, Default)]
enum Policy {
    #[default]
    Default,
    Custom(Arc<dyn Fn(StatusCode) -> bool + Send + Sync>),
}

impl StorePolicy {
    /// A policy of your own: `true` stores the response.
    ///
    /// ```
    /// use idem_http::StorePolicy;
    /// use http::StatusCode;
    ///
    /// // Only successes are final; a 4xx lets the client fix the request and retry the key.
    /// let only_success = StorePolicy::from_fn(|status: StatusCode| status.is_success());
    /// assert!(!only_success.stores(StatusCode::UNPROCESSABLE_ENTITY));
    /// ```
    pub fn from_fn(f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        Self(Policy::Custom(Arc::new(f)))
    }

    /// Whether a response with `status` is stored.
    pub fn stores(&self, status: StatusCode) -> bool {
        match &self.0 {
            Policy::Default => stored_by_default(status),
            Policy::Custom(f) => f(status),
        }
    }
}

impl fmt::Debug for StorePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Policy::Default => f.write_str("StorePolicy::Default"),
            Policy::Custom(_) => f.write_str("StorePolicy::Custom"),
        }
    }
}

/// The default policy: 2xx, 3xx and 4xx except 408 Request Timeout, 409 Conflict, 425 Too
/// Early and 429 Too Many Requests.
///
/// 3xx is stored because a `303 See Other` after a `POST` is how many APIs report a created
/// resource; rolling it back would undo the creation the redirect points to.
pub fn stored_by_default(status: StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 425 | 429 => false,
        200..=499 => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_stores_outcomes_not_transient_refusals() {
        let p = StorePolicy::default();
        for stored in [200, 201, 204, 303, 400, 401, 404, 410, 413, 422] {
            assert!(p.stores(StatusCode::from_u16(stored).unwrap()), "{stored}");
        }
        for not in [100, 408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(!p.stores(StatusCode::from_u16(not).unwrap()), "{not}");
        }
    }

    #[test]
    fn custom_policies_decide_alone() {
        let p = StorePolicy::from_fn(|s| s == StatusCode::CREATED);
        assert!(p.stores(StatusCode::CREATED));
        assert!(!p.stores(StatusCode::OK));
    }
}
