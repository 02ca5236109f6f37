//! `idem-chaos`: proves "no duplicate effect, nothing lost" under faults, by measurement.
//!
//! It publishes `PaymentRequested` messages with stable IDs (a share of them twice), runs
//! several `payments` processes in one consumer group over a real broker and PostgreSQL, and
//! while they consume it SIGKILLs them at random moments and lets them abort at idem's crash
//! points (`IDEM_CRASH_AT`), restarts them, and on request restarts PostgreSQL, fails it over
//! to read-only, cuts connections around COMMIT, or restarts the nodes of a 3-node JetStream
//! cluster. Then it waits until everything is consumed and checks the ledger against what was
//! sent: one summary line and one JSON object on stdout, exit status 1 on any anomaly.
//!
//! `--two-hop` adds a second hop behind a transactional outbox: the consumers also write an
//! event per charge, relays (in process, or `--relays N` `idem relay` processes) publish it,
//! and `--receipt-consumers` second-hop consumers record it; every kind of process is killed,
//! and the checker wants one effect per ID at each hop. The database is PostgreSQL's, MySQL's
//! or an SQLite file (`--database sqlite:`); the database faults need PostgreSQL.
//!
//! `--phases http|consumer` proves recovery points the same way (module `phases`): every
//! operation charges the test kit's fake card processor (in this process, counting charges
//! per account) and then records the charge, as two phases; `http` runs `http-payments
//! --card-processor` servers behind clients retrying with idem-client, `consumer` runs
//! `payments --card-processor` consumers; kills arm the phase driver's crash points too, and
//! the checker wants one processor charge and one charge row per operation, none stuck.
//!
//! On MQTT (`--broker mqtt://…`) the run starts a Mosquitto of its own (`--mosquitto`) with no
//! cap on what a disconnected session keeps, creates every consumer's persistent session
//! before publishing, and reads the backlog from the broker's `$SYS` store count.
//!
//! ```text
//! cargo build -p payments -p idem-chaos --features payments/crash-points
//! target/debug/idem-chaos --broker nats://127.0.0.1:4222 \
//!     --database postgres://postgres@127.0.0.1:5432/postgres \
//!     --messages 5000 --kills 100 --consumers 3 --seed 7
//! ```
//!
//! ```text
//! cargo build -p http-payments -p idem-chaos
//! target/debug/idem-chaos --phases http --database sqlite: --messages 300 --kills 35
//! ```
//!
//! A fixed `--seed` reproduces the same schedule of faults (which consumer, which crash
//! point, after how many visits, which COMMITs are cut); the processes' own timing is not.

mod broker;
mod faults;
mod fleet;
mod ledger;
mod mosquitto;
mod phases;
mod report;
mod run;
mod schedule;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// The broker and database URLs may hold passwords: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Args")
            .field(
                "broker",
                &self.broker.as_deref().map(idem_redact::redact_url),
            )
            .field("database", &idem_redact::redact_url(&self.database))
            .field("messages", &self.messages)
            .field("duplicates", &self.duplicates)
            .field("kills", &self.kills)
            .field("seed", &self.seed)
            .field("consumers", &self.consumers)
            .field("kill_every", &self.kill_every)
            .field("crash_share", &self.crash_share)
            .field("crash_within", &self.crash_within)
            .field("spare_armed_for", &self.spare_armed_for)
            .field("kill_all_at", &self.kill_all_at)
            .field("restart_database", &self.restart_database)
            .field("restart_database_command", &self.restart_database_command)
            .field("failover", &self.failover)
            .field("failover_for", &self.failover_for)
            .field("restart_broker", &self.restart_broker)
            .field("nats_server", &self.nats_server)
            .field("mosquitto", &self.mosquitto)
            .field("cut_connections", &self.cut_connections)
            .field("cut_share", &self.cut_share)
            .field("min_fault_time", &self.min_fault_time)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("local_cache", &self.local_cache)
            .field("partitions", &self.partitions)
            .field("redeliver_after", &self.redeliver_after)
            .field("drain_timeout", &self.drain_timeout)
            .field("payments", &self.payments)
            .field("work_dir", &self.work_dir)
            .field("keep", &self.keep)
            .field("two_hop", &self.two_hop)
            .field("receipt_consumers", &self.receipt_consumers)
            .field("relays", &self.relays)
            .field("idem", &self.idem)
            .field("kafka_static_membership", &self.kafka_static_membership)
            .field("phases", &self.phases)
            .field("servers", &self.servers)
            .field("clients", &self.clients)
            .field("give_up_share", &self.give_up_share)
            .field("lease", &self.lease)
            .field("scramble_foreign_keys", &self.scramble_foreign_keys)
            .field("http_payments", &self.http_payments)
            .finish()
    }
}

/// Command-line flags of one run.
#[derive(Clone, Parser)]
#[command(name = "idem-chaos", version, about)]
pub(crate) struct Args {
    /// Broker URL: nats://…, amqp://…, kafka://host:port, redis://… or mqtt://… (MQTT: the
    /// run starts a Mosquitto of its own, see --mosquitto; only the scheme counts). Not with
    /// `--phases http`, which has no broker.
    #[arg(long, value_name = "URL", required_unless_present = "phases")]
    pub(crate) broker: Option<String>,
    /// Database: a PostgreSQL or MySQL server URL, on which the run creates (and drops) a
    /// database of its own, or `sqlite:` for a file in the work folder (`sqlite:DIR` for one
    /// in DIR) that every process shares. The database faults need PostgreSQL.
    #[arg(long, value_name = "URL")]
    pub(crate) database: String,
    /// Distinct messages to publish.
    #[arg(long, default_value_t = 2_000)]
    pub(crate) messages: usize,
    /// Share of the messages published a second time (a producer retry).
    #[arg(long, default_value_t = 0.1)]
    pub(crate) duplicates: f64,
    /// Consumer kills in all: SIGKILLs at random moments plus aborts at crash points.
    #[arg(long, default_value_t = 20)]
    pub(crate) kills: u64,
    /// Seed of the fault schedule.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Consumer processes at once, in one consumer group.
    #[arg(long, default_value_t = 3)]
    pub(crate) consumers: usize,
    /// Mean time between two kills.
    #[arg(long, value_name = "DURATION", default_value = "300ms", value_parser = parse_duration)]
    pub(crate) kill_every: Duration,
    /// Share of (re)starts armed to abort at a crash point instead of waiting for a SIGKILL.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) crash_share: f64,
    /// An armed consumer aborts on a visit of its crash point drawn from 1..=N.
    #[arg(long, default_value_t = 30)]
    pub(crate) crash_within: u64,
    /// Random SIGKILLs spare a replica armed at a crash point for this long after its start,
    /// so it gets to reach its point.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) spare_armed_for: Duration,
    /// Kill every consumer at once when this share of the messages is committed
    /// (comma-separated, e.g. 0.2,0.45,0.7); counted in --kills' total.
    #[arg(long, value_delimiter = ',')]
    pub(crate) kill_all_at: Vec<f64>,
    /// Restart the PostgreSQL server this many times during the run.
    #[arg(long, default_value_t = 0, num_args = 0..=1, default_missing_value = "1")]
    pub(crate) restart_database: u64,
    /// Shell command that restarts PostgreSQL (default: pg_ctlcluster on the local cluster).
    #[arg(long, value_name = "COMMAND")]
    pub(crate) restart_database_command: Option<String>,
    /// Make the run's database read-only (a failover to a not-yet-writable replica: sessions
    /// cut, new ones refuse writes) this many times during the run.
    #[arg(long, default_value_t = 0, num_args = 0..=1, default_missing_value = "1")]
    pub(crate) failover: u64,
    /// How long each failover keeps the database read-only.
    #[arg(long, value_name = "DURATION", default_value = "4s", value_parser = parse_duration)]
    pub(crate) failover_for: Duration,
    /// Restart the broker this many times; NATS only: runs a 3-node JetStream cluster of the
    /// harness's own with R3 streams and kills one node at a time (--broker names only the
    /// scheme then).
    #[arg(long, default_value_t = 0, num_args = 0..=1, default_missing_value = "3")]
    pub(crate) restart_broker: u64,
    /// The nats-server binary for --restart-broker.
    #[arg(long, value_name = "PATH", default_value = "nats-server")]
    pub(crate) nats_server: String,
    /// The mosquitto binary an MQTT run starts as its own broker, on a free loopback port with
    /// no cap on what a disconnected session keeps (`max_queued_messages 0`; Mosquitto's
    /// default, 1 000, drops the rest while a consumer is down). Looked up on PATH, then in
    /// /usr/sbin.
    #[arg(long, value_name = "PATH", default_value = "mosquitto")]
    pub(crate) mosquitto: String,
    /// Put a proxy between consumers and PostgreSQL that cuts connections around COMMIT.
    #[arg(long)]
    pub(crate) cut_connections: bool,
    /// With --cut-connections: the share of COMMITs cut.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) cut_share: f64,
    /// How long the fault phase lasts at least (useful when --kills is 0).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration)]
    pub(crate) min_fault_time: Duration,
    /// Messages processed at once per consumer.
    #[arg(long, default_value_t = 4)]
    pub(crate) concurrency: usize,
    /// Messages per transaction (crash point in-batch needs more than 1).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Run the consumers with their local cache of committed claims on (`payments
    /// --local-cache`): redeliveries a process committed itself are acked from it, and the
    /// ledger must still hold one effect per ID.
    #[arg(long)]
    pub(crate) local_cache: bool,
    /// Kafka partitions of the run's topic (default: one per consumer).
    #[arg(long)]
    pub(crate) partitions: Option<i32>,
    /// How soon a dead consumer's messages go to another one (NATS ack wait, Redis Streams
    /// claim idle time, Kafka session timeout).
    #[arg(long, value_name = "DURATION", default_value = "6s", value_parser = parse_duration)]
    pub(crate) redeliver_after: Duration,
    /// Give up waiting for the backlog to drain after this long past the fault phase.
    #[arg(long, value_name = "DURATION", default_value = "180s", value_parser = parse_duration)]
    pub(crate) drain_timeout: Duration,
    /// The payments binary, built with `--features crash-points` (default: next to this one).
    #[arg(long, value_name = "PATH")]
    pub(crate) payments: Option<PathBuf>,
    /// Where consumer logs and cluster stores go (default: a new folder under the temp dir).
    #[arg(long, value_name = "DIR")]
    pub(crate) work_dir: Option<PathBuf>,
    /// Keep the run's database, broker objects and logs.
    #[arg(long)]
    pub(crate) keep: bool,
    /// Two hops: the consumers charge with `--emit`, writing a `PaymentCharged` event into the
    /// outbox with each charge and relaying it (in process, so every kill of a consumer also
    /// kills a relay anywhere around the outbox commit, the publish and the mark; or in
    /// `--relays` processes of their own), and `--receipt-consumers` second-hop idem consumers
    /// (`payments --receipts`), killed like the first, record each event. The checker then
    /// also wants exactly one receipt per payment.
    #[arg(long)]
    pub(crate) two_hop: bool,
    /// With --two-hop: the second hop's consumer processes, in one consumer group.
    #[arg(long, default_value_t = 2)]
    pub(crate) receipt_consumers: usize,
    /// With --two-hop: run this many standalone `idem relay` processes over the outbox
    /// (killed at random and at the relay's crash points too), and the consumers without
    /// their in-process relay. 0: each consumer relays in process.
    #[arg(long, default_value_t = 0)]
    pub(crate) relays: usize,
    /// The idem binary for --relays, built with crash points (default: next to this one).
    #[arg(long, value_name = "PATH")]
    pub(crate) idem: Option<PathBuf>,
    /// Kafka: let the consumers join as static group members (`payments --instance`, the
    /// default of payments). Off by default here: tansu 0.6.0, the Kafka-protocol broker CI
    /// runs, leaves a static member's partitions to nobody once its session expires until
    /// some member joins anew, which stalls a run that kills consumers (idem-kafka's docs);
    /// on Apache Kafka, turn it on.
    #[arg(long)]
    pub(crate) kafka_static_membership: bool,
    /// Operations of recovery points that charge a card processor (idem's fake one, in this
    /// process, counting charges per account): `http` runs `--servers` `http-payments
    /// --card-processor` services behind `--clients` clients that retry each operation with
    /// the same Idempotency-Key (idem-client) until it is answered; `consumer` runs
    /// `payments --card-processor` consumers behind the broker's redelivery. Kills arm the
    /// phase driver's crash points (phase-returned, point-committed, response-committed) as
    /// well as SIGKILLs; the checker wants one processor charge and one charge row (with the
    /// processor's ID) per operation, and every record finished or abandoned, none stuck,
    /// once the services' completers had their pass. `--messages` is the operations' count.
    #[arg(long, value_enum, value_name = "SERVICE")]
    pub(crate) phases: Option<PhasesMode>,
    /// `--phases http`: the http-payments processes, sharing one database.
    #[arg(long, default_value_t = 3)]
    pub(crate) servers: usize,
    /// `--phases http`: operations in flight at once.
    #[arg(long, default_value_t = 8)]
    pub(crate) clients: usize,
    /// `--phases http`: share of the operations whose client gives up after its first
    /// attempt fails (no retry): what it left in progress is the completer's to finish.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) give_up_share: f64,
    /// `--phases`: the services' lease: how soon a retry, a takeover or the completer may
    /// resume an operation its killed executor held.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub(crate) lease: Duration,
    /// `--phases`: put a proxy between the services and the processor that replaces each
    /// call's Idempotency-Key by a random one: a service whose foreign key changes between
    /// attempts. The checker must then find doubled charges (the run is expected to fail).
    #[arg(long)]
    pub(crate) scramble_foreign_keys: bool,
    /// `--phases http`: the http-payments binary, built with crash points (default: next to
    /// this one).
    #[arg(long, value_name = "PATH")]
    pub(crate) http_payments: Option<PathBuf>,
}

/// What `--phases` drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PhasesMode {
    /// http-payments services behind retrying clients.
    Http,
    /// payments consumers behind broker redelivery.
    Consumer,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    idem_core::parse_duration(s).map_err(|e| e.to_string())
}

fn main() {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(2);
        }
    };
    // Interrupted, the run's future is dropped, and with it the consumer processes
    // (kill_on_drop): an aborted run leaves no replica consuming behind it.
    let outcome = runtime.block_on(async {
        let interrupted = idem_consumer::shutdown::on_signal();
        tokio::select! {
            r = async {
                match args.phases {
                    Some(PhasesMode::Http) => phases::http::run(args).await,
                    _ => run::run(args).await,
                }
            } => r,
            _ = interrupted.cancelled() => Err(anyhow::anyhow!("interrupted; the run's database and broker objects are left for inspection")),
        }
    });
    match outcome {
        Ok(report) => {
            println!("{}", report.summary());
            println!("{}", report.json());
            std::process::exit(if report.anomalies.is_empty() { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
