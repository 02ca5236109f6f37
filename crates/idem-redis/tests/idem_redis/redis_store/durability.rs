//! What can make Redis lose a record, on Redis servers of the tests' own (an eviction policy, a
//! replica that does not keep up): the `maxmemory-policy` check at connect and waiting for
//! replicas with `WAIT`.
//!
//! Each test starts its own `redis-server` processes on free loopback ports (no persistence,
//! a temporary directory), so it may reconfigure, freeze and kill them; the shared server of
//! `IDEM_TEST_REDIS_URL` is never touched. They are real-service tests all the same: without
//! `IDEM_TEST_REDIS_URL` they skip, and without `redis-server` on `PATH` they skip, or fail
//! under `IDEM_TEST_REQUIRE_SERVICES=1`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_core::store::RequestStore;
use idem_core::{Begin, ErrorKind, TransactionalStore};
use idem_redis::{RedisRequestStore, ReplicasNotConfirmed, UnconfirmedWrite};
use redis::aio::MultiplexedConnection;

use super::{DAY, LONG, Recording, acquire, complete, connection, fp, key, keys_under};

/// A `redis-server` of this test's own, killed when dropped.
pub(super) struct OwnRedis {
    child: Child,
    port: u16,
    pub(super) url: String,
    _dir: tempfile::TempDir,
}

impl OwnRedis {
    /// Starts a server with `args` on a free loopback port and waits until it answers. `None`
    /// (after saying why) when `redis-server` is not installed and services are not required.
    pub(super) async fn start(test: &str, args: &[&str]) -> Option<Self> {
        for _attempt in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let dir = tempfile::tempdir().expect("tempdir");
            let spawned = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if std::env::var(idem_testkit::services::REQUIRE).as_deref() == Ok("1") {
                        panic!(
                            "{test}: redis-server is not on PATH but {}=1",
                            idem_testkit::services::REQUIRE
                        );
                    }
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "SKIPPING {test}: redis-server not on PATH"
                    );
                    return None;
                }
                Err(e) => panic!("{test}: starting redis-server: {e}"),
            };
            let mut server = Self {
                child,
                port,
                url: format!("redis://127.0.0.1:{port}"),
                _dir: dir,
            };
            if server.answers().await {
                return Some(server);
            }
            // Most likely another process took the port between our probe and its bind.
            let _ = server.child.kill();
        }
        panic!("{test}: our redis-server did not come up");
    }

    async fn answers(&mut self) -> bool {
        let client = redis::Client::open(self.url.as_str()).expect("URL");
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    pub(super) async fn conn(&self) -> MultiplexedConnection {
        connection(&self.url).await.1
    }

    /// `SIGSTOP`: the process stays, its sockets stay open, it answers nothing — a replica
    /// that has fallen behind, as far as its primary can tell.
    fn freeze(&self) {
        signal(&self.child, "-STOP");
    }

    fn thaw(&self) {
        signal(&self.child, "-CONT");
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(child: &Child, which: &str) {
    let status = Command::new("kill")
        .args([which, &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {which} failed");
}

async fn config_set(conn: &mut MultiplexedConnection, name: &str, value: &str) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(conn)
        .await
        .expect("CONFIG SET on our own server");
}

async fn info(conn: &mut MultiplexedConnection, section: &str, field: &str) -> Option<String> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .expect("INFO");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
}

const EVICTING: [&str; 7] = [
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
];

fn refused_for_policy(err: &idem_core::Error, policy: &str) {
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{policy}: {err}");
    let text = err.to_string();
    for needle in [
        "maxmemory-policy",
        policy,
        "CONFIG SET maxmemory-policy noeviction",
        "skip_maxmemory_policy_check",
    ] {
        assert!(
            text.contains(needle),
            "{policy}: {needle:?} missing: {text}"
        );
    }
}

/// Every key idem writes has an expiry, so a `volatile-*` policy may evict any of them, and an
/// `allkeys-*` policy any key at all: only `noeviction` is accepted. With the opt-out, this
/// test also shows what the check prevents: a completed record evicted, so the request would
/// run again.
#[tokio::test]
async fn a_maxmemory_policy_that_can_evict_idem_keys_is_refused_at_connect() {
    let test = "a_maxmemory_policy_that_can_evict_idem_keys_is_refused_at_connect";
    if super::redis_url(test).is_none() {
        return;
    }
    let Some(server) = OwnRedis::start(test, &["--maxmemory-policy", "volatile-lru"]).await else {
        return;
    };
    let mut admin = server.conn().await;
    for policy in EVICTING {
        config_set(&mut admin, "maxmemory-policy", policy).await;
        let err = RedisRequestStore::connect(&server.url)
            .await
            .expect_err("an evicting policy was accepted");
        refused_for_policy(&err, policy);
        assert!(err.to_string().contains(&server.url), "{err}");
    }
    // A caller's own connection is checked on request, by the same rule.
    let own = RedisRequestStore::with_connection(server.conn().await, "idem:own").expect("store");
    let err = own
        .check_maxmemory_policy()
        .await
        .expect_err("an evicting policy passed the check");
    refused_for_policy(&err, EVICTING[EVICTING.len() - 1]);
    config_set(&mut admin, "maxmemory-policy", "noeviction").await;
    own.check_maxmemory_policy()
        .await
        .expect("noeviction passes the check");
    RedisRequestStore::connect(&server.url)
        .await
        .expect("noeviction is accepted");

    // The opt-out, and what it risks: under memory pressure a completed record goes.
    config_set(&mut admin, "maxmemory-policy", "volatile-lru").await;
    let store = RedisRequestStore::builder(&server.url)
        .skip_maxmemory_policy_check()
        .connect()
        .await
        .expect("the opt-out connects");
    let k = key("k-evicted");
    let fence = acquire(&store, &k, LONG, DAY).await;
    complete(&store, &k, fence, b"charged").await;
    let used: u64 = info(&mut admin, "memory", "used_memory")
        .await
        .and_then(|v| v.parse().ok())
        .expect("used_memory");
    config_set(&mut admin, "maxmemory", &(used + 512 * 1024).to_string()).await;
    let filler = vec![b'x'; 8 * 1024];
    let mut evicted = false;
    for i in 0..4_000 {
        let () = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&filler)
            .arg("PX")
            .arg(DAY.as_millis() as u64)
            .query_async(&mut admin)
            .await
            .expect("SET filler");
        if keys_under(&mut admin, idem_redis::DEFAULT_KEY_PREFIX)
            .await
            .iter()
            .all(|k| !k.ends_with(":rec"))
        {
            evicted = true;
            break;
        }
    }
    assert!(evicted, "volatile-lru never evicted the completed record");
    assert!(
        matches!(
            store
                .begin_request(&k, &fp("body"), LONG, DAY)
                .await
                .expect("begin"),
            Begin::Acquired { .. }
        ),
        "an evicted record is taken as new: the request runs again"
    );
}

/// Managed Redis (ElastiCache, Memorystore, …) often disables or renames `CONFIG`: the policy
/// is then read from `INFO memory`; when neither can be read, only the opt-out connects.
#[tokio::test]
async fn the_policy_is_read_from_info_without_config_and_unreadable_is_refused() {
    let test = "the_policy_is_read_from_info_without_config_and_unreadable_is_refused";
    if super::redis_url(test).is_none() {
        return;
    }
    let no_config = ["--rename-command", "CONFIG", ""];
    let Some(evicting) = OwnRedis::start(
        test,
        &[&no_config[..], &["--maxmemory-policy", "allkeys-lru"]].concat(),
    )
    .await
    else {
        return;
    };
    let err = RedisRequestStore::connect(&evicting.url)
        .await
        .expect_err("allkeys-lru read from INFO was accepted");
    refused_for_policy(&err, "allkeys-lru");

    let Some(safe) = OwnRedis::start(test, &no_config).await else {
        return;
    };
    RedisRequestStore::connect(&safe.url)
        .await
        .expect("noeviction read from INFO is accepted");

    let Some(unreadable) = OwnRedis::start(
        test,
        &[&no_config[..], &["--rename-command", "INFO", ""]].concat(),
    )
    .await
    else {
        return;
    };
    let err = RedisRequestStore::connect(&unreadable.url)
        .await
        .expect_err("an unreadable policy was accepted");
    assert_eq!(err.kind(), ErrorKind::Misconfigured, "{err}");
    let text = err.to_string();
    for needle in [
        "maxmemory-policy",
        "skip_maxmemory_policy_check",
        "CONFIG",
        "INFO",
    ] {
        assert!(text.contains(needle), "{needle:?} missing: {text}");
    }
    RedisRequestStore::builder(&unreadable.url)
        .skip_maxmemory_policy_check()
        .connect()
        .await
        .expect("the opt-out connects");
}

/// A primary and a replica of its own, the replica in sync.
async fn primary_and_replica(test: &str) -> Option<(OwnRedis, OwnRedis)> {
    super::redis_url(test)?;
    let primary = OwnRedis::start(test, &[]).await?;
    let port = primary.port.to_string();
    let replica = OwnRedis::start(test, &["--replicaof", "127.0.0.1", &port]).await?;
    let (mut p, mut r) = (primary.conn().await, replica.conn().await);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let linked = info(&mut r, "replication", "master_link_status").await;
        let online = info(&mut p, "replication", "slave0").await;
        if linked.as_deref() == Some("up") && online.is_some_and(|s| s.contains("state=online")) {
            return Some((primary, replica));
        }
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A record's value: `r…` in progress, `d` · fingerprint · result once completed.
async fn get(conn: &mut MultiplexedConnection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("GET")
        .arg(key)
        .query_async(conn)
        .await
        .expect("GET")
}

/// With `wait_for_replicas(1, …)` a take and a completion return only once the replica has
/// them: the replica is frozen while the store writes and thawed a while later, and the
/// record is on it the moment the call returns.
#[tokio::test]
async fn a_take_and_a_completion_return_once_a_real_replica_has_them() {
    let test = "a_take_and_a_completion_return_once_a_real_replica_has_them";
    let Some((primary, replica)) = primary_and_replica(test).await else {
        return;
    };
    let store = RedisRequestStore::builder(&primary.url)
        .wait_for_replicas(1, Duration::from_secs(3))
        .connect()
        .await
        .expect("store");
    let mut on_replica = replica.conn().await;
    let k = key("k-replicated");
    let rec = |k: &str| {
        format!(
            "{}:{{{}:{k}}}:rec",
            idem_redis::DEFAULT_KEY_PREFIX,
            idem_core::RequestScope::new(["alice", "POST", "/charges"]).to_hex()
        )
    };
    let thaw_after = Duration::from_millis(400);
    let frozen_for = |replica: &OwnRedis| {
        replica.freeze();
        let pid = replica.child.id().to_string();
        std::thread::spawn(move || {
            std::thread::sleep(thaw_after);
            let _ = Command::new("kill").args(["-CONT", &pid]).status();
        })
    };

    let thawing = frozen_for(&replica);
    let started = Instant::now();
    let fence = acquire(&store, &k, LONG, DAY).await;
    let waited = started.elapsed();
    thawing.join().expect("thaw");
    assert!(
        waited >= thaw_after - Duration::from_millis(50),
        "the take returned after {waited:?}, before the frozen replica could acknowledge it"
    );
    assert_eq!(
        get(&mut on_replica, &rec("k-replicated"))
            .await
            .and_then(|v| v.first().copied()),
        Some(b'r'),
        "the replica lacks the record the take just confirmed"
    );

    let thawing = frozen_for(&replica);
    let started = Instant::now();
    complete(&store, &k, fence, b"201 Created").await;
    let waited = started.elapsed();
    thawing.join().expect("thaw");
    assert!(
        waited >= thaw_after - Duration::from_millis(50),
        "{waited:?}"
    );
    let mut done = b"d".to_vec();
    done.extend_from_slice(fp("body").as_bytes());
    done.extend_from_slice(b"201 Created");
    assert_eq!(
        get(&mut on_replica, &rec("k-replicated")).await,
        Some(done),
        "the replica lacks the result the completion just confirmed"
    );

    // Still one round trip each: the script and its WAIT go as one pipeline, on one
    // connection (a WAIT counts that connection's writes).
    let (_, inner) = connection(&primary.url).await;
    let recording = Recording::new(inner);
    let store = RedisRequestStore::with_connection(recording.clone(), "idem:rt")
        .expect("store")
        .wait_for_replicas(1, Duration::from_secs(3))
        .expect("wait option");
    let k = key("k-pipelined");
    let fence = acquire(&store, &k, LONG, DAY).await;
    complete(&store, &k, fence, b"ok").await;
    assert_eq!(recording.take_sent(), ["PIPELINE", "PIPELINE"]);
    // A server that lost its script cache: loaded, and the pipeline sent again.
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut primary.conn().await)
        .await
        .expect("SCRIPT FLUSH on our own primary");
    let replay = store
        .begin_request(&k, &fp("body"), LONG, DAY)
        .await
        .expect("replay");
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"ok".to_vec()
        }
    );
    assert_eq!(recording.take_sent(), ["PIPELINE", "SCRIPT", "PIPELINE"]);
}

/// A replica that does not acknowledge in time: a take is undone (the key is free, nothing
/// ran) and reported as unavailable; a completion stays stored on the primary and is reported
/// as an unknown outcome. Both carry a [`ReplicasNotConfirmed`].
#[tokio::test]
async fn unconfirmed_takes_are_released_and_unconfirmed_completions_are_outcome_unknown() {
    let test = "unconfirmed_takes_are_released_and_unconfirmed_completions_are_outcome_unknown";
    let Some((primary, replica)) = primary_and_replica(test).await else {
        return;
    };
    let timeout = Duration::from_millis(300);
    let store = RedisRequestStore::builder(&primary.url)
        .wait_for_replicas(1, timeout)
        .connect()
        .await
        .expect("store");
    let mut on_primary = primary.conn().await;
    let k = key("k-unconfirmed");

    replica.freeze();
    let started = Instant::now();
    let err = store
        .begin_request(&k, &fp("body"), LONG, DAY)
        .await
        .expect_err("a take no replica acknowledged succeeded");
    assert!(started.elapsed() >= timeout - Duration::from_millis(50));
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let why = ReplicasNotConfirmed::of(&err).expect("a ReplicasNotConfirmed source");
    assert_eq!(why.write(), UnconfirmedWrite::Take);
    assert_eq!((why.asked(), why.acknowledged()), (1, 0));
    assert_eq!(why.timeout(), timeout);
    assert!(err.to_string().contains("released"), "{err}");
    let left = keys_under(&mut on_primary, idem_redis::DEFAULT_KEY_PREFIX).await;
    assert!(
        left.is_empty(),
        "the unconfirmed take was not released: {left:?}"
    );

    replica.thaw();
    let fence = acquire(&store, &k, LONG, DAY).await;
    replica.freeze();
    let mut tx = store.begin().await.expect("tx");
    let err = store
        .complete_in(&mut tx, &k, fence, b"stored on the primary", DAY)
        .await
        .expect_err("a completion no replica acknowledged succeeded");
    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    let why = ReplicasNotConfirmed::of(&err).expect("a ReplicasNotConfirmed source");
    assert_eq!(why.write(), UnconfirmedWrite::Complete);
    assert_eq!((why.asked(), why.acknowledged()), (1, 0));
    replica.thaw();
    // The result is stored on the primary: a retry replays it.
    assert_eq!(
        store
            .begin_request(&k, &fp("body"), LONG, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"stored on the primary".to_vec()
        }
    );
}

#[tokio::test]
async fn replica_wait_options_that_cannot_work_are_refused() {
    for (replicas, timeout) in [(0, Duration::from_secs(1)), (1, Duration::ZERO)] {
        let err = RedisRequestStore::builder("redis://127.0.0.1:1")
            .wait_for_replicas(replicas, timeout)
            .connect()
            .await
            .expect_err("refused before connecting");
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    }
    let err = RedisRequestStore::builder("redis://127.0.0.1:1")
        .response_timeout(Duration::from_secs(1))
        .wait_for_replicas(1, Duration::from_secs(1))
        .connect()
        .await
        .expect_err("a WAIT the client would give up on first");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("response timeout"), "{err}");
}
