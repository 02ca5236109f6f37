//! The adapter across a real broker restart: a private `nats-server` (never the shared one) is
//! killed with SIGKILL while the real runner consumes from it, then restarted on the same port
//! and store directory. The runner's promise is that a lost broker connection is recovered with
//! backoff and the database side is unaffected: every message ends with exactly one effect.
//!
//! Gated on `IDEM_TEST_NATS_URL` like every real-service test (so CI must run it); the URL
//! itself is not used. Skipped, loudly, when no `nats-server` binary is installed.

use std::cell::Cell;
use std::fs::File;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_nats::{DEFAULT_PULL_EXPIRES, JetStreamSource, NatsProducer, async_nats};
use idem_testkit::broker_conformance::{Behaviour, EffectHandler, Harness, Mode, eventually};
use idem_testkit::{service_url, services::NATS, unique_name};

const STREAM: &str = "ORDERS";
const SUBJECT: &str = "orders.in";
/// The source's default dead-letter subject for [`STREAM`].
const DEAD_LETTER_SUBJECT: &str = "ORDERS.dead-letter";
/// Messages published before the kill, and again after the restart.
const PER_PHASE: usize = 20;
/// Short, so that an acknowledgement lost in the kill is redelivered within the test.
const ACK_WAIT: Duration = Duration::from_secs(3);
/// Generous wait for work a healthy broker hands out promptly.
const PROMPT: Duration = Duration::from_secs(20);

/// Where the server binary is: `/usr/sbin/nats-server` (the Debian package), else `PATH`.
fn nats_server_binary() -> Option<PathBuf> {
    let packaged = PathBuf::from("/usr/sbin/nats-server");
    if packaged.is_file() {
        return Some(packaged);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|p| p.is_file())
    })
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// A private JetStream server run as a child process. Dropping it kills the server and removes
/// its store, so a failing test leaves nothing behind.
struct PrivateServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl PrivateServer {
    /// Starts a server on a free port with a fresh store directory.
    fn start(binary: PathBuf, test: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name("idem_nats_server", test));
        std::fs::create_dir_all(dir.join("store")).expect("server directory");
        let mut server = Self {
            binary,
            port: free_port(),
            dir,
            child: None,
        };
        server.spawn();
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// (Re)starts the process on the same port and store directory, appending to one log.
    fn spawn(&mut self) {
        assert!(self.child.is_none(), "the server is already running");
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("server log");
        let child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.join("store"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("server log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
    }

    /// SIGKILL: no lame-duck mode, no flush, connections drop mid-stream.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until the server accepts connections and JetStream answers.
    async fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "nats-server exited with {status} on port {}: {}",
                    self.port,
                    self.log()
                );
            }
            let accepting = TcpStream::connect(("127.0.0.1", self.port)).is_ok();
            if accepting && jetstream_answers(&self.url()).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nats-server on port {} not ready within {timeout:?}: {}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn jetstream_answers(url: &str) -> bool {
    let Ok(client) = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(1))
        .connect(url)
        .await
    else {
        return false;
    };
    // The raw account-info request: async-nats 0.51's typed `query_account` cannot parse
    // nats-server 2.9's reply. "No responders" (an error here) means JetStream is not up yet.
    let info = client.request("$JS.API.INFO", bytes::Bytes::new());
    tokio::time::timeout(Duration::from_secs(2), info)
        .await
        .is_ok_and(|r| r.is_ok_and(|m| m.status.is_none() && !m.payload.is_empty()))
}

/// Publishes with the adapter's helper, retrying while the publisher's connection recovers.
/// A retry after a lost PubAck is dropped by JetStream's duplicate window: still one message.
async fn publish_retrying(producer: &NatsProducer, id: &str, n: usize) {
    let deadline = Instant::now() + PROMPT;
    let payload = format!("{{\"n\":{n}}}");
    loop {
        match producer.publish(SUBJECT, id, payload.clone()).await {
            Ok(_) => return,
            Err(e) => {
                assert!(Instant::now() < deadline, "publishing {id}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One way of losing the broker.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    pull_expires: Duration,
    /// Kill the server while messages are being processed (their acks are cut off) instead of
    /// once everything published so far is settled.
    mid_stream: bool,
}

/// Stream setup, consume, SIGKILL the server, restart it, consume more; then checks that every
/// message has exactly one effect, that the client reconnected, that delivery resumed within
/// the bound the adapter documents and that the runner stops cleanly.
async fn consume_across_restart(test: &str, scenario: Scenario) {
    if service_url(NATS, test).is_none() {
        return;
    }
    let Some(binary) = nats_server_binary() else {
        let _ = writeln!(std::io::stderr(), "SKIPPING {test}: nats-server not found");
        return;
    };
    let mut server = PrivateServer::start(binary, test);
    server.wait_ready(PROMPT).await;
    let url = server.url();

    let producer = NatsProducer::connect(&url)
        .await
        .expect("publisher connects");
    idem_nats::ensure_stream(producer.context(), STREAM, &[SUBJECT])
        .await
        .expect("stream");
    idem_nats::ensure_stream(producer.context(), "ORDERS_DLQ", &[DEAD_LETTER_SUBJECT])
        .await
        .expect("dead-letter stream");

    let client = async_nats::connect(&url).await.expect("consumer connects");
    let connections = client.statistics();
    let source = JetStreamSource::builder(STREAM, "restart")
        .ack_wait(ACK_WAIT)
        .pull_expires(scenario.pull_expires)
        .connect_with(async_nats::jetstream::new(client))
        .await
        .expect("source");
    let h = Harness::new(test).await;
    let handler = EffectHandler(Arc::new(Behaviour {
        // Slow enough that a kill lands with messages inside their transactions.
        delay: if scenario.mid_stream {
            Duration::from_millis(100)
        } else {
            Duration::ZERO
        },
        ..Behaviour::default()
    }));
    let run = h.spawn(source, handler, Mode::PerMessage);

    for i in 0..PER_PHASE {
        publish_retrying(&producer, &format!("before-{i}"), i).await;
    }
    let kill_at = if scenario.mid_stream {
        PER_PHASE / 3
    } else {
        PER_PHASE
    } as i64;
    let reached = eventually(PROMPT, || async { h.total_effects().await >= kill_at }).await;
    assert!(
        reached,
        "before the kill: {} of {kill_at} committed, {:?}",
        h.total_effects().await,
        run.observer.snapshot()
    );
    if !scenario.mid_stream {
        // Let the last acknowledgements reach the server, so that this scenario is about the
        // restart alone.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    server.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.spawn();
    server.wait_ready(PROMPT).await;
    let restarted = Instant::now();
    // Transactions in flight at the kill have committed by now (the database is unaffected).
    let committed_while_down = h.total_effects().await;

    for i in 0..PER_PHASE {
        publish_retrying(&producer, &format!("after-{i}"), PER_PHASE + i).await;
    }
    let bound = PROMPT;
    let stall = Cell::new(None);
    let all = eventually(bound, || {
        let (h, stall) = (&h, &stall);
        async move {
            let total = h.total_effects().await;
            if stall.get().is_none() && total > committed_while_down {
                stall.set(Some(restarted.elapsed()));
            }
            total >= 2 * PER_PHASE as i64
        }
    })
    .await;
    let all_after = restarted.elapsed();
    // A message whose acknowledgement the kill cut off comes back after the ack wait: give it
    // the chance to, so that a doubled effect would show.
    tokio::time::sleep(ACK_WAIT + Duration::from_secs(1)).await;
    let stats = run.stop().await;
    let connects = connections.connects.load(Ordering::Relaxed);
    let _ = writeln!(
        std::io::stderr(),
        "{test}: {scenario:?}; server down {:?}; first commit {:?} and all {all_after:?} after \
         the server was back; client connects {connects}; {stats:?}",
        restarted.duration_since(killed),
        stall.get(),
    );

    assert!(
        all,
        "after the restart: {} of {} committed within {bound:?}; {stats:?}; server log: {}",
        h.total_effects().await,
        2 * PER_PHASE,
        server.log()
    );
    for phase in ["before", "after"] {
        for i in 0..PER_PHASE {
            let id = format!("{phase}-{i}");
            assert_eq!(h.effects(&id).await, 1, "{id}: exactly one effect");
        }
    }
    assert_eq!(h.total_effects().await, 2 * PER_PHASE as i64);
    assert!(h.doubled().await.is_empty(), "{:?}", h.doubled().await);
    assert_eq!(stats.processed, 2 * PER_PHASE as u64, "{stats:?}");
    assert_eq!(stats.dead_lettered + stats.abandoned, 0, "{stats:?}");
    assert!(
        connects >= 2,
        "the consumer's client reconnected to the restarted server: {connects} connects"
    );
    // The pull request died with the server; the source notices the reconnect and sends a
    // new one at once, instead of waiting out pull_expires + the client's 5 s grace.
    let stall = stall.get().unwrap_or(all_after);
    let stall_bound = Duration::from_secs(3);
    assert!(
        stall < stall_bound,
        "delivery resumed {stall:?} after the restart; expected under {stall_bound:?} whatever the pull expiry ({:?})",
        scenario.pull_expires
    );
    if !scenario.mid_stream {
        // (Mid-stream the pull request is sent while the server is down; the client buffers
        // it and sends it after reconnecting, so there is nothing lost to report.)
        assert!(
            stats.broker_errors >= 1,
            "the runner heard of the lost pull request: {stats:?}"
        );
    }
    h.teardown().await;
}

/// Killed once everything published was settled: the consumer resumes on the restarted
/// server, and the messages published after the restart are processed once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkilled_broker_restart_loses_nothing_and_doubles_nothing() {
    let scenario = Scenario {
        pull_expires: Duration::from_secs(1),
        mid_stream: false,
    };
    consume_across_restart(
        "sigkilled_broker_restart_loses_nothing_and_doubles_nothing",
        scenario,
    )
    .await;
}

/// Killed with messages inside their transactions: those commit (the database does not care
/// about the broker) and whatever comes back is found to be a duplicate. Some always do:
/// nats-server 2.9 writes consumer state asynchronously, so even acknowledgements it confirmed
/// just before the SIGKILL are forgotten. Still one effect per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_killed_mid_stream_commits_each_message_once() {
    let scenario = Scenario {
        pull_expires: Duration::from_secs(1),
        mid_stream: true,
    };
    consume_across_restart(
        "broker_killed_mid_stream_commits_each_message_once",
        scenario,
    )
    .await;
}

/// With the default 10 s pull expiry too, delivery resumes within seconds of the restart: the
/// source re-sends the pull request the server lost instead of waiting for it to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delivery_resumes_promptly_after_a_restart_with_the_default_pull_expiry() {
    let scenario = Scenario {
        pull_expires: DEFAULT_PULL_EXPIRES,
        mid_stream: false,
    };
    consume_across_restart(
        "delivery_resumes_promptly_after_a_restart_with_the_default_pull_expiry",
        scenario,
    )
    .await;
}
