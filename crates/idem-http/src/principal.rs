//! Whose keys are whose: records are looked up by (principal, method, path, key), so one
//! principal can never see, replay or block another's record, whatever key it sends.

use std::fmt;

use http::request::Parts;
use idem_core::outbox::Emitter;
use idem_core::{IdempotencyKey, RequestKey, RequestScope};

/// The principal a request acts for: an account, a tenant, an API client — whatever your
/// authentication establishes. Only its bytes matter; they are hashed into the record's scope.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal(Kind);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Kind {
    Shared,
    Id(Box<[u8]>),
}

impl Principal {
    /// The principal identified by `id` (compared byte for byte).
    pub fn new(id: impl AsRef<[u8]>) -> Self {
        Self(Kind::Id(id.as_ref().into()))
    }

    /// The one principal of [`SharedScope`]; distinct from every [`Principal::new`], the empty
    /// id included.
    pub fn shared() -> Self {
        Self(Kind::Shared)
    }

    /// The key of the record the layer keeps for this principal's `method` request to `path`
    /// (as the client sent it, without the query: under `Router::nest`, with the prefix) with
    /// the client's `key` — what [`IdemRequest::request_key`](crate::IdemRequest::request_key)
    /// holds while such a request executes. From it, outside the request, recompute what its
    /// handler derived: [`DerivedKey::for_request`](idem_core::DerivedKey::for_request) for an
    /// external call's key, [`emitter`](Self::emitter) for its outbox message IDs.
    pub fn request_key(
        &self,
        method: &http::Method,
        path: &str,
        key: &IdempotencyKey,
    ) -> RequestKey {
        RequestKey::new(self.scope(method, path), key.clone())
    }

    /// The IDs [`IdemRequest::emitter`](crate::IdemRequest::emitter) hands the handler of this
    /// principal's `method` request to `path` with `key`, recomputed outside the request: a
    /// test asserting which outbox rows a request enqueued, an operator looking for the
    /// messages of a client's request.
    ///
    /// ```
    /// use idem_http::{IdempotencyKey, Principal};
    ///
    /// let key = IdempotencyKey::new("order-42")?;
    /// let alice = Principal::new("alice").emitter(&http::Method::POST, "/charges", &key).next_id();
    /// let bob = Principal::new("bob").emitter(&http::Method::POST, "/charges", &key).next_id();
    /// // Two tenants that chose one key emit under different IDs.
    /// assert_ne!(alice, bob);
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn emitter(&self, method: &http::Method, path: &str, key: &IdempotencyKey) -> Emitter {
        Emitter::for_request(&self.request_key(method, path, key))
    }

    /// The scope of this principal's records for `method` on `path`.
    pub(crate) fn scope(&self, method: &http::Method, path: &str) -> RequestScope {
        let (kind, id): (&[u8], &[u8]) = match &self.0 {
            Kind::Shared => (b"shared", b""),
            Kind::Id(id) => (b"principal", id),
        };
        RequestScope::new([
            b"idem-http".as_slice(),
            kind,
            id,
            method.as_str().as_bytes(),
            path.as_bytes(),
        ])
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Shared => f.write_str("Principal::Shared"),
            // An account ID may be personal data: say how long it is, not what it is.
            Kind::Id(id) => write!(f, "Principal({} bytes)", id.len()),
        }
    }
}

/// Finds the principal of a request, from its head (typically an extension your
/// authentication layer inserted, or a verified token).
///
/// `None` means the request has no principal: the layer answers `401 missing-principal`
/// instead of sharing a scope with other anonymous requests. Closures
/// `Fn(&Parts) -> Option<T>` with `T: AsRef<[u8]>` implement it through
/// [`IdempotencyLayer::per_principal`](crate::IdempotencyLayer::per_principal).
pub trait MakePrincipal: Clone + Send + Sync + 'static {
    /// The principal of the request with head `parts`.
    fn make_principal(&self, parts: &Parts) -> Option<Principal>;
}

/// A [`MakePrincipal`] from a function of the request head.
#[derive(Clone)]
pub struct PrincipalFn<F>(pub(crate) F);

impl<F, T> MakePrincipal for PrincipalFn<F>
where
    F: Fn(&Parts) -> Option<T> + Clone + Send + Sync + 'static,
    T: AsRef<[u8]>,
{
    fn make_principal(&self, parts: &Parts) -> Option<Principal> {
        (self.0)(parts).map(Principal::new)
    }
}

impl<F> fmt::Debug for PrincipalFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PrincipalFn")
    }
}

/// Every request shares one scope: any client that sends another's key gets the other's
/// response. **Unsafe for multi-tenant APIs**; right only where one trusted client (or one
/// tenant per deployment) calls the service. Chosen with
/// [`IdempotencyLayer::shared_scope`](crate::IdempotencyLayer::shared_scope).
#[derive(Debug, Clone, Copy, Default)]
pub struct SharedScope;

impl MakePrincipal for SharedScope {
    fn make_principal(&self, _: &Parts) -> Option<Principal> {
        Some(Principal::shared())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn scopes_separate_principals_methods_paths_and_the_shared_scope() {
        let a = Principal::new("alice").scope(&Method::POST, "/charges");
        assert_eq!(a, Principal::new("alice").scope(&Method::POST, "/charges"));
        assert_ne!(a, Principal::new("bob").scope(&Method::POST, "/charges"));
        assert_ne!(a, Principal::new("alice").scope(&Method::PATCH, "/charges"));
        assert_ne!(a, Principal::new("alice").scope(&Method::POST, "/refunds"));
        let shared = Principal::shared().scope(&Method::POST, "/charges");
        assert_ne!(shared, Principal::new("").scope(&Method::POST, "/charges"));
        assert_ne!(
            shared,
            Principal::new("shared").scope(&Method::POST, "/charges")
        );
    }
}
