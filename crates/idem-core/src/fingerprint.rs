//! Payload fingerprints: how a redelivery is told apart from a producer reusing an ID.

use std::fmt;

use sha2::{Digest, Sha256};

/// A 32-byte digest of a message's payload, stored with its claim.
///
/// A second delivery with the same ID and the same fingerprint is a [duplicate]; with a
/// different fingerprint it is a [conflict] — a producer bug that must be surfaced, not skipped.
///
/// [duplicate]: crate::Outcome::Duplicate
/// [conflict]: crate::Outcome::Conflict
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// SHA-256 of the payload bytes: the default.
    pub fn of(payload: impl AsRef<[u8]>) -> Self {
        Self(Sha256::digest(payload.as_ref()).into())
    }

    /// A user-supplied digest, e.g. over selected fields so that a re-serialised payload with a
    /// different field order or a fresh timestamp still counts as the same message.
    /// See [`Fingerprint::hasher`] for building one.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// An incremental hasher for custom fingerprints over several fields.
    pub fn hasher() -> FingerprintHasher {
        FingerprintHasher(Sha256::new())
    }

    /// The digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Reads a stored fingerprint back; `None` when the stored value is not 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::hex::encode(&self.0[..8]))?;
        f.write_str("…")
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// Builds a [`Fingerprint`] from several fields; each field is length-prefixed so that
/// `("ab", "c")` and `("a", "bc")` differ.
#[derive(Clone)]
pub struct FingerprintHasher(Sha256);

impl FingerprintHasher {
    /// Adds one field.
    pub fn field(mut self, bytes: impl AsRef<[u8]>) -> Self {
        let bytes = bytes.as_ref();
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    /// Finishes the digest.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

impl fmt::Debug for FingerprintHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FingerprintHasher")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_sha256_of_the_payload() {
        // SHA-256("abc"), FIPS 180-2 test vector.
        let fp = Fingerprint::of("abc");
        assert_eq!(fp.as_bytes()[..4], [0xba, 0x78, 0x16, 0xbf]);
        assert_ne!(Fingerprint::of("abc"), Fingerprint::of("abd"));
    }

    #[test]
    fn hasher_fields_are_length_prefixed() {
        let a = Fingerprint::hasher().field("ab").field("c").finish();
        let b = Fingerprint::hasher().field("a").field("bc").finish();
        assert_ne!(a, b);
    }
}
