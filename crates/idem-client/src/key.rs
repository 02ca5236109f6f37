//! Which idempotency key a request carries: the caller's, a derived one, a fresh UUID, or
//! none; and the extension trait that chooses it on a request builder.

use idem_core::DerivedKey;

/// The caller's choice of key for one request, kept in the request's extensions. Without
/// one, the middleware sends a fresh UUID v4 on `POST` and `PATCH` (the same on every retry)
/// and no key on other methods. A request that already has an `Idempotency-Key` header keeps
/// it (it is validated like a given key).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyChoice {
    /// This key, validated by idem's rules (1 to 255 bytes of visible ASCII).
    Given(String),
    /// A key derived by idem ([`DerivedKey`]), sent as its UUID form: the key a foreign phase
    /// or a message handler sends, the same for every execution of that step.
    Derived(DerivedKey),
    /// No key: the request is sent as it is, and a `POST` or `PATCH` is never retried.
    None,
}

/// Chooses the idempotency key on a [`reqwest_middleware::RequestBuilder`].
pub trait IdempotentRequestExt: Sized {
    /// Sends `key` as the `Idempotency-Key` of this logical request and all its retries. An
    /// invalid key fails the call with [`ErrorKind::InvalidKey`](crate::ErrorKind::InvalidKey)
    /// before anything is sent.
    fn idempotency_key(self, key: impl Into<String>) -> Self;

    /// Sends `key`'s UUID form as the `Idempotency-Key`.
    fn derived_key(self, key: DerivedKey) -> Self;

    /// Sends no key; the request is then never retried if its method is `POST` or `PATCH`.
    fn without_idempotency_key(self) -> Self;
}

impl IdempotentRequestExt for reqwest_middleware::RequestBuilder {
    fn idempotency_key(self, key: impl Into<String>) -> Self {
        self.with_extension(KeyChoice::Given(key.into()))
    }

    fn derived_key(self, key: DerivedKey) -> Self {
        self.with_extension(KeyChoice::Derived(key))
    }

    fn without_idempotency_key(self) -> Self {
        self.with_extension(KeyChoice::None)
    }
}
