//! Lowercase hex for bytes that people read (IDs that are not text, fingerprints, derived keys)
//! and for keys built on hot paths: the one encoder every idem crate uses.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends `bytes` to `out` as lowercase hex, two digits per byte, without formatting
/// machinery (this runs on every request where a key is built from a scope).
///
/// ```
/// let mut key = String::from("scope:");
/// idem_core::hex::push(&mut key, &[0x00, 0xab, 0x7f]);
/// assert_eq!(key, "scope:00ab7f");
/// ```
pub fn push(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

/// `bytes` as lowercase hex, two digits per byte.
///
/// ```
/// assert_eq!(idem_core::hex::encode(b"\x01\xfe"), "01fe");
/// assert_eq!(idem_core::hex::encode(b""), "");
/// ```
#[must_use]
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push(&mut out, bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::encode;

    #[test]
    fn every_byte_is_two_lowercase_digits() {
        let all: Vec<u8> = (0..=255).collect();
        let hex = encode(&all);
        assert_eq!(hex.len(), 512);
        for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
            assert_eq!(std::str::from_utf8(pair), Ok(format!("{i:02x}").as_str()));
        }
    }
}
