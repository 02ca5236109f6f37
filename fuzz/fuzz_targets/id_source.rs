//! `IdSource::extract`: how a delivery's header, broker ID slot or JSON payload becomes the
//! message ID, and `DeadLetter::headers`, how the reason travels with a dead letter. Run
//! against a fake `Delivery` whose headers, broker ID and payload are fuzz input.
//!
//! - `Header` / `BrokerId`: the ID is exactly the (first) header's or the slot's bytes when
//!   they are non-empty; absent or empty is a `missing-id` dead letter.
//! - `JsonPointer`: the ID is the pointed-to string's bytes, or an integer's decimal digits;
//!   anything else (no JSON, no value, another type, empty) is a `missing-id` dead letter.
//! - Every dead letter's headers are one line each (no control characters) and the detail is
//!   bounded (1024 bytes and an ellipsis), whatever the detail and the consumer name are.
#![no_main]

use std::borrow::Cow;

use arbitrary::Arbitrary;
use idem_consumer::{DeadLetter, DeadLetterReason, Delivery, IdSource};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    source: Source<'a>,
    headers: Vec<(&'a str, &'a [u8])>,
    broker_id: Option<&'a [u8]>,
    payload: Payload<'a>,
    detail: &'a str,
    consumer: &'a str,
    attempts: u32,
}

#[derive(Arbitrary, Debug)]
enum Source<'a> {
    Header(&'a str),
    /// The name of one of the delivery's own headers.
    OwnHeader(u8),
    BrokerId,
    JsonPointer(&'a str),
}

#[derive(Arbitrary, Debug)]
enum Payload<'a> {
    Raw(&'a [u8]),
    /// A JSON object with this ID value at `/meta/<key>`.
    Json {
        key: &'a str,
        id: Id<'a>,
    },
}

#[derive(Arbitrary, Debug)]
enum Id<'a> {
    Str(&'a str),
    I64(i64),
    U64(u64),
    F64(f64),
    Bool(bool),
    Null,
}

#[derive(Debug)]
struct Fake {
    payload: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    broker_id: Option<Vec<u8>>,
}

impl Delivery for Fake {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }

    fn broker_id(&self) -> Option<Cow<'_, [u8]>> {
        self.broker_id.as_deref().map(Cow::Borrowed)
    }

    fn fmt_origin(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("fuzz")
    }

    async fn ack(self) -> Result<(), idem_core::Error> {
        Ok(())
    }

    async fn dead_letter(self, _reason: &DeadLetter) -> Result<(), idem_core::Error> {
        Ok(())
    }
}

fuzz_target!(|input: Input<'_>| {
    let payload = match &input.payload {
        Payload::Raw(b) => b.to_vec(),
        Payload::Json { key, id } => {
            let id = match id {
                Id::Str(s) => serde_json::Value::from(*s),
                Id::I64(n) => serde_json::Value::from(*n),
                Id::U64(n) => serde_json::Value::from(*n),
                Id::F64(f) => serde_json::Value::from(*f),
                Id::Bool(b) => serde_json::Value::from(*b),
                Id::Null => serde_json::Value::Null,
            };
            serde_json::json!({ "meta": { *key: id } })
                .to_string()
                .into_bytes()
        }
    };
    let delivery = Fake {
        payload,
        headers: input
            .headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
            .collect(),
        broker_id: input.broker_id.map(<[u8]>::to_vec),
    };
    let source = match &input.source {
        Source::Header(name) => IdSource::header(*name),
        Source::OwnHeader(i) => match input.headers.get(usize::from(*i)) {
            Some((name, _)) => IdSource::header(*name),
            None => IdSource::header("message-id"),
        },
        Source::BrokerId => IdSource::BrokerId,
        Source::JsonPointer(p) => IdSource::json_pointer(*p),
    };
    let pointer_target = match (&input.payload, &input.source) {
        (Payload::Json { key, .. }, Source::OwnHeader(0)) => Some(format!(
            "/meta/{}",
            key.replace('~', "~0").replace('/', "~1")
        )),
        _ => None,
    };
    check(&source, &delivery);
    // Aim a JSON pointer at the value the payload holds, so the typed paths are reached.
    if let Some(p) = pointer_target {
        check(&IdSource::json_pointer(p), &delivery);
    }

    let reason = [
        DeadLetterReason::MissingId,
        DeadLetterReason::InvalidId,
        DeadLetterReason::Undecodable,
        DeadLetterReason::Conflict,
        DeadLetterReason::Rejected,
        DeadLetterReason::RetriesExhausted,
    ][input.attempts as usize % 6];
    let dl = DeadLetter::new(reason, input.detail).with_context(input.consumer, input.attempts);
    assert_eq!(dl.reason(), reason);
    assert_eq!(dl.detail(), input.detail);
    check_headers(&dl);
});

#[track_caller]
fn check(source: &IdSource, delivery: &Fake) {
    let expected: Option<Vec<u8>> = match source {
        IdSource::Header(name) => delivery.header(name).map(Cow::into_owned),
        IdSource::BrokerId => delivery.broker_id.clone(),
        IdSource::JsonPointer(p) => serde_json::from_slice::<serde_json::Value>(&delivery.payload)
            .ok()
            .and_then(|v| match v.pointer(p) {
                Some(serde_json::Value::String(s)) => Some(s.clone().into_bytes()),
                Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                    Some(n.to_string().into_bytes())
                }
                _ => None,
            }),
        _ => None,
    }
    .filter(|id| !id.is_empty());
    match source.extract(delivery) {
        Ok(id) => {
            assert_eq!(Some(id.as_ref()), expected.as_deref(), "{source:?}");
            if let IdSource::JsonPointer(_) = source {
                let text = std::str::from_utf8(&id).expect("a JSON ID is text");
                assert!(!text.is_empty());
            }
        }
        Err(dl) => {
            assert_eq!(expected, None, "{source:?} refused: {dl}");
            assert_eq!(dl.reason(), DeadLetterReason::MissingId);
            check_headers(&dl);
        }
    }
}

#[track_caller]
fn check_headers(dl: &DeadLetter) {
    for (name, value) in dl.headers() {
        assert!(
            !value.chars().any(char::is_control),
            "dead-letter header {name} is not one line: {value:?}"
        );
        if name == idem_consumer::DETAIL_HEADER {
            assert!(
                value.len() <= 1024 + '…'.len_utf8(),
                "{} bytes",
                value.len()
            );
        }
    }
}
