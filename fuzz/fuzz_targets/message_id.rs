//! The identities built from broker and store bytes: `MessageId::new` / `with_limit`,
//! `ConsumerName::new`, `Fingerprint::from_slice`, `RequestScope::from_slice`, and the
//! `DerivedKey` built from them.
//!
//! - A message ID is accepted exactly when it is 1 to `limit` bytes; an accepted one keeps its
//!   bytes, and its `Display` is the text itself or `0x` + hex of exactly those bytes.
//! - A consumer name is accepted exactly when it is 1 to 100 bytes of visible ASCII.
//! - A stored digest is read back exactly when it is 32 bytes, unchanged.
//! - A derived key is deterministic and its message ID and UUID form are well-formed.
#![no_main]

use arbitrary::Arbitrary;
use idem_core::{
    ConsumerName, DEFAULT_MAX_ID_LEN, DerivedKey, ErrorKind, Fingerprint, MAX_CONSUMER_NAME_LEN,
    MessageId, RequestScope,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    limit: u16,
    bytes: &'a [u8],
    consumer: &'a str,
    step: &'a str,
}

fuzz_target!(|input: Input<'_>| {
    let bytes = input.bytes;
    let limit = usize::from(input.limit);
    let id = check_id(MessageId::with_limit(bytes, limit), bytes, limit);
    let default = check_id(MessageId::new(bytes), bytes, DEFAULT_MAX_ID_LEN);

    let name = input.consumer;
    let consumer = match ConsumerName::new(name) {
        Ok(c) => {
            assert!(
                (1..=MAX_CONSUMER_NAME_LEN).contains(&name.len()),
                "{name:?}"
            );
            assert!(name.bytes().all(|b| b.is_ascii_graphic()), "{name:?}");
            assert_eq!(c.as_str(), name);
            assert_eq!(c.to_string(), name);
            Some(c)
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::InvalidConfig);
            assert!(
                name.is_empty()
                    || name.len() > MAX_CONSUMER_NAME_LEN
                    || !name.bytes().all(|b| b.is_ascii_graphic()),
                "{name:?} refused: {e}"
            );
            None
        }
    };

    match Fingerprint::from_slice(bytes) {
        Some(f) => assert_eq!(f.as_bytes().as_slice(), bytes),
        None => assert_ne!(bytes.len(), 32),
    }
    match RequestScope::from_slice(bytes) {
        Some(s) => {
            assert_eq!(s.as_bytes().as_slice(), bytes);
            let hex = s.to_hex();
            assert_eq!(hex.len(), 64);
            assert_eq!(decode_hex(&hex).as_deref(), Some(bytes));
        }
        None => assert_ne!(bytes.len(), 32),
    }

    if let (Some(consumer), Some(id)) = (consumer, id.or(default)) {
        let key = DerivedKey::new(&consumer, &id, input.step);
        assert_eq!(key, DerivedKey::new(&consumer, &id, input.step));
        let uuid = key.to_uuid_string();
        let groups: Vec<usize> = uuid.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "{uuid}");
        assert!(
            uuid.bytes()
                .all(|b| b == b'-' || matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        );
        assert_eq!(&uuid[14..15], "8", "version 8: {uuid}");
        assert!(
            matches!(&uuid[19..20], "8" | "9" | "a" | "b"),
            "variant: {uuid}"
        );
        let as_id = key.to_message_id();
        assert_eq!(as_id.as_bytes(), uuid.as_bytes());
        assert_eq!(MessageId::new(as_id.as_bytes()).ok(), Some(as_id));
    }
});

#[track_caller]
fn check_id(
    result: Result<MessageId, idem_core::Error>,
    bytes: &[u8],
    limit: usize,
) -> Option<MessageId> {
    let fits = !bytes.is_empty() && bytes.len() <= limit;
    match result {
        Ok(id) => {
            assert!(
                fits,
                "{} bytes accepted under a limit of {limit}",
                bytes.len()
            );
            assert_eq!(id.as_bytes(), bytes);
            assert_eq!(id.as_ref(), bytes);
            assert_eq!(id.len(), bytes.len());
            let shown = id.to_string();
            assert_eq!(format!("{id:?}"), format!("MessageId({shown})"));
            match std::str::from_utf8(bytes) {
                Ok(text) if !text.chars().any(char::is_control) => assert_eq!(shown, text),
                _ => {
                    let hex = shown.strip_prefix("0x").expect("binary IDs show as 0x…");
                    assert_eq!(decode_hex(hex).as_deref(), Some(bytes), "{shown}");
                }
            }
            Some(id)
        }
        Err(e) => {
            assert!(
                !fits,
                "{} bytes refused under a limit of {limit}: {e}",
                bytes.len()
            );
            assert_eq!(e.kind(), ErrorKind::InvalidMessageId);
            None
        }
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}
