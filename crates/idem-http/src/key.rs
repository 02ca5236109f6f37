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
/// parameters after it ignored) or, for a value that does not start with `"`, the value itself;
/// either way the key must be 1 to `max_len` bytes of visible ASCII. A header given twice is
/// refused, whatever the two values are.
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
    let key = if value.first() == Some(&b'"') {
        let mut p = Parser { s: value, i: 0 };
        let key = p.sf_string()?;
        p.parameters()?;
        p.skip_sp();
        if p.i != p.s.len() {
            return Err(KeyError::Malformed(
                "unexpected characters after the string",
            ));
        }
        key
    } else {
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
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b'@') => {
                self.i += 1;
                self.number()
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
                while let Some(b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' | b'=') =
                    self.peek()
                {
                    self.i += 1;
                }
                match self.bump() {
                    Some(b':') => Ok(()),
                    _ => bad("a byte sequence ends with a colon"),
                }
            }
            Some(b'%') => {
                // RFC 9651 display string: %"…" with %xx escapes for non-ASCII.
                self.i += 1;
                if self.bump() != Some(b'"') {
                    return bad("a display string starts with %\"");
                }
                loop {
                    match self.bump() {
                        Some(b'"') => return Ok(()),
                        Some(b'%') => {
                            for _ in 0..2 {
                                match self.bump() {
                                    Some(b'0'..=b'9' | b'a'..=b'f') => {}
                                    _ => return bad("a display string escape is %xx"),
                                }
                            }
                        }
                        Some(0x20..=0x7e) => {}
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

    /// Integer or decimal, RFC 8941 §4.2.4.
    fn number(&mut self) -> Result<(), KeyError> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        let start = self.i;
        while let Some(b'0'..=b'9' | b'.') = self.peek() {
            self.i += 1;
        }
        let digits = &self.s[start..self.i];
        let dots = digits.iter().filter(|&&c| c == b'.').count();
        let ok = !digits.is_empty()
            && digits[0].is_ascii_digit()
            && digits.last().is_some_and(u8::is_ascii_digit)
            && dots <= 1
            && digits.len() <= 16;
        if ok {
            Ok(())
        } else {
            Err(KeyError::Malformed("a number is not well-formed"))
        }
    }
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
            r#""has space""#,
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
