//! The Lua scripts that read and change a record, and the decoding of their replies.
//!
//! Every script gets the record's three keys (`rec`, `lease`, `fence`, see [`crate::keys`])
//! and runs atomically on the server, so a check of the fencing token and the change it guards
//! cannot be interleaved with another executor's. Each is sent as `EVALSHA`; on `NOSCRIPT` (a
//! restarted or flushed server) the client loads it with `SCRIPT LOAD` and sends it again.
//!
//! Values that Lua would have to turn from numbers into strings (fences, milliseconds) stay
//! strings end to end: Redis formats Lua numbers as floats, and a 16-digit fence would lose
//! its last digits.

use std::sync::LazyLock;
use std::time::Duration;

use idem_core::{Begin, Error, Fence};
use redis::{Script, Value};

use crate::error::unexpected;

/// Looks the record up and takes it if it is free: one round trip for every answer.
///
/// ARGV: fingerprint (32 raw bytes), lease in ms, how long an in-progress record lives in ms
/// (`max(lease, TTL)`).
///
/// Replies: `{'mismatch'}`, `{'done', result}`, `{'busy', lease PTTL}`, or
/// `{'new' | 'takeover', fence}`.
///
/// A new fence is the counter plus one; without a counter (a record never seen, or expired
/// with its counter) it starts at the server's clock in microseconds, so a stalled executor of
/// an expired record can never hold the same fence as the record's successor.
pub(crate) static BEGIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fp, state = unpack(redis.call('HMGET', KEYS[1], 'fp', 'state'))
if fp then
  if fp ~= ARGV[1] then return {'mismatch'} end
  if state == 'done' then return {'done', redis.call('HGET', KEYS[1], 'result')} end
end
local left = redis.call('PTTL', KEYS[2])
if left ~= -2 then return {'busy', left} end
local fence
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('INCR', KEYS[3])
  fence = redis.call('GET', KEYS[3])
else
  local now = redis.call('TIME')
  fence = now[1] .. string.format('%06d', tonumber(now[2]))
  redis.call('SET', KEYS[3], fence)
end
if not redis.call('SET', KEYS[2], fence, 'NX', 'PX', ARGV[2]) then
  return {'busy', redis.call('PTTL', KEYS[2])}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'state', 'run', 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
if fp then return {'takeover', fence} end
return {'new', fence}
",
    )
});

/// Stores the result if the fence still holds the record in progress. ARGV: fence, result,
/// TTL in ms. Replies 1, or 0 when the fence no longer holds it.
///
/// The fence is checked against the record, not the lease key: a lease that ran out without
/// anybody taking the record over still leaves the holder the only executor that ran it.
pub(crate) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local state, fence = unpack(redis.call('HMGET', KEYS[1], 'state', 'fence'))
if state ~= 'run' or fence ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2])
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return 1
",
    )
});

/// Deletes the record and its lease if the fence holds it in progress; the counter stays, so
/// the next holder's fence is larger. ARGV: fence. Replies 1, or 0.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local state, fence = unpack(redis.call('HMGET', KEYS[1], 'state', 'fence'))
if state ~= 'run' or fence ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
",
    )
});

/// Sets the lease to ARGV[2] ms from now if the fence ARGV[1] holds the record in progress,
/// and keeps the record (and its counter) alive at least that long. Replies 1, or 0.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local state, fence = unpack(redis.call('HMGET', KEYS[1], 'state', 'fence'))
if state ~= 'run' or fence ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
for i = 1, 3, 2 do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  end
end
return 1
",
    )
});

/// Milliseconds for `PX` / `PEXPIRE`: rounded up (a lease is never shorter than asked), at
/// least 1, and at most 2^53 so that neither Lua's `tonumber` nor the server's expiry
/// arithmetic can overflow.
pub(crate) fn millis(d: Duration) -> u64 {
    const MAX: u128 = 1 << 53;
    let ms = d.as_nanos().div_ceil(1_000_000).clamp(1, MAX);
    u64::try_from(ms).unwrap_or(1 << 53)
}

fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

/// Decodes [`BEGIN`]'s reply.
pub(crate) fn decode_begin(reply: Value) -> Result<Begin, Error> {
    let Value::Array(items) = reply else {
        return Err(unexpected("the begin script", &reply));
    };
    let mut it = items.into_iter();
    let tag = it.next().and_then(bytes);
    let value = it.next();
    let begin = match (tag.as_deref(), value) {
        (Some(b"mismatch"), None) => Begin::Mismatch,
        (Some(b"done"), Some(Value::BulkString(result))) => Begin::Completed { result },
        (Some(b"busy"), Some(Value::Int(left))) => {
            // -1: a lease without expiry, which this crate never writes; say "soon".
            let left = u64::try_from(left).unwrap_or(0);
            Begin::InProgress {
                retry_after: idem_core::retry_after(Duration::from_millis(left)),
            }
        }
        (Some(tag @ (b"new" | b"takeover")), Some(fence)) => {
            let fence = bytes(fence.clone())
                .and_then(|f| String::from_utf8(f).ok())
                .and_then(|f| f.parse::<u64>().ok())
                .ok_or_else(|| unexpected("the begin script (fence)", &fence))?;
            Begin::Acquired {
                fence: Fence(fence),
                takeover: tag == b"takeover",
            }
        }
        (tag, value) => {
            let shown = Value::Array(
                tag.map(|t| Value::BulkString(t.to_vec()))
                    .into_iter()
                    .chain(value)
                    .collect(),
            );
            return Err(unexpected("the begin script", &shown));
        }
    };
    Ok(begin)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Value {
        Value::BulkString(v.as_bytes().to_vec())
    }

    #[test]
    fn decodes_every_answer_of_begin() {
        assert_eq!(
            decode_begin(Value::Array(vec![s("mismatch")])).unwrap(),
            Begin::Mismatch
        );
        assert_eq!(
            decode_begin(Value::Array(vec![s("done"), s("")])).unwrap(),
            Begin::Completed { result: vec![] }
        );
        assert_eq!(
            decode_begin(Value::Array(vec![s("busy"), Value::Int(1500)])).unwrap(),
            Begin::InProgress {
                retry_after: Duration::from_secs(2)
            }
        );
        assert_eq!(
            decode_begin(Value::Array(vec![s("busy"), Value::Int(-1)])).unwrap(),
            Begin::InProgress {
                retry_after: Duration::from_secs(1)
            }
        );
        assert_eq!(
            decode_begin(Value::Array(vec![s("takeover"), s("1718000000123457")])).unwrap(),
            Begin::Acquired {
                fence: Fence(1_718_000_000_123_457),
                takeover: true
            }
        );
        assert_eq!(
            decode_begin(Value::Array(vec![s("new"), s("7")])).unwrap(),
            Begin::Acquired {
                fence: Fence(7),
                takeover: false
            }
        );
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        for bad in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![s("done"), Value::Nil]),
            Value::Array(vec![s("new"), s("-3")]),
            Value::Array(vec![s("later")]),
        ] {
            assert!(decode_begin(bad.clone()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn millis_round_up_and_stay_in_range() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(1500)), 2);
        assert_eq!(millis(Duration::from_secs(30)), 30_000);
        assert_eq!(millis(Duration::MAX), 1 << 53);
    }
}
