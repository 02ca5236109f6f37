//! The Lua scripts that read and change a record, and the decoding of their replies.
//!
//! A record is **one string key** (see [`crate::keys`]) whose value says everything about it:
//!
//! | state | value |
//! |---|---|
//! | in progress | `r` · fingerprint (32 bytes) · lease deadline (server ms, decimal) · `:` · fence (decimal) |
//! | completed | `d` · fingerprint (32 bytes) · result |
//!
//! One key, so that every operation reads it with one `GET` and writes it with one `SET … PX`
//! (value and expiry together): a take runs `GET`, `TIME`, `SET`; a completion `GET`, `SET`; a
//! replay `GET` alone. The lease is the deadline inside the value, compared with the server's
//! `TIME`, rather than a key of its own with a `PX`: a second key would cost a command on
//! every take and every completion. Every script runs atomically on the server, so a check of
//! the fencing token and the change it guards cannot be interleaved with another executor's.
//! Each is sent as `EVALSHA`; on `NOSCRIPT` (a restarted or flushed server) the client loads
//! it with `SCRIPT LOAD` and sends it again.
//!
//! **Records of earlier versions** (before 2026-12) were a hash with a lease key and a fence
//! counter beside it, under the same record name. `GET` on such a hash fails with
//! `WRONGTYPE`; the begin script catches that (`redis.pcall`) and reads the hash instead: a
//! completed one replays, a running one answers "in progress" while its lease key lives, and
//! a lapsed one is taken over into the new form with the counter + 1, its two side keys
//! deleted. The other scripts answer "not held" for a hash: only the begin script of this
//! version hands out fences, always in the new form. The other way round, an earlier
//! version's scripts fail with `WRONGTYPE` on a new record (an error, never a second run), so
//! during a rolling upgrade the old processes answer errors for keys the new ones hold.
//!
//! Fences stay strings end to end where Lua would format a number as a float; where Lua adds
//! one (a takeover) it formats it with `%.0f`, exact for every integer below 2^53 (a fence
//! from the server's clock in microseconds is about 2^50).

use std::sync::LazyLock;
use std::time::Duration;

use idem_core::{Begin, Error, Fence};
use redis::{Script, Value};

use crate::error::unexpected;

/// Lua shared by every script: `get` (the record's value, `false` when absent, `nil, true`
/// for a record of the earlier hash form) and the parts of an in-progress value.
const PRELUDE: &str = r"
local function get(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    if string.find(v.err, 'WRONGTYPE', 1, true) then return nil, true end
    error(v)
  end
  return v, false
end
-- An in-progress value: its lease deadline (server ms) and its fence (a string), or nil.
local function running(v)
  if not v or string.sub(v, 1, 1) ~= 'r' then return nil end
  local sep = string.find(v, ':', 34, true)
  if not sep then return nil end
  return tonumber(string.sub(v, 34, sep - 1)), string.sub(v, sep + 1)
end
local function now_ms(t)
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function bump(fence)
  return string.format('%.0f', tonumber(fence) + 1)
end
";

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{body}"))
}

/// Looks the record up and takes it if it is free: one round trip for every answer.
///
/// KEYS: the record, and the lease and fence keys of an earlier version's record (read and
/// deleted only when the record is one). ARGV: fingerprint (32 raw bytes), lease in ms, how
/// long an in-progress record lives in ms (`max(lease, TTL)`).
///
/// Replies: `{'mismatch'}`, `{'done', result}`, `{'busy', ms left on the lease}`, or
/// `{'new' | 'takeover', fence}`. Commands it runs: a replay or a mismatch `GET`; a take
/// `GET`, `TIME`, `SET`; in progress `GET`, `TIME`.
///
/// A takeover's fence is the holder's plus one. A new record's (never seen, expired, or
/// released) starts at the server's clock in microseconds: every fence of an earlier record
/// of the key started at that clock earlier and grew by one per takeover, each at least a
/// lease (10 ms) later, so a stalled or finished executor of an earlier record never holds
/// the same fence as its successor.
pub(crate) static BEGIN: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local v, legacy = get(KEYS[1])
local fence, tag
if legacy then
  local fp, state = unpack(redis.call('HMGET', KEYS[1], 'fp', 'state'))
  if fp and fp ~= ARGV[1] then return {'mismatch'} end
  if fp and state == 'done' then return {'done', redis.call('HGET', KEYS[1], 'result')} end
  local left = redis.call('PTTL', KEYS[2])
  if left ~= -2 then return {'busy', left} end
  local counter = redis.call('GET', KEYS[3])
  if counter then fence = bump(counter) end
  if fp then tag = 'takeover' end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
elseif v then
  local state = string.sub(v, 1, 1)
  if state ~= 'r' and state ~= 'd' then
    return redis.error_reply('idem: not a record of this store: ' .. KEYS[1])
  end
  if string.sub(v, 2, 33) ~= ARGV[1] then return {'mismatch'} end
  if state == 'd' then return {'done', string.sub(v, 34)} end
end
local t = redis.call('TIME')
local now = now_ms(t)
if v then
  local deadline, holder = running(v)
  if not deadline then return redis.error_reply('idem: not a record of this store: ' .. KEYS[1]) end
  if deadline > now then return {'busy', deadline - now} end
  fence, tag = bump(holder), 'takeover'
end
if not fence then fence = t[1] .. string.format('%06d', tonumber(t[2])) end
local deadline = string.format('%.0f', now + tonumber(ARGV[2]))
redis.call('SET', KEYS[1], 'r' .. ARGV[1] .. deadline .. ':' .. fence, 'PX', ARGV[3])
return {tag or 'new', fence}
",
    )
});

/// Stores the result if the fence still holds the record in progress. KEYS: the record.
/// ARGV: fence, result, TTL in ms. Replies 1, or 0 when the fence no longer holds it.
/// Commands: `GET`, `SET`.
///
/// The fence is checked against the record, not the lease deadline: a lease that ran out
/// without anybody taking the record over still leaves the holder the only executor that ran
/// it.
pub(crate) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local v = get(KEYS[1])
local _, fence = running(v)
if fence ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], 'd' .. string.sub(v, 2, 33) .. ARGV[2], 'PX', ARGV[3])
return 1
",
    )
});

/// Deletes the record if the fence holds it in progress. KEYS: the record. ARGV: fence.
/// Replies 1, or 0. The next take's fence starts at the server's clock (see [`BEGIN`]).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local v = get(KEYS[1])
local _, fence = running(v)
if fence ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
",
    )
});

/// Moves the lease deadline to ARGV[2] ms from now if the fence ARGV[1] holds the record in
/// progress, and keeps the record alive at least that long. KEYS: the record. Replies 1, or 0.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local v = get(KEYS[1])
local _, fence = running(v)
if fence ~= ARGV[1] then return 0 end
local now = now_ms(redis.call('TIME'))
local keep = string.format('%.0f', math.max(redis.call('PTTL', KEYS[1]), tonumber(ARGV[2])))
local deadline = string.format('%.0f', now + tonumber(ARGV[2]))
redis.call('SET', KEYS[1], 'r' .. string.sub(v, 2, 33) .. deadline .. ':' .. fence, 'PX', keep)
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
