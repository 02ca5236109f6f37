//! The runner's promise on connection loss, against a real broker restart: "reconnect with
//! backoff; the database side is unaffected".
//!
//! Each test starts its own Mosquitto (never the shared one) with persistence on, runs the real
//! [`Consumer`](idem_consumer::Consumer) over [`MqttSource`] into a SQLite effects database,
//! stops the broker with SIGTERM (so it saves sessions, subscriptions and unacknowledged
//! messages to its persistence file, as a broker upgrade or host reboot would) and starts it
//! again on the same port. The consumer keeps running through all of it.
//!
//! Unix only: the broker is stopped with `kill -TERM`.

#![cfg(unix)]

use crate::common;

use std::borrow::Cow;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_consumer::{DeadLetter, Delivery, IdSource, Source};
use idem_core::Error;
use idem_mqtt::{MESSAGE_ID_PROPERTY, MqttDelivery, MqttProducer, MqttSource};
use idem_testkit::broker_conformance::{EffectHandler, Harness, Mode, eventually};
use idem_testkit::unique_name;
use tokio::sync::watch;

/// Generous for work a local broker does at once; the tests take a few seconds in all.
const PROMPT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// A private Mosquitto.

/// A Mosquitto child process with its own port, config, persistence file and log; killed and
/// its folder deleted on drop, so a failing test leaves nothing running.
#[derive(Debug)]
struct Broker {
    binary: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Broker {
    /// Starts a private broker, or returns `None` (after printing why) when the test is skipped:
    /// the MQTT service variable unset, as for every MQTT test, or no mosquitto binary.
    async fn start(test: &str) -> Option<Self> {
        // The shared broker's URL is not used, but the variable decides whether MQTT tests run,
        // and makes a missing setup a failure in CI.
        common::url(test)?;
        let Some(binary) = mosquitto_binary() else {
            if std::env::var(idem_testkit::services::REQUIRE).as_deref() == Ok("1") {
                panic!(
                    "{test}: mosquitto not found but {}=1",
                    idem_testkit::services::REQUIRE
                );
            }
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPING {test}: mosquitto not found");
            return None;
        };
        let dir = std::env::temp_dir().join(unique_name("idem_mosquitto", test));
        std::fs::create_dir_all(&dir).expect("broker folder");
        let port = free_port();
        let config = format!(
            "listener {port} 127.0.0.1\n\
             allow_anonymous true\n\
             persistence true\n\
             persistence_location {dir}/\n\
             log_dest file {dir}/mosquitto.log\n\
             log_type all\n\
             # Only read when started as root: stay root rather than switch to a user who\n\
             # cannot write this folder.\n\
             user root\n",
            dir = dir.display()
        );
        std::fs::write(dir.join("m.conf"), config).expect("write mosquitto config");
        let mut broker = Self {
            binary,
            dir,
            port,
            child: None,
        };
        broker.run().await;
        Some(broker)
    }

    fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Starts the process on the configured port and waits until it accepts connections.
    async fn run(&mut self) {
        let child = Command::new(&self.binary)
            .arg("-c")
            .arg(self.dir.join("m.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mosquitto");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok() {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("mosquitto exited at start with {status}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "mosquitto does not listen on {} after 10 s:\n{}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then waits for the exit: Mosquitto writes its persistence file on the way out.
    async fn stop_gracefully(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let sent = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM {} failed", child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for mosquitto") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "mosquitto ignores SIGTERM:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(status.success(), "mosquitto exit: {status}\n{}", self.log());
        assert!(
            self.log().contains("Saving in-memory database"),
            "mosquitto saved its persistence file:\n{}",
            self.log()
        );
    }

    /// Since the last start: publishes from `producer` the broker received before `client_id`
    /// reconnected.
    fn published_before_reconnect(&self, producer: &str, client_id: &str) -> usize {
        let log = self.log();
        let since_start = log
            .rsplit_once(" running\n")
            .map_or(log.as_str(), |(_, rest)| rest);
        let publish = format!("Received PUBLISH from {producer} ");
        let connected = format!(" as {client_id} (");
        since_start
            .lines()
            .take_while(|l| !l.contains(&connected))
            .filter(|l| l.contains(&publish))
            .count()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mosquitto.log")).unwrap_or_default()
    }

    /// PUBACKs the broker has logged receiving from `client_id`.
    fn pubacks_from(&self, client_id: &str) -> usize {
        let needle = format!("Received PUBACK from {client_id} ");
        self.log().lines().filter(|l| l.contains(&needle)).count()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn mosquitto_binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join("mosquitto"))
        .find(|p| Path::is_file(p))
}

/// A port nobody listens on right now (the OS picks it; the listener is closed at once).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

// ---------------------------------------------------------------------------------------------
// The consumer side.

/// A topic, a consumer session with a stable client ID, a dead-letter session and a producer on
/// a private broker.
struct Setup {
    topic: String,
    client_id: String,
    producer: MqttProducer,
    dead_letters: MqttSource,
}

impl Setup {
    async fn new(broker: &Broker, test: &str) -> Self {
        let url = broker.url();
        let topic = unique_name("restart", test);
        // As in the conformance fixture: dead letters need a persistent subscriber, or the
        // broker drops them. None are expected here, but the consumer is configured as in
        // production.
        let dead_letters =
            common::builder(&format!("{topic}-dlq"), &format!("{topic}/dead-letter"))
                .dead_letter_topic(format!("{topic}/dead-letter-of-dead-letters"))
                .connect(&url)
                .await
                .expect("dead-letter session");
        let producer = MqttProducer::connect(&url, Self::producer_id_of(&topic))
            .await
            .expect("producer")
            .require_subscriber(true);
        Self {
            client_id: format!("{topic}-consumer"),
            topic,
            producer,
            dead_letters,
        }
    }

    fn producer_id_of(topic: &str) -> String {
        format!("{topic}-producer")
    }

    fn producer_id(&self) -> String {
        Self::producer_id_of(&self.topic)
    }

    async fn source(&self, broker: &Broker) -> MqttSource {
        common::builder(&self.client_id, &self.topic)
            .dead_letter_topic(format!("{}/dead-letter", self.topic))
            .connect(&broker.url())
            .await
            .expect("consumer session")
    }

    async fn publish(&self, id: &str, n: i64) {
        self.producer
            .publish(&self.topic, Some(id), format!("{{\"n\":{n}}}").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("publish {id}: {e}"));
    }

    /// After the consumer stopped: its session holds nothing unacknowledged or queued.
    async fn assert_session_drained(&self, broker: &Broker) {
        let mut again = self.source(broker).await;
        let left = common::take(&mut again, 1, Duration::from_secs(1)).await;
        let left: Vec<String> = left.iter().map(|d| d.origin().to_string()).collect();
        again.close().await.expect("close");
        assert!(
            left.is_empty(),
            "everything was acknowledged, nothing waits in the session: {left:?}"
        );
    }

    async fn teardown(self) {
        let _ = self.dead_letters.close().await;
    }
}

async fn assert_one_effect_each(h: &Harness, ids: &[String]) {
    let mut wrong = Vec::new();
    for id in ids {
        let n = h.effects(id).await;
        if n != 1 {
            wrong.push((id.clone(), n));
        }
    }
    assert!(wrong.is_empty(), "effect rows per message ID: {wrong:?}");
    assert_eq!(h.total_effects().await, ids.len() as i64);
    assert!(h.doubled().await.is_empty(), "{:?}", h.doubled().await);
}

// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn consumer_keeps_running_through_a_graceful_broker_restart() {
    let test = "consumer_keeps_running_through_a_graceful_broker_restart";
    let Some(mut broker) = Broker::start(test).await else {
        return;
    };
    let started = Instant::now();
    let s = Setup::new(&broker, test).await;
    let h = Harness::new(test).await;
    let run = h.spawn(
        s.source(&broker).await,
        EffectHandler(Arc::default()),
        Mode::PerMessage,
    );
    let obs = run.observer.clone();

    const N: usize = 10;
    let ids: Vec<String> = (0..3 * N).map(|i| format!("restart-{i}")).collect();
    for (i, id) in ids[..N].iter().enumerate() {
        s.publish(id, i as i64).await;
    }
    let before = eventually(PROMPT, || {
        let p = obs.snapshot().processed;
        async move { p == N as u64 }
    })
    .await;
    assert!(before, "processed before the restart: {:?}", obs.snapshot());
    // The runner counts a message processed before its ack is sent: wait until the broker has
    // every PUBACK, so that a redelivery after the restart would be a broker or adapter fault.
    let acked = eventually(PROMPT, || {
        let n = broker.pubacks_from(&s.client_id);
        async move { n >= N }
    })
    .await;
    assert!(acked, "the broker received the PUBACKs:\n{}", broker.log());

    broker.stop_gracefully().await;
    let noticed = eventually(PROMPT, || {
        let e = obs.snapshot().broker_errors;
        async move { e >= 1 }
    })
    .await;
    assert!(
        noticed,
        "the consumer reports the lost connection: {:?}",
        obs.snapshot()
    );
    // Down long enough for the consumer's backoff to grow past a few retries, as in a real
    // outage.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let down = Instant::now();
    broker.run().await;
    // Most likely published before the consumer's backoff brought it back: these wait in its
    // session, restored from the persistence file with its subscription (the producer requires
    // a subscriber, so a lost subscription fails the publish).
    for (i, id) in ids[N..2 * N].iter().enumerate() {
        s.publish(id, (N + i) as i64).await;
    }
    let reconnected = eventually(PROMPT, || {
        let p = obs.snapshot().processed;
        async move { p == 2 * N as u64 }
    })
    .await;
    assert!(
        reconnected,
        "the consumer reconnected and consumed what was published meanwhile: {:?}",
        obs.snapshot()
    );
    let outage = down.elapsed();
    // And on the restored connection, live.
    for (i, id) in ids[2 * N..].iter().enumerate() {
        s.publish(id, (2 * N + i) as i64).await;
    }
    let all = eventually(PROMPT, || async { h.total_effects().await >= 3 * N as i64 }).await;
    let stats = tokio::time::timeout(Duration::from_secs(30), run.stop())
        .await
        .expect("the consumer stops gracefully after the restart");
    assert!(all, "every message committed: {stats:?}");
    assert_one_effect_each(&h, &ids).await;
    assert_eq!(stats.processed, 3 * N as u64, "{stats:?}");
    assert_eq!(
        stats.duplicates, 0,
        "acknowledged before the restart, acknowledged after it: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(stats.ack_failures, 0, "{stats:?}");
    assert!(stats.broker_errors >= 1, "{stats:?}");
    let queued = broker.published_before_reconnect(&s.producer_id(), &s.client_id);
    s.assert_session_drained(&broker).await;
    eprintln!(
        "{test}: restart to caught up {outage:?}, {queued} published while the consumer was \
         still away, whole test {:?}, {stats:?}",
        started.elapsed()
    );
    s.teardown().await;
    h.teardown().await;
}

/// Committed, its PUBACK not yet sent, and the broker goes away: the broker still holds the
/// message as in flight, saves it, and resends it to the resumed session after the restart,
/// where the claim makes it a duplicate.
///
/// The ack is released after the adapter saw the connection drop, so it is decided against the
/// dead connection (the adapter skips it). Whether a stale PUBACK would do harm this test cannot
/// tell: Mosquitto resends under the same packet ID, so a stale PUBACK still names this message.
#[tokio::test]
async fn message_committed_but_unacked_when_the_broker_stops_comes_back_as_a_duplicate() {
    let test = "message_committed_but_unacked_when_the_broker_stops_comes_back_as_a_duplicate";
    let Some(mut broker) = Broker::start(test).await else {
        return;
    };
    let started = Instant::now();
    let s = Setup::new(&broker, test).await;
    let h = Harness::new(test).await;
    let (open, gate) = watch::channel(false);
    let held = Arc::new(AtomicU64::new(0));
    let source = Gated {
        inner: s.source(&broker).await,
        held_id: "held".to_owned(),
        gate,
        held: held.clone(),
    };
    let run = h.spawn(source, EffectHandler(Arc::default()), Mode::PerMessage);
    let obs = run.observer.clone();

    s.publish("before", 0).await;
    s.publish("held", 1).await;
    let parked = eventually(PROMPT, || {
        let n = held.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    assert!(
        parked,
        "the held message committed and waits at its ack: {:?}",
        obs.snapshot()
    );
    assert_eq!(h.effects("held").await, 1);

    broker.stop_gracefully().await;
    // Released only once the adapter has seen the connection drop, so its ack is decided
    // against the dead connection every time.
    let noticed = eventually(PROMPT, || {
        let e = obs.snapshot().broker_errors;
        async move { e >= 1 }
    })
    .await;
    assert!(noticed, "the consumer reports the lost connection");
    open.send_replace(true);
    broker.run().await;
    s.publish("after", 2).await;

    let settled = eventually(PROMPT, || {
        let st = obs.snapshot();
        async move { st.duplicates >= 1 && st.processed >= 3 }
    })
    .await;
    let stats = tokio::time::timeout(Duration::from_secs(30), run.stop())
        .await
        .expect("the consumer stops gracefully after the restart");
    assert!(
        settled,
        "the held message was redelivered after the restart and found a duplicate: {stats:?}\n{}",
        broker.log()
    );
    let ids = ["before", "held", "after"].map(str::to_owned);
    assert_one_effect_each(&h, &ids).await;
    assert_eq!(stats.processed, 3, "{stats:?}");
    assert_eq!(stats.duplicates, 1, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    // The duplicate is the broker resending its saved in-flight message, DUP flag set.
    assert!(
        broker
            .log()
            .contains(&format!("Sending PUBLISH to {} (d1, q1", s.client_id)),
        "the restarted broker resent the in-flight message:\n{}",
        broker.log()
    );
    s.assert_session_drained(&broker).await;
    eprintln!("{test}: whole test {:?}, {stats:?}", started.elapsed());
    s.teardown().await;
    h.teardown().await;
}

// ---------------------------------------------------------------------------------------------
// A source whose ack for one message ID waits for a gate: "committed, PUBACK not yet sent".

#[derive(Debug)]
struct Gated {
    inner: MqttSource,
    held_id: String,
    gate: watch::Receiver<bool>,
    held: Arc<AtomicU64>,
}

#[derive(Debug)]
struct GatedDelivery {
    inner: MqttDelivery,
    gate: Option<(watch::Receiver<bool>, Arc<AtomicU64>)>,
}

impl Source for Gated {
    type Delivery = GatedDelivery;

    fn broker(&self) -> &'static str {
        self.inner.broker()
    }

    fn default_id_source(&self) -> IdSource {
        self.inner.default_id_source()
    }

    async fn next(&mut self, max: usize) -> Result<Vec<GatedDelivery>, Error> {
        Ok(self
            .inner
            .next(max)
            .await?
            .into_iter()
            .map(|d| {
                // Only the first delivery is held; its redelivery acks normally.
                let hold = d.header(MESSAGE_ID_PROPERTY).as_deref()
                    == Some(self.held_id.as_bytes())
                    && self.held.load(Ordering::SeqCst) == 0;
                GatedDelivery {
                    inner: d,
                    gate: hold.then(|| (self.gate.clone(), self.held.clone())),
                }
            })
            .collect())
    }

    async fn close(self) -> Result<(), Error> {
        self.inner.close().await
    }
}

impl Delivery for GatedDelivery {
    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.inner.header(name)
    }

    fn previous_deliveries(&self) -> u32 {
        self.inner.previous_deliveries()
    }

    fn fmt_origin(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt_origin(f)
    }

    async fn ack(self) -> Result<(), Error> {
        if let Some((mut gate, held)) = self.gate {
            held.fetch_add(1, Ordering::SeqCst);
            let _ = gate.wait_for(|open| *open).await;
        }
        self.inner.ack().await
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        self.inner.dead_letter(reason).await
    }

    async fn abandon(self) {
        self.inner.abandon().await
    }
}
