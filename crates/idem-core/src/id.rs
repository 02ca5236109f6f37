//! Validated identities: the producer-set [`MessageId`] and the [`ConsumerName`] that namespaces claims.

use std::fmt;

use crate::error::{Error, ErrorKind};

/// The default upper bound on a message ID, in bytes.
///
/// 255 fits every common broker header and keeps the unique index narrow; raise it with
/// [`MessageId::with_limit`] (each store declares its own ceiling).
pub const DEFAULT_MAX_ID_LEN: usize = 255;

/// A producer-assigned message ID: non-empty, bounded, any bytes.
///
/// idem never invents IDs: a consumer-generated ID would differ on redelivery and defeat the
/// whole pattern. UUIDs, ULIDs, `order-42/payment`, or raw bytes from a binary header all work.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Box<[u8]>);

impl MessageId {
    /// Validates `bytes` against the default limit of [`DEFAULT_MAX_ID_LEN`] bytes.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self, Error> {
        Self::with_limit(bytes, DEFAULT_MAX_ID_LEN)
    }

    /// Validates `bytes` against a caller-chosen limit in bytes.
    pub fn with_limit(bytes: impl AsRef<[u8]>, max_len: usize) -> Result<Self, Error> {
        let bytes = bytes.as_ref();
        if bytes.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidMessageId,
                "message ID is empty; the producer must set a stable ID",
            ));
        }
        if bytes.len() > max_len {
            return Err(Error::new(
                ErrorKind::InvalidMessageId,
                format!(
                    "message ID is {} bytes, over the limit of {max_len} bytes",
                    bytes.len()
                ),
            ));
        }
        Ok(Self(bytes.into()))
    }

    /// For IDs the library itself built from a digest (derived keys): known non-empty and short.
    pub(crate) fn from_trusted(bytes: Vec<u8>) -> Self {
        debug_assert!(!bytes.is_empty() && bytes.len() <= DEFAULT_MAX_ID_LEN);
        Self(bytes.into_boxed_slice())
    }

    /// The raw bytes, as stored.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Length in bytes.
    #[allow(clippy::len_without_is_empty)] // never empty by construction
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// Prints the ID as text when it is UTF-8, otherwise as `0x`-prefixed hex, so logs stay readable
/// without ever being lossy.
impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) if !s.chars().any(char::is_control) => f.write_str(s),
            _ => {
                f.write_str("0x")?;
                f.write_str(&crate::hex::encode(&self.0))
            }
        }
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageId({self})")
    }
}

impl AsRef<[u8]> for MessageId {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Upper bound on a consumer name, in bytes.
pub const MAX_CONSUMER_NAME_LEN: usize = 100;

/// The name of one logical consumer (e.g. `billing`, `email-receipts`).
///
/// Claims are unique per (consumer, message ID), so two consumers of the same message each
/// process it exactly once. Names are printable ASCII without spaces, at most
/// [`MAX_CONSUMER_NAME_LEN`] bytes: they show up in dashboards and `idem stats`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerName(Box<str>);

impl ConsumerName {
    /// Validates a consumer name.
    pub fn new(name: impl AsRef<str>) -> Result<Self, Error> {
        let name = name.as_ref();
        if name.is_empty() || name.len() > MAX_CONSUMER_NAME_LEN {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "consumer name must be 1 to {MAX_CONSUMER_NAME_LEN} bytes, got {}",
                    name.len()
                ),
            ));
        }
        if let Some(c) = name.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "consumer name {name:?} contains {c:?}; use printable ASCII without spaces"
                ),
            ));
        }
        Ok(Self(name.into()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConsumerName({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_id_is_rejected_with_its_kind() {
        let err = MessageId::new("").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidMessageId);
        assert!(err.to_string().contains("empty"), "{err}");
    }

    #[test]
    fn oversized_id_names_its_length_and_the_limit() {
        let err = MessageId::new(vec![b'a'; 256]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidMessageId);
        assert!(err.to_string().contains("256 bytes"), "{err}");
        assert!(err.to_string().contains("255"), "{err}");
        assert!(MessageId::new(vec![b'a'; 255]).is_ok());
        assert!(MessageId::with_limit(vec![b'a'; 1000], 1024).is_ok());
        assert!(MessageId::with_limit(vec![b'a'; 11], 10).is_err());
    }

    #[test]
    fn binary_ids_display_as_hex() {
        let id = MessageId::new([0u8, 255, 16]).unwrap();
        assert_eq!(id.to_string(), "0x00ff10");
        assert_eq!(MessageId::new("order-7").unwrap().to_string(), "order-7");
    }

    #[test]
    fn consumer_names_are_printable_ascii() {
        assert!(ConsumerName::new("billing").is_ok());
        assert!(ConsumerName::new("").is_err());
        assert!(ConsumerName::new("has space").is_err());
        assert!(ConsumerName::new("x".repeat(101)).is_err());
    }
}
