//! `StoredResponse::decode`: the stored response of a completed idempotent request, read back
//! from the store (a shared Redis, a table another service may also write) for a replay.
//!
//! - Any bytes: no panic; a record that decodes re-encodes to bytes that decode to the same
//!   response, and encoding is then a fixed point.
//! - Records written by the documented format (`"IH" 1 | status | flags | count | headers |
//!   body`) from structured input: decoded exactly when every part is valid, to exactly the
//!   headers (names lowercased, order and repeats kept) and body that were written.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use idem_http::record::StoredResponse;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    Raw(&'a [u8]),
    Written {
        status: u16,
        omitted: bool,
        headers: Vec<(&'a [u8], &'a [u8])>,
        body: &'a [u8],
        /// A declared header count above the real one: a record cut short.
        extra_count: u8,
    },
}

fuzz_target!(|input: Input<'_>| {
    match input {
        Input::Raw(bytes) => {
            if let Ok(r) = StoredResponse::decode(Bytes::copy_from_slice(bytes)) {
                round_trips(&r);
            }
        }
        Input::Written {
            status,
            omitted,
            headers,
            body,
            extra_count,
        } => {
            let mut out = b"IH\x01".to_vec();
            out.extend_from_slice(&status.to_be_bytes());
            out.push(u8::from(omitted));
            let count = headers.len() + usize::from(extra_count);
            let Ok(count) = u16::try_from(count) else {
                return;
            };
            out.extend_from_slice(&count.to_be_bytes());
            let mut valid = (100..=999).contains(&status) && extra_count == 0;
            let mut expected = Vec::new();
            for (name, value) in &headers {
                let Ok(name_len) = u16::try_from(name.len()) else {
                    return;
                };
                out.extend_from_slice(&name_len.to_be_bytes());
                out.extend_from_slice(name);
                out.extend_from_slice(&(value.len() as u32).to_be_bytes());
                out.extend_from_slice(value);
                match (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
                    (Ok(n), Ok(v)) => expected.push((n, v)),
                    _ => valid = false,
                }
            }
            out.extend_from_slice(body);
            if omitted && !body.is_empty() {
                valid = false;
            }
            match StoredResponse::decode(Bytes::from(out)) {
                Ok(r) => {
                    assert!(valid, "an invalid record decoded: {r:?}");
                    assert_eq!(r.status.as_u16(), status);
                    let got: Vec<_> = r
                        .headers
                        .iter()
                        .map(|(n, v)| (n.clone(), v.clone()))
                        .collect();
                    // HeaderMap groups repeats of a name at the name's first position.
                    let mut grouped: Vec<(HeaderName, HeaderValue)> = Vec::new();
                    for (n, _) in &expected {
                        if grouped.iter().all(|(g, _)| g != n) {
                            grouped.extend(expected.iter().filter(|(m, _)| m == n).cloned());
                        }
                    }
                    assert_eq!(got, grouped);
                    assert_eq!(r.body.as_deref(), if omitted { None } else { Some(body) });
                    round_trips(&r);
                }
                Err(e) => assert!(!valid, "a valid record was refused: {e}"),
            }
        }
    }
});

#[track_caller]
fn round_trips(r: &StoredResponse) {
    let bytes = r.encode();
    let back =
        StoredResponse::decode(Bytes::from(bytes.clone())).expect("a re-encoded record decodes");
    assert_eq!(&back, r);
    assert_eq!(back.encode(), bytes);
}
