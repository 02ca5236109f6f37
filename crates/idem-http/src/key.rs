//! Which `Idempotency-Key` header values are keys: an RFC 8941 sf-string, as the IETF draft
//! says, or a bare key as Stripe-style clients send it.

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
    /// A value starting with `"` that is not a well-formed sf-string.
    #[error("the Idempotency-Key header is not a well-formed structured-field string: {0}")]
    Malformed(&'static str),
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
        let mut p = Parser { s: value, i: 0 };
        let key = p.sf_string()?;
        p.parameters()?;
        p.skip_sp();
        if p.i != p.s.len() {
            return Err(KeyError::Malformed(
                "unexpected characters after the string",
            ));
        }
        // An sf-string may hold spaces (RFC 8941 §3.3.3): a quoted key keeps them.
        return IdempotencyKey::quoted(&key, max_len).map_err(|e| KeyError::Invalid(e.to_string()));
    }
    let key = {
        // Stripe-style: the whole value is the key. Checked for visible ASCII below; bytes
        // outside ASCII never reach `from_utf8`'s failure path, but be safe anyway.
        match std::str::from_utf8(value) {
            Ok(s) => s.to_owned(),
            Err(_) => {
                return Err(KeyError::Invalid(
                    "the idempotency key has a character outside visible ASCII".into(),
                ));
            }
        }
    };
    IdempotencyKey::with_limit(&key, max_len).map_err(|e| KeyError::Invalid(e.to_string()))
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// Just enough of RFC 8941 (and 9651) for an Item whose bare item is a String: the string
/// itself and the parameters that may follow it, which are validated and ignored.
struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn skip_sp(&mut self) {
        while self.peek() == Some(b' ') {
            self.i += 1;
        }
    }

    /// RFC 8941 §4.2.5.
    fn sf_string(&mut self) -> Result<String, KeyError> {
        if self.bump() != Some(b'"') {
            return Err(KeyError::Malformed("a string starts with a double quote"));
        }
        let mut out = String::new();
        loop {
            match self.bump() {
                None => return Err(KeyError::Malformed("the string is not terminated")),
                Some(b'\\') => match self.bump() {
                    Some(c @ (b'"' | b'\\')) => out.push(char::from(c)),
                    None => return Err(KeyError::Malformed("the string is not terminated")),
                    Some(_) => {
                        return Err(KeyError::Malformed(
                            "only \\\" and \\\\ are escapes in a string",
                        ));
                    }
                },
                Some(b'"') => return Ok(out),
                Some(c @ 0x20..=0x7e) => out.push(char::from(c)),
                Some(_) => {
                    return Err(KeyError::Malformed(
                        "a string holds only printable ASCII characters",
                    ));
                }
            }
        }
    }

    /// RFC 8941 §4.2.3.2: `*( ";" *SP key [ "=" bare-item ] )`.
    fn parameters(&mut self) -> Result<(), KeyError> {
        while self.peek() == Some(b';') {
            self.i += 1;
            self.skip_sp();
            match self.peek() {
                Some(b'a'..=b'z' | b'*') => self.i += 1,
                _ => return Err(KeyError::Malformed("a parameter name is missing")),
            }
            while let Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*') = self.peek() {
                self.i += 1;
            }
            if self.peek() == Some(b'=') {
                self.i += 1;
                self.bare_item()?;
            }
        }
        Ok(())
    }

    /// Any bare item, validated and discarded (a parameter's value).
    fn bare_item(&mut self) -> Result<(), KeyError> {
        let bad = |why| Err(KeyError::Malformed(why));
        match self.peek() {
            Some(b'"') => self.sf_string().map(drop),
            Some(b'-' | b'0'..=b'9') => self.number().map(drop),
            Some(b'@') => {
                self.i += 1;
                match self.number()? {
                    Number::Integer => Ok(()),
                    Number::Decimal => bad("a date is an integer"),
                }
            }
            Some(b'?') => {
                self.i += 1;
                match self.bump() {
                    Some(b'0' | b'1') => Ok(()),
                    _ => bad("a boolean is ?0 or ?1"),
                }
            }
            Some(b':') => {
                self.i += 1;
                let start = self.i;
                while let Some(b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' | b'=') =
                    self.peek()
                {
                    self.i += 1;
                }
                let content = &self.s[start..self.i];
                if self.bump() != Some(b':') {
                    return bad("a byte sequence ends with a colon");
                }
                if is_base64(content) {
                    Ok(())
                } else {
                    bad("a byte sequence is not base64")
                }
            }
            Some(b'%') => {
                // RFC 9651 display string: %"…" with %xx escapes of UTF-8 bytes.
                self.i += 1;
                if self.bump() != Some(b'"') {
                    return bad("a display string starts with %\"");
                }
                let mut text = Vec::new();
                loop {
                    match self.bump() {
                        Some(b'"') if std::str::from_utf8(&text).is_ok() => return Ok(()),
                        Some(b'"') => return bad("a display string is not UTF-8"),
                        Some(b'%') => {
                            let mut byte = 0;
                            for _ in 0..2 {
                                let nibble = match self.bump() {
                                    Some(c @ b'0'..=b'9') => c - b'0',
                                    Some(c @ b'a'..=b'f') => c - b'a' + 10,
                                    _ => return bad("a display string escape is %xx"),
                                };
                                byte = byte << 4 | nibble;
                            }
                            text.push(byte);
                        }
                        Some(c @ 0x20..=0x7e) => text.push(c),
                        _ => return bad("the display string is not terminated"),
                    }
                }
            }
            Some(b'A'..=b'Z' | b'a'..=b'z' | b'*') => {
                self.i += 1;
                while let Some(c) = self.peek() {
                    if is_tchar(c) || c == b':' || c == b'/' {
                        self.i += 1;
                    } else {
                        break;
                    }
                }
                Ok(())
            }
            _ => bad("a parameter value is not a structured-field item"),
        }
    }

    /// Integer (at most 15 digits) or decimal (at most 12 digits, a point, 1 to 3 digits),
    /// RFC 9651 §4.2.4.
    fn number(&mut self) -> Result<Number, KeyError> {
        let bad = Err(KeyError::Malformed("a number is not well-formed"));
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        let integer = self.digits();
        if integer == 0 {
            return bad;
        }
        if self.peek() != Some(b'.') {
            return if integer <= 15 {
                Ok(Number::Integer)
            } else {
                bad
            };
        }
        self.i += 1;
        let fraction = self.digits();
        if integer <= 12 && (1..=3).contains(&fraction) {
            Ok(Number::Decimal)
        } else {
            bad
        }
    }

    /// Skips ASCII digits; how many.
    fn digits(&mut self) -> usize {
        let start = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        self.i - start
    }
}

/// Which kind of number [`Parser::number`] read.
enum Number {
    Integer,
    Decimal,
}

/// Base64 as RFC 9651 §4.2.7 decodes it: padding optional but never more than canonical,
/// `=` only at the end, and no length that leaves a lone 6-bit symbol.
fn is_base64(s: &[u8]) -> bool {
    let data = s.iter().rposition(|&c| c != b'=').map_or(0, |i| i + 1);
    let (data, padding) = s.split_at(data);
    !data.contains(&b'=') && data.len() % 4 != 1 && padding.len() <= (4 - data.len() % 4) % 4
}

fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
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
