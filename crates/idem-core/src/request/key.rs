//! The names of an idempotent request's record: the client's [`IdempotencyKey`] and the
//! [`RequestScope`] it is looked up in.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::request::RequestErrorKind;

/// The default upper bound on an idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// A client-chosen idempotency key: 1 to 255 bytes (by default) of visible ASCII
/// (`!` through `~`, no spaces or control characters).
///
/// The client picks it — a UUID per logical operation — and sends it again on every retry of
/// that operation. The server never invents one.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Box<str>);

impl IdempotencyKey {
    /// Validates `key` against the default limit of [`MAX_IDEMPOTENCY_KEY_LEN`] bytes.
    pub fn new(key: &str) -> Result<Self, Error> {
        Self::with_limit(key, MAX_IDEMPOTENCY_KEY_LEN)
    }

    /// Validates `key` against a caller-chosen limit in bytes.
    pub fn with_limit(key: &str, max_len: usize) -> Result<Self, Error> {
        let invalid = |why: String| Error::request(RequestErrorKind::InvalidKey, why);
        if key.is_empty() {
            return Err(invalid("idempotency key is empty".into()));
        }
        if key.len() > max_len {
            return Err(invalid(format!(
                "idempotency key is {} bytes, over the limit of {max_len} bytes",
                key.len()
            )));
        }
        if let Some(pos) = key.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(invalid(format!(
                "idempotency key has a character outside visible ASCII at byte {pos}"
            )));
        }
        Ok(Self(key.into()))
    }

    /// Validates a key that arrived quoted — the content of an RFC 8941 sf-string, as the
    /// IETF draft's `Idempotency-Key: "…"` carries it — against a limit in bytes: printable
    /// ASCII, so spaces are allowed (`"order 42"`), but not a key of spaces only. A bare key
    /// cannot hold a space (a proxy joins repeated headers with `, `), so [`with_limit`]
    /// refuses them.
    ///
    /// [`with_limit`]: Self::with_limit
    pub fn quoted(key: &str, max_len: usize) -> Result<Self, Error> {
        let invalid = |why: String| Error::request(RequestErrorKind::InvalidKey, why);
        if key.bytes().all(|b| b == b' ') {
            return Err(invalid(if key.is_empty() {
                "idempotency key is empty".into()
            } else {
                "idempotency key is only spaces".into()
            }));
        }
        if key.len() > max_len {
            return Err(invalid(format!(
                "idempotency key is {} bytes, over the limit of {max_len} bytes",
                key.len()
            )));
        }
        if let Some(pos) = key
            .bytes()
            .position(|b| !(b == b' ' || b.is_ascii_graphic()))
        {
            return Err(invalid(format!(
                "idempotency key has a character outside printable ASCII at byte {pos}"
            )));
        }
        Ok(Self(key.into()))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", &*self.0)
    }
}

/// Whose operation a key belongs to: a digest of its parts (for HTTP: the principal, the
/// method and the route; for a function: its name and the caller).
///
/// Two scopes share records only when every part is equal: the parts are length-prefixed
/// before hashing, so `("ab", "c")` and `("a", "bc")` differ. One principal can therefore never
/// see, replay or block another's record, whatever key it sends.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestScope([u8; 32]);

impl RequestScope {
    /// The scope of `parts`, in order.
    pub fn new<I, P>(parts: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        let mut h = Sha256::new();
        h.update(b"idem-request-scope-v1");
        for part in parts {
            let part = part.as_ref();
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Self(h.finalize().into())
    }

    /// The digest, as stored.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Reads a stored scope back; `None` when it is not 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// Lowercase hex, e.g. for key names in a key-value store.
    pub fn to_hex(&self) -> String {
        crate::hex::encode(&self.0)
    }
}

impl fmt::Debug for RequestScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestScope({}…)", &self.to_hex()[..16])
    }
}

/// Where one operation's record lives: its scope and the client's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestKey {
    /// Whose operation.
    pub scope: RequestScope,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl RequestKey {
    /// The record of `key` in `scope`.
    pub fn new(scope: RequestScope, key: IdempotencyKey) -> Self {
        Self { scope, key }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_to_255_bytes_of_visible_ascii() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new(&"k".repeat(255)).is_ok());
        for bad in ["", " ", "a b", "tab\there", "é", "new\nline", "\u{7f}"] {
            let e = IdempotencyKey::new(bad).expect_err(bad);
            assert_eq!(
                e.request_kind(),
                Some(RequestErrorKind::InvalidKey),
                "{bad:?}"
            );
        }
        assert!(IdempotencyKey::new(&"k".repeat(256)).is_err());
        assert!(IdempotencyKey::with_limit(&"k".repeat(300), 300).is_ok());
    }

    #[test]
    fn quoted_keys_may_hold_spaces() {
        assert_eq!(
            IdempotencyKey::quoted("order 42", 255).unwrap().as_str(),
            "order 42"
        );
        assert!(IdempotencyKey::quoted(" a ", 255).is_ok());
        for bad in ["", " ", "   ", "tab\there", "é", "new\nline", "\u{7f}"] {
            let e = IdempotencyKey::quoted(bad, 255).expect_err(bad);
            assert_eq!(
                e.request_kind(),
                Some(RequestErrorKind::InvalidKey),
                "{bad:?}"
            );
        }
        assert!(IdempotencyKey::quoted(&"k ".repeat(128), 255).is_err());
    }

    #[test]
    fn scopes_differ_whenever_a_part_differs() {
        let s = RequestScope::new(["alice", "POST", "/charges"]);
        assert_eq!(s, RequestScope::new(["alice", "POST", "/charges"]));
        assert_ne!(s, RequestScope::new(["bob", "POST", "/charges"]));
        assert_ne!(
            RequestScope::new(["ab", "c"]),
            RequestScope::new(["a", "bc"])
        );
        assert_eq!(RequestScope::from_slice(s.as_bytes()), Some(s));
    }
}
