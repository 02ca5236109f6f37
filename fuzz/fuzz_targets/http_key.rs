//! The `Idempotency-Key` request header: `parse_key` (one value: an RFC 8941 sf-string, or a
//! bare Stripe-style key) and `parse_key_header` (a request's header map, repeats included).
//!
//! - A value starting with `"` is accepted exactly when RFC 9651 (the `sfv` crate, as the
//!   reference) parses it as an Item whose bare item is a String that is a valid quoted key
//!   (`IdempotencyKey::quoted`: spaces allowed), and the key is that String; any other value
//!   is accepted exactly when it is itself a valid bare key (`IdempotencyKey::with_limit`).
//! - An accepted key, re-serialised as an sf-string (and, when it neither starts with `"` nor
//!   holds a space, as a bare value), parses back to the same key.
//! - A header map built from fuzz bytes: no key header is `Ok(None)`, one is `parse_key` of
//!   its value, two or more (in any spelling of the name) are `Repeated(n)`.
#![no_main]

use arbitrary::Arbitrary;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use idem_core::IdempotencyKey;
use idem_http::{IDEMPOTENCY_KEY, KeyError, parse_key, parse_key_header};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    value: &'a [u8],
    limit: u8,
    /// Which header is the key header: the standard one, or one of the request's own names.
    custom_name: Option<&'a [u8]>,
    headers: Vec<(Name<'a>, &'a [u8])>,
}

#[derive(Arbitrary, Debug)]
enum Name<'a> {
    Key,
    KeyUpper,
    Other(&'a [u8]),
}

fuzz_target!(|input: Input<'_>| {
    // 0 and small limits matter (everything refused, off-by-one); 255 is the default.
    let limit = if input.limit == 0xff {
        255
    } else {
        usize::from(input.limit % 64)
    };
    check_value(input.value, limit);

    let key_name = match input.custom_name.map(HeaderName::from_bytes) {
        Some(Ok(name)) => name,
        _ => IDEMPOTENCY_KEY,
    };
    let mut map = HeaderMap::new();
    let mut values = Vec::new();
    for (name, value) in &input.headers {
        let name = match name {
            Name::Key => key_name.clone(),
            Name::KeyUpper => {
                match HeaderName::from_bytes(key_name.as_str().to_ascii_uppercase().as_bytes()) {
                    Ok(n) => n,
                    Err(_) => continue,
                }
            }
            Name::Other(raw) => match HeaderName::from_bytes(raw) {
                Ok(n) => n,
                Err(_) => continue,
            },
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        if name == key_name {
            values.push(value.clone());
        }
        map.append(name, value);
    }
    let got = parse_key_header(&map, &key_name, limit);
    match values.as_slice() {
        [] => assert_eq!(got, Ok(None)),
        [one] => assert_eq!(got, parse_key(one.as_bytes(), limit).map(Some)),
        many => assert_eq!(got, Err(KeyError::Repeated(many.len()))),
    }
});

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

#[track_caller]
fn check_value(value: &[u8], limit: usize) {
    let got = parse_key(value, limit);
    let trimmed = trim_ows(value);
    let expected: Option<String> = if trimmed.first() == Some(&b'"') {
        match sfv::Parser::new(trimmed).parse::<sfv::Item>() {
            Ok(sfv::Item {
                bare_item: sfv::BareItem::String(s),
                ..
            }) => Some(s.as_str().to_owned()),
            _ => None,
        }
        .filter(|k| IdempotencyKey::quoted(k, limit).is_ok())
    } else {
        std::str::from_utf8(trimmed)
            .ok()
            .map(str::to_owned)
            .filter(|k| IdempotencyKey::with_limit(k, limit).is_ok())
    };
    match (&got, &expected) {
        (Ok(key), Some(want)) => assert_eq!(key.as_str(), want, "{value:?}"),
        (Err(_), None) => {}
        _ => panic!(
            "parse_key({:?}, {limit}) = {got:?}, the reference says {expected:?}",
            String::from_utf8_lossy(value)
        ),
    }
    if let Ok(key) = got {
        let k = key.as_str();
        let quoted = format!("\"{}\"", k.replace('\\', "\\\\").replace('"', "\\\""));
        assert_eq!(
            parse_key(quoted.as_bytes(), limit).as_ref(),
            Ok(&key),
            "{quoted}"
        );
        let with_params = format!(" {quoted};v=1;x;t=tok/1 ");
        assert_eq!(parse_key(with_params.as_bytes(), limit).as_ref(), Ok(&key));
        if !k.starts_with('"') && !k.contains(' ') {
            assert_eq!(parse_key(k.as_bytes(), limit).as_ref(), Ok(&key), "{k}");
        }
    }
}
