//! Which `Idempotency-Key` header values are keys: an RFC 8941 sf-string, as the IETF draft
//! says (parsed by the `sfv` crate, RFC 9651), or a bare key as Stripe-style clients send it.

use http::HeaderMap;
use http::header::{GetAll, HeaderName, HeaderValue};
use idem_core::IdempotencyKey;

/// The header the IETF draft names: `Idempotency-Key` (header names are case-insensitive).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why a request's key header was refused (answered `400`, problem code `invalid-key`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header appeared more than once.
    #[error("the request has {0} Idempotency-Key headers; send exactly one")]
    Repeated(usize),
    /// A value starting with `"` that is not a well-formed sf-string (RFC 9651 says why).
    #[error("the Idempotency-Key header is not a well-formed structured-field string: {0}")]
    Malformed(String),
    /// Well-formed, but the key itself is refused (empty, too long, outside visible ASCII).
    #[error("{0}")]
    Invalid(String),
}

/// Reads the key from the `name` headers of a request: `Ok(None)` when there is none.
///
/// Accepted values (see the crate docs): an sf-string (`"…"`, with `\"` and `\\` escapes,
/// parameters after it ignored), whose content is the key: 1 to `max_len` bytes of printable
/// ASCII, spaces included; or, for a value that does not start with `"`, the value itself:
/// 1 to `max_len` bytes of visible ASCII (no spaces). A header given twice is refused,
/// whatever the two values are.
pub fn parse_key_header(
    headers: &HeaderMap,
    name: &HeaderName,
    max_len: usize,
) -> Result<Option<IdempotencyKey>, KeyError> {
    let values: GetAll<'_, HeaderValue> = headers.get_all(name);
    let mut iter = values.iter();
    let Some(first) = iter.next() else {
        return Ok(None);
    };
    let extra = iter.count();
    if extra > 0 {
        return Err(KeyError::Repeated(extra + 1));
    }
    parse_key(first.as_bytes(), max_len).map(Some)
}

/// Parses one header value into a key (see [`parse_key_header`]).
pub fn parse_key(value: &[u8], max_len: usize) -> Result<IdempotencyKey, KeyError> {
    let value = trim_ows(value);
    if value.first() == Some(&b'"') {
        // An Item (RFC 9651 §4.2.3): the string, parameters after it validated and ignored.
        let item = sfv::Parser::new(value)
            .parse::<sfv::Item>()
            .map_err(|e| KeyError::Malformed(e.to_string()))?;
        let sfv::BareItem::String(key) = item.bare_item else {
            return Err(KeyError::Malformed("the value is not a string".to_owned()));
        };
        // An sf-string may hold spaces (RFC 8941 §3.3.3): a quoted key keeps them.
        return IdempotencyKey::quoted(key.as_str(), max_len)
            .map_err(|e| KeyError::Invalid(e.to_string()));
    }
    // Stripe-style: the whole value is the key, checked for visible ASCII (bytes outside
    // ASCII never reach `from_utf8`'s failure path, but be safe anyway).
    let Ok(key) = std::str::from_utf8(value) else {
        return Err(KeyError::Invalid(
            "the idempotency key has a character outside visible ASCII".into(),
        ));
    };
    IdempotencyKey::with_limit(key, max_len).map_err(|e| KeyError::Invalid(e.to_string()))
}

/// Optional whitespace around a field value (RFC 9110 §5.5), which the draft's clients may
/// send and `sfv` does not skip (it skips spaces only).
fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &str) -> Result<String, KeyError> {
        parse_key(v.as_bytes(), 255).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn sf_strings_and_bare_keys_are_accepted() {
        assert_eq!(
            key(r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#).unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(key("8e03978e-40d5").unwrap(), "8e03978e-40d5");
        assert_eq!(key(r#"  "a\"b\\c"  "#).unwrap(), r#"a"b\c"#);
        // Parameters after the string are allowed by RFC 8941 and ignored.
        assert_eq!(
            key(r#""abc";v=1;x;y="z";t=tok/1;b=?1;d=1.5;n=-2;s=:AQ==:"#).unwrap(),
            "abc"
        );
        // A bare key is the value itself, quotes inside included.
        assert_eq!(key(r#"ab"c"#).unwrap(), r#"ab"c"#);
        assert_eq!(key(&"k".repeat(255)).unwrap().len(), 255);
        // RFC 8941 strings may contain spaces: quoted, they are part of the key.
        assert_eq!(key(r#""order 42""#).unwrap(), "order 42");
        assert_eq!(key(r#"" padded ""#).unwrap(), " padded ");
        assert_eq!(
            key(r#""k";a=123456789012345;b=-123456789012.123;c=@-1;d=%"caf%c3%a9";e=:AQ:;f=::"#)
                .unwrap(),
            "k"
        );
    }

    #[test]
    fn everything_else_is_refused() {
        for bad in [
            "",
            "   ",
            r#""""#,
            r#""unterminated"#,
            r#""ends with escape\"#,
            r#""bad \n escape""#,
            r#""a" "b""#,
            r#""a", "b""#,
            r#""a";"#,
            r#""a";B=1"#,
            r#""a";k=?2"#,
            r#""a";k="x"#,
            // Parameter values as RFC 9651 reads them (found by fuzz/http_key against sfv).
            r#""a";k=:/:"#,
            r#""a";k=:AQ=A:"#,
            r#""a";k=:AQ===:"#,
            r#""a";k=1234567890123456"#,
            r#""a";k=1234567890123.5"#,
            r#""a";k=1.2345"#,
            r#""a";k=1."#,
            r#""a";k=-"#,
            r#""a";k=@1.5"#,
            r#""a";k=%"%ff""#,
            r#""a";k=%"%C3%A9""#,
            r#""   ""#,
            "has space",
            "tab\tinside",
        ] {
            assert!(key(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(key(&"k".repeat(256)).is_err());
        assert!(key(&format!("\"{}\"", "k".repeat(256))).is_err());
        assert!(parse_key("clé".as_bytes(), 255).is_err());
        assert!(parse_key(b"\"cl\xc3\xa9\"", 255).is_err());
        assert!(parse_key(b"\x80abc", 255).is_err());
        assert!(parse_key(b"abcd", 3).is_err());
    }

    #[test]
    fn repeated_headers_are_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(parse_key_header(&h, &IDEMPOTENCY_KEY, 255), Ok(None));
        h.append("Idempotency-Key", HeaderValue::from_static("a"));
        assert_eq!(
            parse_key_header(&h, &IDEMPOTENCY_KEY, 255)
                .unwrap()
                .unwrap()
                .as_str(),
            "a"
        );
        h.append("IDEMPOTENCY-KEY", HeaderValue::from_static("a"));
        assert_eq!(
            parse_key_header(&h, &IDEMPOTENCY_KEY, 255),
            Err(KeyError::Repeated(2))
        );
    }
}
