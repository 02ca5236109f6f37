//! The Redis Streams adapter's reply decoders (`XREADGROUP`, `XAUTOCLAIM`, `XPENDING`): how
//! the server's entries become deliveries, their fields the headers an ID is read from.
//!
//! - Any RESP bytes the client parses: every decoder returns, value or error, without a panic.
//! - Replies written as the server writes them, from structured entries (RESP2 arrays or a
//!   RESP3 map, bulk or simple strings, deleted entries as nil): decoded to exactly those
//!   IDs and fields, in order; an entry with a field name and no value is an error, not a
//!   silently dropped field.
#![no_main]

use arbitrary::Arbitrary;
use idem_redis_streams::fuzzing::{Entry, auto_claim, read_group, times_delivered};
use libfuzzer_sys::fuzz_target;
use redis::Value;

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    Resp(&'a [u8]),
    Written {
        resp3: bool,
        simple_ids: bool,
        entries: Vec<(u64, u64, Option<Vec<(&'a [u8], &'a [u8])>>)>,
        /// An entry (by index) whose last field lost its value.
        dangling: Option<u8>,
        cursor: (u64, u64),
        deleted: Vec<(u64, u64)>,
        pending: Option<i64>,
    },
}

fn bulk(b: &[u8]) -> Value {
    Value::BulkString(b.to_vec())
}

fn id(ms: u64, seq: u64) -> String {
    format!("{ms}-{seq}")
}

fn id_value(simple: bool, s: String) -> Value {
    if simple {
        Value::SimpleString(s)
    } else {
        bulk(s.as_bytes())
    }
}

fuzz_target!(|input: Input<'_>| match input {
    Input::Resp(bytes) => {
        if let Ok(v) = redis::parse_redis_value(bytes) {
            let _ = read_group(v.clone());
            let _ = auto_claim(v.clone());
            let _ = times_delivered(v.clone());
            let _ = read_group(Value::Array(vec![Value::Array(vec![bulk(b"s"), v])]));
        }
    }
    Input::Written {
        resp3,
        simple_ids,
        entries,
        dangling,
        cursor,
        deleted,
        pending,
    } => {
        let mut expected: Vec<Entry> = Vec::new();
        let mut values = Vec::new();
        let dangling = dangling.map(usize::from).filter(|i| {
            entries
                .get(*i)
                .is_some_and(|(_, _, f)| f.as_ref().is_some_and(|f| !f.is_empty()))
        });
        for (i, (ms, seq, fields)) in entries.iter().enumerate() {
            let fields_value = match fields {
                None => Value::Nil,
                Some(fields) => {
                    let mut flat: Vec<Value> = fields
                        .iter()
                        .flat_map(|(k, v)| [bulk(k), bulk(v)])
                        .collect();
                    if dangling == Some(i) {
                        flat.pop();
                    }
                    Value::Array(flat)
                }
            };
            values.push(Value::Array(vec![
                id_value(simple_ids, id(*ms, *seq)),
                fields_value,
            ]));
            expected.push((
                id(*ms, *seq),
                fields
                    .as_ref()
                    .map(|f| f.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()),
            ));
        }
        let entries_value = Value::Array(values);
        let reply = if resp3 {
            Value::Map(vec![(bulk(b"orders"), entries_value.clone())])
        } else {
            Value::Array(vec![Value::Array(vec![
                bulk(b"orders"),
                entries_value.clone(),
            ])])
        };
        let decoded = read_group(reply);
        if dangling.is_some() {
            assert!(
                decoded.is_err(),
                "a field without a value was accepted: {decoded:?}"
            );
        } else {
            assert_eq!(decoded.expect("a well-formed XREADGROUP reply"), expected);
        }

        let deleted_ids: Vec<String> = deleted.iter().map(|(m, s)| id(*m, *s)).collect();
        let claim = Value::Array(vec![
            id_value(simple_ids, id(cursor.0, cursor.1)),
            entries_value,
            Value::Array(deleted_ids.iter().map(|d| bulk(d.as_bytes())).collect()),
        ]);
        match auto_claim(claim) {
            Ok((c, claimed, gone)) => {
                assert!(dangling.is_none(), "a field without a value was accepted");
                assert_eq!(c, id(cursor.0, cursor.1));
                assert_eq!(claimed, expected);
                assert_eq!(gone, deleted_ids);
            }
            Err(e) => assert!(dangling.is_some(), "a well-formed XAUTOCLAIM reply: {e}"),
        }

        let rows = match pending {
            Some(n) => vec![Value::Array(vec![
                bulk(b"1-0"),
                bulk(b"consumer-1"),
                Value::Int(1000),
                Value::Int(n),
            ])],
            None => vec![],
        };
        let count = times_delivered(Value::Array(rows)).expect("a well-formed XPENDING reply");
        assert_eq!(count, pending.map(|n| u64::try_from(n).unwrap_or(0)));
    }
});
