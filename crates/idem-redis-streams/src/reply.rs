//! Decoding of stream replies (`XREADGROUP`, `XAUTOCLAIM`, `XPENDING`) from raw [`Value`]s.
//!
//! Parsed by hand rather than through the client's typed replies so that field names and values
//! stay bytes (a payload need not be UTF-8), field order is kept, and an entry whose body was
//! deleted (a `nil` in place of its fields) is visible instead of silently skipped. Both RESP2
//! arrays and RESP3 maps are accepted.

use idem_core::{Error, ErrorKind};
use redis::Value;

/// Field name and value, as bytes.
pub(crate) type Field = (Vec<u8>, Vec<u8>);

/// One stream entry as returned by the server.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) id: String,
    /// `None` when the entry is still pending but was deleted from the stream (`XDEL`, trimming).
    pub(crate) fields: Option<Vec<Field>>,
}

fn malformed(what: &str, value: &Value) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("unexpected reply from Redis to {what}: {value:?}"),
    )
}

fn bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::VerbatimString { text, .. } => Some(text.into_bytes()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        Value::Okay => Some(b"OK".to_vec()),
        _ => None,
    }
}

fn string(what: &str, value: Value) -> Result<String, Error> {
    match bytes(value) {
        Some(b) => String::from_utf8(b).map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("non-UTF-8 {what} in a Redis reply"),
            )
            .with_source(e)
        }),
        None => Err(Error::new(
            ErrorKind::Unavailable,
            format!("unexpected reply from Redis: {what} is not a string"),
        )),
    }
}

/// A list reply as items; RESP3 sets and maps are flattened the way RESP2 sends them.
fn items(what: &str, value: Value) -> Result<Vec<Value>, Error> {
    match value {
        Value::Array(v) | Value::Set(v) => Ok(v),
        Value::Map(pairs) => Ok(pairs.into_iter().flat_map(|(k, v)| [k, v]).collect()),
        Value::Nil => Ok(Vec::new()),
        other => Err(malformed(what, &other)),
    }
}

fn fields(value: Value) -> Result<Option<Vec<Field>>, Error> {
    if value == Value::Nil {
        return Ok(None);
    }
    let flat = items("stream entry fields", value)?;
    if flat.len() % 2 != 0 {
        // A name without its value is a damaged reply, not one field fewer: dropped, it
        // could be the ID field itself (found by fuzz/redis_stream_reply).
        return Err(Error::new(
            ErrorKind::Unavailable,
            "unexpected reply from Redis: a stream field has no value",
        ));
    }
    let mut out = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        match (bytes(k), bytes(v)) {
            (Some(k), Some(v)) => out.push((k, v)),
            _ => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "unexpected reply from Redis: a stream field is not a string",
                ));
            }
        }
    }
    Ok(Some(out))
}

/// `[[id, [field, value, …] | nil], …]`.
pub(crate) fn entries(value: Value) -> Result<Vec<Entry>, Error> {
    items("stream entries", value)?
        .into_iter()
        .map(|entry| {
            let mut parts = items("stream entry", entry)?.into_iter();
            let id = string("entry ID", parts.next().unwrap_or(Value::Nil))?;
            let fields = fields(parts.next().unwrap_or(Value::Nil))?;
            Ok(Entry { id, fields })
        })
        .collect()
}

/// `XREADGROUP` on one stream: `nil` (timeout) or `[[stream, entries]]` / `{stream: entries}`.
pub(crate) fn read_group(value: Value) -> Result<Vec<Entry>, Error> {
    let mut flat = items("XREADGROUP", value)?.into_iter();
    let mut out = Vec::new();
    // RESP2: each item is [stream, entries]; RESP3 (flattened map): stream, entries, ….
    while let Some(item) = flat.next() {
        match item {
            Value::Array(pair) => {
                let mut pair = pair.into_iter();
                let _stream = pair.next();
                out.extend(entries(pair.next().unwrap_or(Value::Nil))?);
            }
            _ => out.extend(entries(flat.next().unwrap_or(Value::Nil))?),
        }
    }
    Ok(out)
}

/// What one `XAUTOCLAIM` call returned.
#[derive(Debug)]
pub(crate) struct AutoClaim {
    /// Where the next call continues; `0-0` once the whole pending list was scanned.
    pub(crate) cursor: String,
    pub(crate) claimed: Vec<Entry>,
    /// Pending IDs whose entries no longer exist; Redis 7 drops them from the pending list.
    pub(crate) deleted: Vec<String>,
}

/// `[cursor, entries]` (Redis 6.2) or `[cursor, entries, deleted IDs]` (Redis 7).
pub(crate) fn auto_claim(value: Value) -> Result<AutoClaim, Error> {
    let mut parts = items("XAUTOCLAIM", value)?.into_iter();
    let cursor = string("XAUTOCLAIM cursor", parts.next().unwrap_or(Value::Nil))?;
    let claimed = entries(parts.next().unwrap_or(Value::Nil))?;
    let deleted = match parts.next() {
        Some(v) => items("XAUTOCLAIM deleted IDs", v)?
            .into_iter()
            .map(|id| string("deleted entry ID", id))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    Ok(AutoClaim {
        cursor,
        claimed,
        deleted,
    })
}

/// The times-delivered counter from `XPENDING key group id id 1`: `[[id, consumer, idle, count]]`,
/// or `None` when the entry is no longer pending (someone acknowledged it meanwhile).
pub(crate) fn times_delivered(value: Value) -> Result<Option<u64>, Error> {
    let Some(row) = items("XPENDING", value)?.into_iter().next() else {
        return Ok(None);
    };
    let count = items("XPENDING row", row)?.into_iter().nth(3);
    match count {
        Some(Value::Int(n)) => Ok(Some(u64::try_from(n).unwrap_or(0))),
        Some(other) => Err(malformed("XPENDING", &other)),
        None => Err(malformed("XPENDING", &Value::Nil)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn parses_read_group_in_resp2_and_resp3_shapes() {
        let entries_v = Value::Array(vec![
            Value::Array(vec![
                b("1-0"),
                Value::Array(vec![b("payload"), b("x"), b("k"), b("v")]),
            ]),
            Value::Array(vec![b("2-0"), Value::Nil]),
        ]);
        let resp2 = Value::Array(vec![Value::Array(vec![b("s"), entries_v.clone()])]);
        let resp3 = Value::Map(vec![(b("s"), entries_v)]);
        for v in [resp2, resp3] {
            let e = read_group(v).unwrap();
            assert_eq!(e.len(), 2);
            assert_eq!(e[0].id, "1-0");
            assert_eq!(
                e[0].fields.as_deref(),
                Some(
                    &[
                        (b"payload".to_vec(), b"x".to_vec()),
                        (b"k".to_vec(), b"v".to_vec())
                    ][..]
                )
            );
            assert!(e[1].fields.is_none());
        }
        assert!(read_group(Value::Nil).unwrap().is_empty());
    }

    #[test]
    fn parses_auto_claim_with_and_without_deleted_ids() {
        let v = Value::Array(vec![
            b("0-0"),
            Value::Array(vec![]),
            Value::Array(vec![b("3-0")]),
        ]);
        let c = auto_claim(v).unwrap();
        assert_eq!(c.cursor, "0-0");
        assert_eq!(c.deleted, vec!["3-0".to_owned()]);
        let c = auto_claim(Value::Array(vec![b("5-0"), Value::Array(vec![])])).unwrap();
        assert_eq!(c.cursor, "5-0");
        assert!(c.deleted.is_empty());
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        assert!(read_group(Value::Int(3)).is_err());
        assert!(entries(Value::Array(vec![Value::Array(vec![Value::Double(1.0)])])).is_err());
        assert!(times_delivered(Value::Array(vec![Value::Array(vec![b("1-0")])])).is_err());
        assert_eq!(times_delivered(Value::Array(vec![])).unwrap(), None);
        // A field name without its value.
        assert!(
            entries(Value::Array(vec![Value::Array(vec![
                b("1-0"),
                Value::Array(vec![b("payload"), b("x"), b("message_id")]),
            ])]))
            .is_err()
        );
    }
}
