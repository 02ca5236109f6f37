//! `payments bench --cpu-split`: which process spends a leg's CPU. Reads Linux's /proc while a
//! leg runs: this process (the consumer), the broker's server process, and the PostgreSQL
//! backends serving this process's own connections, told apart from the server's shared
//! processes (WAL writer, checkpointer, other clients' backends) by the client port each
//! backend shows in its process title. Without /proc every figure is 0.
//!
//! CPU time comes from `schedstat` (nanoseconds, every thread), not from the 10 ms ticks of
//! `stat`, which are too coarse for a leg of a second or two.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_any::Broker;

/// How often backends are sampled: a backend's CPU after its last sample (when its pool closed
/// it) is missed, so this bounds what is lost per connection.
const EVERY: Duration = Duration::from_millis(50);

/// CPU seconds per process group over one leg.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Split {
    /// Wall time of the leg.
    pub(crate) wall: Duration,
    /// This process: the consumer, idem's or the bare one.
    pub(crate) consumer: Duration,
    /// The broker's server process(es).
    pub(crate) broker: Duration,
    /// The PostgreSQL backends of this process's connections.
    pub(crate) backends: Duration,
    /// The other PostgreSQL processes (WAL writer, checkpointer, and whatever else the server
    /// runs for other clients meanwhile: on a shared machine, not all of it is this leg's).
    pub(crate) postgres_other: Duration,
}

impl Split {
    /// One Markdown row in µs per message.
    pub(crate) fn row(&self, leg: &str, broker: &str, messages: usize) -> String {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / messages.max(1) as f64;
        let total = per(self.consumer) + per(self.broker) + per(self.backends);
        format!(
            "| {broker} | {leg} | {messages} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            messages as f64 / self.wall.as_secs_f64(),
            per(self.consumer),
            per(self.broker),
            per(self.backends),
            total,
            per(self.postgres_other),
        )
    }
}

/// The header of [`Split::row`]'s table.
pub(crate) const HEADER: &str = "| broker | leg | messages | msg/s | consumer µs/msg | broker server µs/msg | postgres backends µs/msg | sum µs/msg | postgres other processes µs/msg |\n|---|---|---|---|---|---|---|---|---|";

/// A leg being watched; [`Watch::stop`] gives its [`Split`].
pub(crate) struct Watch {
    started: Instant,
    first: Snapshot,
    /// Backends seen so far: pid → (CPU at first sight, CPU at last sight).
    backends: Arc<Mutex<HashMap<u32, (u64, u64)>>>,
    sampler: tokio::task::JoinHandle<()>,
    broker_pids: Vec<u32>,
    pg_port: u16,
}

#[derive(Debug, Default)]
struct Snapshot {
    me: u64,
    broker: u64,
    postgres: HashMap<u32, u64>,
}

impl Watch {
    /// Starts watching `broker`'s server and the PostgreSQL server on `pg_port`.
    pub(crate) fn start(broker: Broker, pg_port: u16) -> Watch {
        let broker_pids = pids_named(server_name(broker));
        let first = snapshot(&broker_pids);
        let backends = Arc::new(Mutex::new(HashMap::new()));
        // Backends already open count from here; the ones opened later from 0.
        sample_backends(pg_port, &backends, true);
        let sampler = {
            let backends = backends.clone();
            tokio::spawn(async move {
                loop {
                    sample_backends(pg_port, &backends, false);
                    tokio::time::sleep(EVERY).await;
                }
            })
        };
        Watch {
            started: Instant::now(),
            first,
            backends,
            sampler,
            broker_pids,
            pg_port,
        }
    }

    /// Ends the leg.
    pub(crate) fn stop(self) -> Split {
        let wall = self.started.elapsed();
        sample_backends(self.pg_port, &self.backends, false);
        self.sampler.abort();
        let last = snapshot(&self.broker_pids);
        let backends = self.backends.lock().map(|b| b.clone()).unwrap_or_default();
        let mine: u64 = backends.values().map(|(a, b)| b.saturating_sub(*a)).sum();
        // Other postgres processes: those alive at both ends and not this process's backends.
        let other: u64 = last
            .postgres
            .iter()
            .filter(|(pid, _)| !backends.contains_key(pid))
            .filter_map(|(pid, b)| self.first.postgres.get(pid).map(|a| b.saturating_sub(*a)))
            .sum();
        Split {
            wall,
            consumer: Duration::from_nanos(last.me.saturating_sub(self.first.me)),
            broker: Duration::from_nanos(last.broker.saturating_sub(self.first.broker)),
            backends: Duration::from_nanos(mine),
            postgres_other: Duration::from_nanos(other),
        }
    }
}

/// The server process of each broker family.
fn server_name(broker: Broker) -> &'static str {
    match broker {
        Broker::Nats => "nats-server",
        Broker::Amqp => "beam.smp",
        Broker::Kafka => "tansu",
        Broker::RedisStreams => "redis-server",
        Broker::Mqtt => "mosquitto",
        // A family a later idem-any adds: no server known, its column stays 0.
        _ => "",
    }
}

fn snapshot(broker_pids: &[u32]) -> Snapshot {
    Snapshot {
        me: cpu_ns("self").unwrap_or(0),
        broker: broker_pids
            .iter()
            .filter_map(|p| cpu_ns(&p.to_string()))
            .sum(),
        postgres: pids_named("postgres")
            .into_iter()
            .filter_map(|p| Some((p, cpu_ns(&p.to_string())?)))
            .collect(),
    }
}

/// Records the CPU of every backend serving one of this process's connections to `pg_port`;
/// with `baseline`, a backend seen for the first time counts from now, else from its start.
fn sample_backends(pg_port: u16, seen: &Mutex<HashMap<u32, (u64, u64)>>, baseline: bool) {
    let ports = my_client_ports(pg_port);
    if ports.is_empty() {
        return;
    }
    let Ok(mut seen) = seen.lock() else { return };
    for pid in pids_named("postgres") {
        let Ok(title) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let title = String::from_utf8_lossy(&title);
        // A backend's title: "postgres: 15/main: USER DB 127.0.0.1(PORT) STATE".
        let port = title
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(')'))
            .and_then(|(p, _)| p.parse::<u16>().ok());
        if !port.is_some_and(|p| ports.contains(&p)) {
            continue;
        }
        if let Some(ns) = cpu_ns(&pid.to_string()) {
            // A backend first seen mid-leg started during it, at (nearly) 0.
            let entry = seen
                .entry(pid)
                .or_insert((if baseline { ns } else { 0 }, ns));
            entry.1 = ns;
        }
    }
}

/// CPU time of every thread of `pid` ("self" for this process), in nanoseconds.
fn cpu_ns(pid: &str) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        total += s
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

fn pids_named(name: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .collect()
}

/// The local ports of this process's TCP connections to `remote_port`.
fn my_client_ports(remote_port: u16) -> HashSet<u16> {
    let mut inodes = HashSet::new();
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path())
                && let Some(inode) = link
                    .to_str()
                    .and_then(|l| l.strip_prefix("socket:["))
                    .and_then(|l| l.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        // "sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode", hex ports.
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let port = |addr: &str| {
                addr.rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            };
            if cols.len() > 9
                && port(cols[2]) == Some(remote_port)
                && inodes.contains(cols[9])
                && let Some(local) = port(cols[1])
            {
                ports.insert(local);
            }
        }
    }
    ports
}
