//! What the conformance suite cannot see: round trips per operation, the script-cache
//! fallback, the key and its expiry, records of the earlier layout, fences across an expired
//! record, and errors; and, on servers of the tests' own, the commands a call costs Redis
//! (`floor`), the eviction-policy check and waiting for replicas (`durability`).

mod durability;
mod floor;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{
    Begin, ErrorKind, Fence, Fingerprint, IdempotencyKey, RequestErrorKind, RequestKey,
    RequestScope, TransactionalStore,
};
use idem_redis::RedisRequestStore;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

fn redis_url(test: &str) -> Option<String> {
    idem_testkit::service_url(idem_testkit::services::REDIS, test)
}

fn key(k: &str) -> RequestKey {
    RequestKey::new(
        RequestScope::new(["alice", "POST", "/charges"]),
        IdempotencyKey::new(k).expect("valid key"),
    )
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(body.as_bytes())
}

/// A connection that records the name of every request it sends — each one round trip —
/// and can answer the next `EVALSHA` with `NOSCRIPT` itself, as a server that lost its script
/// cache would.
#[derive(Clone)]
struct Recording {
    inner: MultiplexedConnection,
    sent: Arc<Mutex<Vec<String>>>,
    lose_script_cache: Arc<AtomicBool>,
}

impl Recording {
    fn new(inner: MultiplexedConnection) -> Self {
        Self {
            inner,
            sent: Arc::default(),
            lose_script_cache: Arc::default(),
        }
    }

    fn take_sent(&self) -> Vec<String> {
        std::mem::take(&mut *self.sent.lock().expect("lock"))
    }
}

impl ConnectionLike for Recording {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let name = match cmd.args_iter().next() {
            Some(redis::Arg::Simple(name)) => String::from_utf8_lossy(name).to_uppercase(),
            _ => "?".to_owned(),
        };
        if name == "EVALSHA" && self.lose_script_cache.swap(false, Ordering::SeqCst) {
            self.sent
                .lock()
                .expect("lock")
                .push("EVALSHA→NOSCRIPT".to_owned());
            return Box::pin(async {
                Err(RedisError::from((
                    redis::ErrorKind::Server(ServerErrorKind::NoScript),
                    "No matching script. Please use EVAL.",
                )))
            });
        }
        self.sent.lock().expect("lock").push(name);
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.sent.lock().expect("lock").push("PIPELINE".to_owned());
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

async fn connection(url: &str) -> (redis::Client, MultiplexedConnection) {
    let client = redis::Client::open(url).expect("redis URL");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to redis");
    (client, conn)
}

/// Deletes every key under `prefix`.
async fn clean(conn: &mut MultiplexedConnection, prefix: &str) {
    let keys = keys_under(conn, prefix).await;
    if !keys.is_empty() {
        let _: i64 = redis::cmd("DEL")
            .arg(&keys)
            .query_async(conn)
            .await
            .expect("DEL");
    }
}

async fn keys_under(conn: &mut MultiplexedConnection, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .expect("SCAN");
        out.extend(keys);
        if next == 0 {
            out.sort();
            return out;
        }
        cursor = next;
    }
}

async fn acquire<S: RequestStore>(s: &S, k: &RequestKey, lease: Duration, ttl: Duration) -> Fence {
    match s
        .begin_request(k, &fp("body"), lease, ttl)
        .await
        .expect("begin")
    {
        Begin::Acquired { fence, .. } => fence,
        other => panic!("expected to take the record, got {other:?}"),
    }
}

async fn complete<S: RequestStore>(s: &S, k: &RequestKey, fence: Fence, result: &[u8]) {
    let mut tx = s.begin().await.expect("tx");
    s.complete_in(&mut tx, k, fence, result, DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
}

/// Counted twice over: by the client (every request the store's connection sends) and by the
/// server (`MONITOR` lists each command a client sends; those a script runs show as `lua`).
#[tokio::test]
async fn a_replay_and_every_other_operation_is_one_round_trip() {
    let test = "a_replay_and_every_other_operation_is_one_round_trip";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (client, mut plain) = connection(&url).await;
    let (_, inner) = connection(&url).await;
    let conn = Recording::new(inner.clone());
    let store = RedisRequestStore::with_connection(conn.clone(), &prefix).expect("store");
    let k = key("k-round-trip");

    let fence = acquire(&store, &k, LONG, DAY).await;
    assert!(matches!(
        store
            .begin_request(&k, &fp("body"), LONG, DAY)
            .await
            .expect("busy"),
        Begin::InProgress { .. }
    ));
    assert!(store.extend_lease(&k, fence, LONG).await.expect("extend"));
    complete(&store, &k, fence, b"201 Created").await;
    // The scripts are loaded now (a first call on a fresh server adds SCRIPT LOAD + EVALSHA).
    let warm = conn.take_sent();
    assert!(
        warm.iter().all(|c| c == "EVALSHA" || c == "SCRIPT"),
        "{warm:?}"
    );
    assert_eq!(
        warm.iter().filter(|c| *c == "EVALSHA").count(),
        4,
        "{warm:?}"
    );

    // Server side: the replay's commands from the store's own connection, between markers.
    let info: String = redis::cmd("CLIENT")
        .arg("INFO")
        .query_async(&mut inner.clone())
        .await
        .expect("CLIENT INFO");
    let addr = info
        .split_whitespace()
        .find_map(|f| f.strip_prefix("addr="))
        .expect("addr in CLIENT INFO")
        .to_owned();
    let mut monitor = client
        .get_async_monitor()
        .await
        .expect("MONITOR")
        .into_on_message::<String>();
    let (start, end) = (format!("{prefix}-start"), format!("{prefix}-end"));
    let echo = |marker: String| {
        let mut inner = inner.clone();
        async move {
            let _: String = redis::cmd("ECHO")
                .arg(marker)
                .query_async(&mut inner)
                .await
                .expect("ECHO");
        }
    };
    let mut from_store = Vec::new();
    echo(start.clone()).await;
    // Once the start marker shows, MONITOR is live: replay, then mark the end.
    let replay = loop {
        let line = tokio::time::timeout(Duration::from_secs(5), monitor.next())
            .await
            .expect("MONITOR went quiet")
            .expect("MONITOR stream ended");
        if line.contains(&format!(" {addr}]")) && line.contains(&start) {
            let replay = store.begin_request(&k, &fp("body"), LONG, DAY).await;
            echo(end.clone()).await;
            break replay;
        }
    };
    loop {
        let line = tokio::time::timeout(Duration::from_secs(5), monitor.next())
            .await
            .expect("MONITOR went quiet")
            .expect("MONITOR stream ended");
        if !line.contains(&format!(" {addr}]")) {
            continue;
        }
        if line.contains(&end) {
            break;
        }
        from_store.push(line);
    }
    assert_eq!(
        replay.expect("replay"),
        Begin::Completed {
            result: b"201 Created".to_vec()
        }
    );
    assert_eq!(conn.take_sent(), ["EVALSHA"], "client side");
    assert_eq!(from_store.len(), 1, "server side: {from_store:#?}");
    assert!(from_store[0].contains("\"EVALSHA\""), "{from_store:?}");

    // Release and a mismatch are one round trip too.
    let other = key("k-round-trip-2");
    let fence = acquire(&store, &other, LONG, DAY).await;
    assert_eq!(
        store
            .begin_request(&other, &fp("changed"), LONG, DAY)
            .await
            .expect("begin"),
        Begin::Mismatch
    );
    store.release(&other, fence).await.expect("release");
    assert_eq!(conn.take_sent(), ["EVALSHA"; 3]);
    clean(&mut plain, &prefix).await;
}

#[tokio::test]
async fn a_lost_script_cache_is_reloaded_and_the_call_succeeds() {
    let test = "a_lost_script_cache_is_reloaded_and_the_call_succeeds";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (_, mut plain) = connection(&url).await;
    let (_, inner) = connection(&url).await;
    let conn = Recording::new(inner);
    let store = RedisRequestStore::with_connection(conn.clone(), &prefix).expect("store");
    let k = key("k-noscript");
    let fence = acquire(&store, &k, LONG, DAY).await;
    complete(&store, &k, fence, b"stored").await;
    conn.take_sent();
    conn.lose_script_cache.store(true, Ordering::SeqCst);
    assert_eq!(
        store
            .begin_request(&k, &fp("body"), LONG, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"stored".to_vec()
        }
    );
    assert_eq!(conn.take_sent(), ["EVALSHA→NOSCRIPT", "SCRIPT", "EVALSHA"]);
    clean(&mut plain, &prefix).await;
}

/// The reaper has nothing to do because the one key of a record carries an expiry.
#[tokio::test]
async fn a_record_is_one_key_that_expires_by_itself() {
    let test = "a_record_is_one_key_that_expires_by_itself";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (_, mut plain) = connection(&url).await;
    let store = RedisRequestStore::builder(&url)
        .key_prefix(&prefix)
        .connect()
        .await
        .expect("store");
    let k = key("k-layout");
    let rec = format!(
        "{prefix}:{{{}:k-layout}}:rec",
        RequestScope::new(["alice", "POST", "/charges"]).to_hex()
    );
    let lease = Duration::from_secs(20);
    let ttl = Duration::from_secs(60);

    let fence = acquire(&store, &k, lease, ttl).await;
    assert_eq!(
        keys_under(&mut plain, &prefix).await,
        std::slice::from_ref(&rec)
    );
    let observer = plain.clone();
    let pttl = || {
        let (mut c, rec) = (observer.clone(), rec.clone());
        async move {
            let ms: i64 = redis::cmd("PTTL")
                .arg(&rec)
                .query_async(&mut c)
                .await
                .expect("PTTL");
            ms
        }
    };
    let value = || {
        let (mut c, rec) = (observer.clone(), rec.clone());
        async move {
            let v: Vec<u8> = redis::cmd("GET")
                .arg(&rec)
                .query_async(&mut c)
                .await
                .expect("GET");
            v
        }
    };
    let ms = pttl().await;
    assert!(ms > 55_000 && ms <= 60_000, "in progress: {ms}");
    let v = value().await;
    assert_eq!(v[0], b'r');
    assert_eq!(&v[1..33], fp("body").as_bytes());
    assert!(
        v.ends_with(format!(":{}", fence.0).as_bytes()),
        "the value ends with the holder's fence: {}",
        String::from_utf8_lossy(&v[33..])
    );

    // An extension past the TTL keeps the record at least as long as the lease.
    assert!(
        store
            .extend_lease(&k, fence, Duration::from_secs(120))
            .await
            .expect("extend")
    );
    let ms = pttl().await;
    assert!(ms > 115_000 && ms <= 120_000, "extended: {ms}");

    let mut tx = store.begin().await.expect("tx");
    store
        .complete_in(&mut tx, &k, fence, b"r", ttl)
        .await
        .expect("complete");
    assert_eq!(
        keys_under(&mut plain, &prefix).await,
        std::slice::from_ref(&rec)
    );
    let ms = pttl().await;
    assert!(ms > 55_000 && ms <= 60_000, "completed: {ms}");
    let mut done = b"d".to_vec();
    done.extend_from_slice(fp("body").as_bytes());
    done.extend_from_slice(b"r");
    assert_eq!(value().await, done);
    assert_eq!(store.reap_batch(100).await.expect("reap"), 0);
    clean(&mut plain, &prefix).await;
}

/// Records written by the earlier layout (a hash, with a lease key and a fence counter beside
/// it) are replayed, answered in progress while their lease lives, and taken over into the
/// new form once it ran out, with the counter + 1.
#[tokio::test]
async fn records_of_the_earlier_hash_layout_are_still_honoured() {
    let test = "records_of_the_earlier_hash_layout_are_still_honoured";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (_, mut plain) = connection(&url).await;
    let store = RedisRequestStore::builder(&url)
        .key_prefix(&prefix)
        .connect()
        .await
        .expect("store");
    let names = |k: &str| {
        let tag = format!(
            "{prefix}:{{{}:{k}}}",
            RequestScope::new(["alice", "POST", "/charges"]).to_hex()
        );
        (
            format!("{tag}:rec"),
            format!("{tag}:lease"),
            format!("{tag}:fence"),
        )
    };
    let body = fp("body");
    let fp_bytes = body.as_bytes().to_vec();

    // Completed: replayed; another input: mismatch.
    let (rec, _, _) = names("k-old-done");
    let () = redis::cmd("HSET")
        .arg(&rec)
        .arg("fp")
        .arg(&fp_bytes)
        .arg("state")
        .arg("done")
        .arg("fence")
        .arg("5")
        .arg("result")
        .arg("old result")
        .query_async::<i64>(&mut plain)
        .await
        .map(|_| ())
        .expect("HSET");
    let k = key("k-old-done");
    assert_eq!(
        store
            .begin_request(&k, &body, LONG, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"old result".to_vec()
        }
    );
    assert_eq!(
        store
            .begin_request(&k, &fp("other"), LONG, DAY)
            .await
            .expect("mismatch"),
        Begin::Mismatch
    );

    // Running under a live lease: in progress; once the lease is gone: taken over.
    let (rec, lease, counter) = names("k-old-run");
    let () = redis::pipe()
        .cmd("HSET")
        .arg(&rec)
        .arg("fp")
        .arg(&fp_bytes)
        .arg("state")
        .arg("run")
        .arg("fence")
        .arg("1764000000000007")
        .ignore()
        .cmd("SET")
        .arg(&lease)
        .arg("1764000000000007")
        .arg("PX")
        .arg(30_000)
        .ignore()
        .cmd("SET")
        .arg(&counter)
        .arg("1764000000000007")
        .ignore()
        .query_async(&mut plain)
        .await
        .expect("old record");
    let k = key("k-old-run");
    assert!(matches!(
        store.begin_request(&k, &body, LONG, DAY).await.expect("busy"),
        Begin::InProgress { retry_after } if retry_after == Duration::from_secs(30)
    ));
    let () = redis::cmd("DEL")
        .arg(&lease)
        .query_async::<i64>(&mut plain)
        .await
        .map(|_| ())
        .expect("DEL lease");
    assert_eq!(
        store
            .begin_request(&k, &body, LONG, DAY)
            .await
            .expect("takeover"),
        Begin::Acquired {
            fence: Fence(1_764_000_000_000_008),
            takeover: true
        }
    );
    let left = keys_under(&mut plain, &prefix).await;
    assert!(left.contains(&rec), "{left:?}");
    assert!(
        !left.contains(&lease) && !left.contains(&counter),
        "{left:?}"
    );
    let mut tx = store.begin().await.expect("tx");
    let err = store
        .complete_in(&mut tx, &k, Fence(1_764_000_000_000_007), b"stale", DAY)
        .await
        .expect_err("the old holder's fence");
    assert_eq!(err.request_kind(), Some(RequestErrorKind::LeaseLost));
    complete(&store, &k, Fence(1_764_000_000_000_008), b"new").await;
    assert_eq!(
        store
            .begin_request(&k, &body, LONG, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"new".to_vec()
        }
    );
    clean(&mut plain, &prefix).await;
}

/// Something else's value under a record's name is an error, never a take or a mismatch.
#[tokio::test]
async fn a_foreign_value_under_a_record_name_is_an_error() {
    let test = "a_foreign_value_under_a_record_name_is_an_error";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (_, mut plain) = connection(&url).await;
    let store = RedisRequestStore::builder(&url)
        .key_prefix(&prefix)
        .connect()
        .await
        .expect("store");
    let rec = format!(
        "{prefix}:{{{}:k-foreign}}:rec",
        RequestScope::new(["alice", "POST", "/charges"]).to_hex()
    );
    for (value, cmd) in [("hello", "SET"), ("a", "RPUSH")] {
        let () = redis::cmd("DEL")
            .arg(&rec)
            .query_async::<i64>(&mut plain)
            .await
            .map(|_| ())
            .expect("DEL");
        let () = redis::cmd(cmd)
            .arg(&rec)
            .arg(value)
            .query_async::<redis::Value>(&mut plain)
            .await
            .map(|_| ())
            .expect("write");
        let err = store
            .begin_request(&key("k-foreign"), &fp("body"), LONG, DAY)
            .await
            .expect_err("a foreign value");
        assert!(
            matches!(err.kind(), ErrorKind::Store | ErrorKind::Misconfigured),
            "{cmd}: {err}"
        );
    }
    clean(&mut plain, &prefix).await;
}

/// The fence expires with its record; the successor's fence still beats every fence of the
/// expired record, so a stalled executor of that record completes nothing.
#[tokio::test]
async fn a_stalled_executor_of_an_expired_record_cannot_complete_its_successor() {
    let test = "a_stalled_executor_of_an_expired_record_cannot_complete_its_successor";
    let Some(url) = redis_url(test) else { return };
    let prefix = idem_testkit::unique_name("idem_rt", test);
    let (_, mut plain) = connection(&url).await;
    let store = RedisRequestStore::builder(&url)
        .key_prefix(&prefix)
        .connect()
        .await
        .expect("store");
    let k = key("k-stalled");
    let short = Duration::from_millis(300);
    let stalled = acquire(&store, &k, short, short).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        keys_under(&mut plain, &prefix).await.is_empty(),
        "not expired"
    );
    let (successor, takeover) = match store
        .begin_request(&k, &fp("body"), LONG, DAY)
        .await
        .expect("begin")
    {
        Begin::Acquired { fence, takeover } => (fence, takeover),
        other => panic!("{other:?}"),
    };
    assert!(!takeover, "an expired record is new, not a takeover");
    assert!(successor > stalled, "{stalled:?} → {successor:?}");
    let mut tx = store.begin().await.expect("tx");
    let err = store
        .complete_in(&mut tx, &k, stalled, b"stale", DAY)
        .await
        .expect_err("a stale fence completed");
    assert_eq!(err.request_kind(), Some(RequestErrorKind::LeaseLost));
    assert!(!store.extend_lease(&k, stalled, LONG).await.expect("extend"));
    complete(&store, &k, successor, b"fresh").await;
    assert_eq!(
        store
            .begin_request(&k, &fp("body"), LONG, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"fresh".to_vec()
        }
    );
    // After a completion the fence no longer holds anything: a second completion is refused.
    let err = store
        .complete_in(&mut tx, &k, successor, b"twice", DAY)
        .await
        .expect_err("completed twice");
    assert_eq!(err.request_kind(), Some(RequestErrorKind::LeaseLost));
    clean(&mut plain, &prefix).await;
}

#[tokio::test]
async fn an_unreachable_server_is_unavailable_and_its_password_never_shown() {
    let err = RedisRequestStore::builder("redis://app:hunter2@127.0.0.1:1/0")
        .connection_retries(0)
        .connection_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("127.0.0.1:1"), "{shown}");
    assert!(
        err.to_string()
            .starts_with("Redis: connecting to redis://app:***@127.0.0.1:1/0: "),
        "{err}"
    );

    let err = RedisRequestStore::connect("http://app:hunter2@127.0.0.1/")
        .await
        .expect_err("not a redis URL");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().starts_with("invalid Redis URL "), "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");

    let builder = RedisRequestStore::builder("redis://app:hunter2@127.0.0.1:1/0");
    assert!(!format!("{builder:?}").contains("hunter2"));
}

#[tokio::test]
async fn a_prefix_with_a_brace_is_refused() {
    let err = RedisRequestStore::builder("redis://127.0.0.1:1")
        .key_prefix("{app}")
        .connect()
        .await
        .expect_err("brace in the prefix");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
}
