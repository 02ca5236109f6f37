//! The round-trip floor, held: what a first call and a replay of `Idempotency::call` cost
//! Redis, counted by the client (requests sent, each one round trip) and by the server
//! (`INFO commandstats`, which counts the commands a script runs as well as its `EVALSHA`).
//!
//! On a `redis-server` of the test's own, so that no other test's commands land in the
//! server-wide counters; it skips as the durability tests do.

use std::collections::BTreeMap;
use std::convert::Infallible;

use idem_core::{IdempotencyKey, RequestScope};
use idem_redis::RedisRequestStore;
use idem_request::Idempotency;
use redis::aio::MultiplexedConnection;

use super::durability::OwnRedis;
use super::{Recording, connection, redis_url};

/// Calls per command, from `INFO commandstats` (`cmdstat_get:calls=3,usec=…`).
async fn command_calls(conn: &mut MultiplexedConnection) -> BTreeMap<String, u64> {
    let text: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    text.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// What ran between two readings, without the `INFO` that took the first one.
fn ran(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
}

/// A first call: 2 round trips, 7 commands (`EVALSHA` + `GET`, `TIME`, `SET` to take the
/// record; `EVALSHA` + `GET`, `SET` to complete it). A replay: 1 round trip, 2 commands
/// (`EVALSHA` + `GET`). Any command more fails this test.
#[tokio::test]
async fn a_first_call_and_a_replay_cost_redis_the_fewest_commands() {
    let test = "a_first_call_and_a_replay_cost_redis_the_fewest_commands";
    if redis_url(test).is_none() {
        return;
    }
    let Some(own) = OwnRedis::start(test, &[]).await else {
        return;
    };
    let prefix = idem_testkit::unique_name("idem_floor", test);
    let (_, inner) = connection(&own.url).await;
    let conn = Recording::new(inner);
    let store = RedisRequestStore::with_connection(conn.clone(), &prefix).expect("store");
    let idem = Idempotency::builder(store).build().expect("engine");
    let scope = RequestScope::new(["charge", "floor"]);
    let ran_f = std::sync::atomic::AtomicU64::new(0);
    let call = async |id: &str| {
        let key = IdempotencyKey::new(id).expect("key");
        let charged: String = idem
            .call(scope, &key, &(id, 1250), async |_tx| {
                ran_f.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok::<_, Infallible>(format!("charged {id}"))
            })
            .await
            .expect("call");
        assert_eq!(charged, format!("charged {id}"));
    };
    // Loads the scripts (SCRIPT LOAD after a NOSCRIPT on this fresh server).
    call("warm").await;
    let mut stats = own.conn().await;
    conn.take_sent();

    const N: u64 = 25;
    let before = command_calls(&mut stats).await;
    for i in 0..N {
        call(&format!("first-{i}")).await;
    }
    let middle = command_calls(&mut stats).await;
    let sent = conn.take_sent();
    assert_eq!(
        sent.len() as u64,
        2 * N,
        "round trips per first call: {sent:?}"
    );
    assert!(sent.iter().all(|c| c == "EVALSHA"), "{sent:?}");
    assert_eq!(
        ran(&before, &middle),
        counts(&[
            ("evalsha", 2 * N),
            ("get", 2 * N),
            ("set", 2 * N),
            ("time", N)
        ]),
        "commands per first call"
    );

    for _ in 0..N {
        call("warm").await;
    }
    let after = command_calls(&mut stats).await;
    let sent = conn.take_sent();
    assert_eq!(sent, vec!["EVALSHA"; N as usize], "round trips per replay");
    assert_eq!(
        ran(&middle, &after),
        counts(&[("evalsha", N), ("get", N)]),
        "commands per replay"
    );
    assert_eq!(
        ran_f.load(std::sync::atomic::Ordering::Relaxed),
        N + 1,
        "the function ran once per key"
    );
}
