//! Reading AMQP header-table values as ID bytes and counts, and stamping dead-letter headers.

use std::borrow::Cow;

use idem_consumer::DeadLetter;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// The bytes of a header value usable as an ID: strings and byte arrays as they are, integers
/// and booleans in decimal / `true`/`false`. Floats, decimals, timestamps, arrays, tables and
/// void have no canonical text form, so they read as absent rather than as a guess.
pub(crate) fn value_bytes(value: &AMQPValue) -> Option<Cow<'_, [u8]>> {
    let text = match value {
        AMQPValue::LongString(s) => return Some(Cow::Borrowed(s.as_bytes())),
        AMQPValue::ShortString(s) => return Some(Cow::Borrowed(s.as_str().as_bytes())),
        AMQPValue::ByteArray(b) => return Some(Cow::Borrowed(b.as_slice())),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(i) => i.to_string(),
        AMQPValue::ShortShortUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        _ => return None,
    };
    Some(Cow::Owned(text.into_bytes()))
}

/// A non-negative integer header (`x-delivery-count`), whatever width the broker chose.
pub(crate) fn value_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(i) => u64::try_from(*i).ok(),
        AMQPValue::ShortShortUInt(i) => Some(u64::from(*i)),
        AMQPValue::ShortInt(i) => u64::try_from(*i).ok(),
        AMQPValue::ShortUInt(i) => Some(u64::from(*i)),
        AMQPValue::LongInt(i) => u64::try_from(*i).ok(),
        AMQPValue::LongUInt(i) => Some(u64::from(*i)),
        AMQPValue::LongLongInt(i) => u64::try_from(*i).ok(),
        AMQPValue::Timestamp(i) => Some(*i),
        _ => None,
    }
}

/// Looks up `name` in the properties' header table.
pub(crate) fn get<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(name)
}

/// The original properties with the header-table strings and byte arrays an `invalid-id` dead
/// letter cuts short replaced by their cut copies (see [`DeadLetter::forward`]; the
/// `message_id` property, 255 bytes at most, is never cut), and the note naming them.
pub(crate) fn forwarded(
    props: &BasicProperties,
    reason: &DeadLetter,
) -> (BasicProperties, Option<(&'static str, String)>) {
    let Some(table) = props.headers() else {
        return (props.clone(), None);
    };
    let mut cut = Vec::new();
    let mut out = FieldTable::default();
    for (name, value) in table.inner() {
        let value = match value {
            AMQPValue::LongString(s) if reason.cuts(s.as_bytes().len()) => {
                cut.push((name.as_str().to_owned(), s.as_bytes().len()));
                AMQPValue::LongString(LongString::from(reason.forward(s.as_bytes()).as_ref()))
            }
            AMQPValue::ByteArray(b) if reason.cuts(b.as_slice().len()) => {
                cut.push((name.as_str().to_owned(), b.as_slice().len()));
                AMQPValue::ByteArray(reason.forward(b.as_slice()).into_owned().into())
            }
            other => other.clone(),
        };
        out.insert(name.clone(), value);
    }
    if cut.is_empty() {
        return (props.clone(), None);
    }
    (
        props.clone().with_headers(out),
        DeadLetter::truncation_note(&cut),
    )
}

/// The original properties with `extra` added to (or replacing same-named entries in) the
/// header table, and persistent delivery so a dead letter survives a broker restart. The
/// per-message TTL (`expiration`) is not carried over: a dead letter must stay until an
/// operator looks at it, not expire silently in the dead-letter queue.
pub(crate) fn with_extra_headers(
    props: &BasicProperties,
    extra: &[(&'static str, String)],
) -> BasicProperties {
    let mut table = props.headers().clone().unwrap_or_default();
    for (name, value) in extra {
        // idem's header names are short constants; `From<&str>` cannot fail for them.
        table.insert(
            ShortString::from(*name),
            AMQPValue::LongString(LongString::from(value.as_bytes())),
        );
    }
    without_expiration(props)
        .with_headers(table)
        .with_delivery_mode(2)
}

/// A copy of `props` without `expiration` (lapin's builder can set a field but not clear it).
fn without_expiration(props: &BasicProperties) -> BasicProperties {
    let mut out = BasicProperties::default();
    if let Some(v) = props.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = props.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = props.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = props.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = props.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = props.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = props.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = props.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = props.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = props.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = props.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// Every header as lossy UTF-8 text.
#[cfg(test)]
fn to_strings(table: &lapin::types::FieldTable) -> impl Iterator<Item = (String, String)> + '_ {
    table.inner().iter().map(|(k, v)| {
        let text = match value_bytes(v) {
            Some(b) => String::from_utf8_lossy(&b).into_owned(),
            None => format!("{v:?}"),
        };
        (k.as_str().to_owned(), text)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_consumer::DeadLetterReason;

    #[test]
    fn strings_bytes_and_integers_read_as_id_bytes() {
        assert_eq!(
            value_bytes(&AMQPValue::LongString("a-1".into())).as_deref(),
            Some(&b"a-1"[..])
        );
        assert_eq!(
            value_bytes(&AMQPValue::LongLongInt(-42)).as_deref(),
            Some(&b"-42"[..])
        );
        assert_eq!(
            value_bytes(&AMQPValue::ByteArray(vec![0xff, 0].into())).as_deref(),
            Some(&[0xff, 0][..])
        );
        assert_eq!(value_bytes(&AMQPValue::Double(1.5)), None);
        assert_eq!(value_bytes(&AMQPValue::Void), None);
    }

    #[test]
    fn counts_reject_negative_values() {
        assert_eq!(value_u64(&AMQPValue::LongLongInt(3)), Some(3));
        assert_eq!(value_u64(&AMQPValue::LongInt(-1)), None);
        assert_eq!(value_u64(&AMQPValue::LongString("3".into())), None);
    }

    #[test]
    fn dead_letter_properties_drop_the_ttl_and_keep_the_rest() {
        let props = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_expiration("60000".into())
            .with_content_type("application/json".into())
            .with_correlation_id("c-9".into())
            .with_type("PaymentRequested".into())
            .with_priority(5)
            .with_timestamp(1_700_000_000);
        let out = with_extra_headers(&props, &[]);
        assert_eq!(*out.expiration(), None);
        assert_eq!(out.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(
            out.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            out.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c-9")
        );
        assert_eq!(
            out.kind().as_ref().map(|s| s.as_str()),
            Some("PaymentRequested")
        );
        assert_eq!(
            (*out.priority(), *out.timestamp()),
            (Some(5), Some(1_700_000_000))
        );
    }

    #[test]
    fn invalid_id_dead_letters_cut_long_header_values() {
        let mut t = FieldTable::default();
        t.insert("id".into(), AMQPValue::LongString("i".repeat(5000).into()));
        t.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let props = BasicProperties::default().with_headers(t);
        let invalid = DeadLetter::new(DeadLetterReason::InvalidId, "too long");
        let (out, note) = forwarded(&props, &invalid);
        let h: Vec<_> = out.headers().iter().flat_map(to_strings).collect();
        assert!(h.contains(&("id".into(), "i".repeat(DeadLetter::MAX_FORWARDED_ID_VALUE))));
        assert!(h.contains(&("tenant".into(), "acme".into())));
        assert_eq!(
            note,
            Some((DeadLetter::TRUNCATED_HEADER, "id (5000 bytes)".to_owned()))
        );
        let conflict = DeadLetter::new(DeadLetterReason::Conflict, "other payload");
        assert_eq!(forwarded(&props, &conflict), (props.clone(), None));
    }

    #[test]
    fn extra_headers_keep_the_originals_and_make_it_persistent() {
        let mut t = FieldTable::default();
        t.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let props = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(t);
        let out = with_extra_headers(&props, &[("idem-dead-letter-reason", "conflict".into())]);
        assert_eq!(out.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(*out.delivery_mode(), Some(2));
        let h: Vec<_> = out.headers().iter().flat_map(to_strings).collect();
        assert!(h.contains(&("tenant".into(), "acme".into())));
        assert!(h.contains(&("idem-dead-letter-reason".into(), "conflict".into())));
    }
}
