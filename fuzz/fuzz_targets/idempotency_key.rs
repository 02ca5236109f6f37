//! `IdempotencyKey::new` / `with_limit`: the client's key, whatever transport brought it.
//!
//! A key is accepted exactly when it is 1 to `limit` bytes of visible ASCII (`!` to `~`); an
//! accepted key is the input unchanged, and accepting is stable (the key validates again).
#![no_main]

use arbitrary::Arbitrary;
use idem_core::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN, RequestErrorKind};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    limit: u16,
    key: &'a str,
}

fuzz_target!(|input: Input<'_>| {
    check(input.key, usize::from(input.limit));
    check(input.key, MAX_IDEMPOTENCY_KEY_LEN);
});

#[track_caller]
fn check(key: &str, limit: usize) {
    let valid = !key.is_empty() && key.len() <= limit && key.bytes().all(|b| b.is_ascii_graphic());
    let result = if limit == MAX_IDEMPOTENCY_KEY_LEN {
        IdempotencyKey::new(key)
    } else {
        IdempotencyKey::with_limit(key, limit)
    };
    match result {
        Ok(k) => {
            assert!(valid, "{key:?} accepted under a limit of {limit}");
            assert_eq!(k.as_str(), key);
            assert_eq!(k.to_string(), key);
            assert_eq!(IdempotencyKey::with_limit(k.as_str(), limit).ok(), Some(k));
        }
        Err(e) => {
            assert!(!valid, "{key:?} refused under a limit of {limit}: {e}");
            assert_eq!(e.request_kind(), Some(RequestErrorKind::InvalidKey));
        }
    }
}
