//! What can make Redis drop a record that idem still needs, and the store's defences: the
//! `maxmemory-policy` check at connect, and waiting for replicas (`WAIT`) after a take and a
//! completion. The crate docs (*Losing records*) say what each risk means for a request.

use std::time::Duration;

use idem_core::{Error, ErrorKind};
use redis::Value;
use redis::aio::ConnectionLike;

use crate::error::{SYSTEM, kind_of};

/// The one `maxmemory-policy` under which Redis never evicts a key idem wrote.
pub(crate) const SAFE_POLICY: &str = "noeviction";

/// How many replicas must acknowledge a take or a completion, and how long to wait for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaWait {
    pub(crate) replicas: usize,
    pub(crate) timeout: Duration,
}

impl ReplicaWait {
    /// `WAIT 0` waits for nothing and `WAIT n 0` blocks for ever: both are refused.
    pub(crate) fn new(replicas: usize, timeout: Duration) -> Result<Self, Error> {
        if replicas == 0 {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "waiting for 0 Redis replicas confirms nothing; leave out wait_for_replicas",
            ));
        }
        if timeout.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the timeout of wait_for_replicas must be longer than zero (WAIT with timeout 0 \
                 blocks until the replicas answer, for ever if they never do)",
            ));
        }
        Ok(Self { replicas, timeout })
    }
}

/// Refuses a server whose `maxmemory-policy` may evict idem's keys (see [`read_policy`] for
/// how it is read). `server` names it in the message when known.
pub(crate) async fn check_maxmemory_policy<C: ConnectionLike>(
    conn: &mut C,
    server: Option<&str>,
) -> Result<(), Error> {
    let at = server.map(|s| format!(" at {s}")).unwrap_or_default();
    let policy = read_policy(conn, &at).await?;
    if policy == SAFE_POLICY {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Misconfigured,
        format!(
            "Redis{at} runs with maxmemory-policy {policy}, which lets it evict idem's keys \
             under memory pressure ({why}): an evicted completed record runs its request \
             again, an evicted lease lets a second executor take over a running one. Run \
             `CONFIG SET maxmemory-policy noeviction` (and set it in redis.conf or your \
             provider's parameter group), or, if you accept the risk, build the store with \
             `.skip_maxmemory_policy_check()`",
            why = if policy.starts_with("volatile-") {
                "every key idem writes has an expiry, so each is a candidate"
            } else {
                "every key is a candidate"
            },
        ),
    ))
}

/// The server's `maxmemory-policy`: from `CONFIG GET`, or, where `CONFIG` is disabled or
/// renamed (managed Redis) or not permitted to this user, from `INFO memory`. An outage is
/// [`ErrorKind::Unavailable`]; a policy that neither command reveals is
/// [`ErrorKind::Misconfigured`], naming the opt-out. `at` is `" at <server>"` or empty.
async fn read_policy<C: ConnectionLike>(conn: &mut C, at: &str) -> Result<String, Error> {
    let config = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async::<Value>(conn)
        .await;
    let config_failed = match config {
        Ok(reply) => match policy_from_config(&reply) {
            Some(policy) => return Ok(policy),
            None => format!("unexpected reply {reply:?}"),
        },
        Err(e) if kind_of(&e) == ErrorKind::Unavailable => {
            return Err(Error::from_system(
                ErrorKind::Unavailable,
                SYSTEM,
                "reading maxmemory-policy (CONFIG GET)",
                e,
            ));
        }
        Err(e) => e.to_string(),
    };
    let info = redis::cmd("INFO")
        .arg("memory")
        .query_async::<String>(conn)
        .await;
    let info_failed = match info {
        Ok(text) => match policy_from_info(&text) {
            Some(policy) => return Ok(policy),
            None => "no maxmemory_policy field in the reply".to_owned(),
        },
        Err(e) if kind_of(&e) == ErrorKind::Unavailable => {
            return Err(Error::from_system(
                ErrorKind::Unavailable,
                SYSTEM,
                "reading maxmemory-policy (INFO memory)",
                e,
            ));
        }
        Err(e) => e.to_string(),
    };
    Err(Error::new(
        ErrorKind::Misconfigured,
        format!(
            "could not read the maxmemory-policy of Redis{at} (CONFIG GET maxmemory-policy: \
             {config_failed}; INFO memory: {info_failed}), so idem cannot tell whether Redis may \
             evict its keys; if you have verified that the policy is noeviction, build the store \
             with `.skip_maxmemory_policy_check()`"
        ),
    ))
}

/// `CONFIG GET maxmemory-policy`: `[name, value]` in RESP2, `{name: value}` in RESP3.
fn policy_from_config(reply: &Value) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let value = match reply {
        Value::Array(items) => match items.as_slice() {
            [name, value] if text(name).as_deref() == Some("maxmemory-policy") => value,
            _ => return None,
        },
        Value::Map(pairs) => {
            &pairs
                .iter()
                .find(|(name, _)| text(name).as_deref() == Some("maxmemory-policy"))?
                .1
        }
        _ => return None,
    };
    text(value).map(|v| v.trim().to_ascii_lowercase())
}

/// The `maxmemory_policy:<value>` line of `INFO memory`.
fn policy_from_info(text: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.trim().strip_prefix("maxmemory_policy:"))
        .map(|v| v.trim().to_ascii_lowercase())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Value {
        Value::BulkString(v.as_bytes().to_vec())
    }

    #[test]
    fn the_policy_is_read_from_either_protocol_and_from_info() {
        assert_eq!(
            policy_from_config(&Value::Array(vec![s("maxmemory-policy"), s("noeviction")])),
            Some("noeviction".to_owned())
        );
        assert_eq!(
            policy_from_config(&Value::Map(vec![(
                s("maxmemory-policy"),
                s("volatile-lru")
            )])),
            Some("volatile-lru".to_owned())
        );
        assert_eq!(policy_from_config(&Value::Array(vec![])), None);
        assert_eq!(policy_from_config(&Value::Nil), None);
        let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\nx:y\r\n";
        assert_eq!(policy_from_info(info), Some("allkeys-lru".to_owned()));
        assert_eq!(policy_from_info("# Memory\r\nused_memory:1\r\n"), None);
    }

    #[test]
    fn replica_waits_that_cannot_work_are_refused() {
        assert!(ReplicaWait::new(1, Duration::from_millis(1)).is_ok());
        for (n, t) in [(0, Duration::from_secs(1)), (2, Duration::ZERO)] {
            let e = ReplicaWait::new(n, t).expect_err("refused");
            assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        }
    }
}
