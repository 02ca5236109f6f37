//! One run: set up, inject faults while the consumers work, drain, check.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::broker::{Broker, Names};
use crate::faults::nats_cluster::NatsCluster;
use crate::faults::postgres;
use crate::faults::proxy::CutProxy;
use crate::fleet::{Exit, Fleet};
use crate::ledger::{RunDatabase, Sent};
use crate::mosquitto::Mosquitto;
use crate::phases::clients::Tally;
use crate::phases::{Op, Processor, check};
use crate::report::Report;
use crate::schedule::{Reach, Schedule};
use crate::{Args, PhasesMode};

/// The outbox the consumers write and the relays read (idem's default name).
const OUTBOX_TABLE: &str = idem_core::DEFAULT_OUTBOX_TABLE;
/// `--phases consumer`: the charges' records (payments keeps idem's default table).
const REQUESTS_TABLE: &str = idem_core::DEFAULT_REQUESTS_TABLE;
/// How often the run looks at its consumers and the ledger.
const TICK: Duration = Duration::from_millis(100);
/// How long a drain may make no progress, with messages left, before the harness checks
/// whether the broker left partitions to no consumer (`Run::unorphan`).
const STALL: Duration = Duration::from_secs(20);
/// How long a SIGTERMed consumer may take to finish its in-flight messages.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// MQTT: how long the drain's end conditions must hold with nothing changing, since the
/// broker's store count is up to a second old.
const MQTT_QUIET: Duration = Duration::from_secs(3);
/// Publishing is spread over the fault phase in this many slices, so consumers have work
/// while they are being killed.
const PUBLISH_SLICES: usize = 40;

/// Runs the whole thing and reports; an `Err` is a harness or set-up failure, not a finding.
pub(crate) async fn run(args: Args) -> Result<Report> {
    let started = Instant::now();
    let tag = format!("chaos{}x{}", args.seed, std::process::id());
    let work = args
        .work_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("idem-{tag}")));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let payments = locate_payments(&args)?;
    let idem = match (args.two_hop, args.relays) {
        (true, n) if n > 0 => Some(locate_idem(&args)?),
        (false, n) if n > 0 => bail!("--relays runs the outbox relays of --two-hop; add --two-hop"),
        _ => None,
    };
    let postgres = ["postgres:", "postgresql:"]
        .iter()
        .any(|s| args.database.to_ascii_lowercase().starts_with(s));
    if !postgres && (args.restart_database > 0 || args.failover > 0 || args.cut_connections) {
        bail!(
            "--restart-database, --failover and --cut-connections act on a PostgreSQL server; \
             on SQLite and MySQL a run kills processes only"
        );
    }

    let mut broker = Broker::parse(
        args.broker
            .as_deref()
            .context("--broker is required (but with --phases http)")?,
    )?;
    if broker.kind() == idem_any::Broker::Kafka {
        check_kafka_broker(broker.address()).await?;
    }
    let mut cluster = None;
    if args.restart_broker > 0 {
        if broker.kind() != idem_any::Broker::Nats {
            bail!(
                "--restart-broker is for NATS (a 3-node JetStream cluster of the harness's own); \
                 use --restart-database, --failover or --cut-connections with other brokers"
            );
        }
        let c = NatsCluster::start(&args.nats_server, &work.join("nats")).await?;
        broker = Broker::parse(&c.url())?;
        cluster = Some(c);
    }
    // MQTT: a broker of the run's own (see `mosquitto`); --broker gave the scheme.
    let mut mosquitto = None;
    if broker.kind() == idem_any::Broker::Mqtt {
        let m = Mosquitto::start(&args.mosquitto, &work.join("mosquitto")).await?;
        broker = Broker::parse(&m.url())?;
        mosquitto = Some(m);
    }
    let names = Names {
        source: tag.clone(),
        consumer: format!("{tag}-group"),
    };
    // --two-hop: where the relay publishes, and the second consumer's group.
    let hop = args.two_hop.then(|| Names {
        source: format!("{tag}-charged"),
        consumer: format!("{tag}-receipts"),
    });
    let phased = args.phases == Some(PhasesMode::Consumer);
    if phased && args.two_hop {
        bail!("--phases consumer runs one hop; leave --two-hop out");
    }
    let db = RunDatabase::create(&args.database, &tag, &work).await?;
    // --phases consumer: the card processor every consumer charges through.
    let processor = match phased {
        true => Some(Processor::start(args.scramble_foreign_keys).await?),
        false => None,
    };
    let mut sched = Schedule::new(
        args.seed,
        args.kill_every,
        args.crash_share,
        args.crash_within,
        args.batch,
    );
    let proxy = match args.cut_connections {
        true => Some(CutProxy::start(db.host_port()?, args.cut_share, sched.fork()).await?),
        false => None,
    };
    let consumer_db = db.service_url(proxy.as_ref().map(|p| p.port));
    let sent = sched.messages(&tag, args.messages, args.duplicates, phased);

    let common = |names: &Names| {
        let mut common = vec![
            "--broker".to_owned(),
            broker.url(),
            "--source".to_owned(),
            names.source.clone(),
            "--database".to_owned(),
            consumer_db.clone(),
            "--consumer".to_owned(),
            names.consumer.clone(),
            "--concurrency".to_owned(),
            args.concurrency.to_string(),
            "--redeliver-after".to_owned(),
            format!("{}ms", args.redeliver_after.as_millis()),
        ];
        if !args.kafka_static_membership {
            // payments joins Kafka groups statically by default; see --kafka-static-membership.
            common.push("--dynamic-membership".to_owned());
        }
        common
    };
    let mut service_args = common(&names);
    service_args.extend(["--batch".to_owned(), args.batch.to_string()]);
    if args.local_cache {
        service_args.extend(["--local-cache".to_owned(), "100000".to_owned()]);
    }
    if let Some(p) = &processor {
        service_args.extend([
            "--card-processor".to_owned(),
            p.url(),
            "--phase-lease".to_owned(),
            format!("{}ms", args.lease.as_millis()),
        ]);
    }
    if let Some(hop) = &hop {
        service_args.extend(["--emit".to_owned(), hop.source.clone()]);
        if idem.is_some() {
            service_args.push("--no-relay".to_owned());
        }
    }
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs)?;
    let receipts = match &hop {
        Some(hop) => {
            let receipt_logs = logs.join("receipts");
            std::fs::create_dir_all(&receipt_logs)?;
            let mut receipt_args = common(hop);
            receipt_args.push("--receipts".to_owned());
            // Instance names of their own: on MQTT they are client IDs, one broker-wide
            // namespace for both hops.
            Some(
                Fleet::new(
                    payments.clone(),
                    receipt_args,
                    &receipt_logs,
                    args.receipt_consumers.max(1),
                )
                .named("--instance", "receipts"),
            )
        }
        None => None,
    };
    // `--relays N`: standalone `idem relay` processes over the run's outbox.
    let relays = match &idem {
        Some(idem) => {
            let relay_args = vec![
                "relay".to_owned(),
                "--database".to_owned(),
                consumer_db.clone(),
                "--broker".to_owned(),
                broker.url(),
                "--poll".to_owned(),
                "200ms".to_owned(),
            ];
            Some(Fleet::new(idem.clone(), relay_args, &logs, args.relays).named("--name", "relay"))
        }
        None => None,
    };
    let fleet = Fleet::new(payments, service_args, &logs, args.consumers.max(1));
    let replicas = if cluster.is_some() { 3 } else { 1 };
    let partitions = args.partitions.unwrap_or(args.consumers.max(1) as i32);
    broker
        .prepare(&names, partitions, replicas, &fleet.instances())
        .await?;
    if let (Some(hop), Some(receipts)) = (&hop, &receipts) {
        broker
            .prepare(
                hop,
                args.receipt_consumers.max(1) as i32,
                replicas,
                &receipts.instances(),
            )
            .await?;
    }

    let mut run = Run {
        args: &args,
        broker: &broker,
        names: &names,
        db: &db,
        proxy: proxy.as_ref(),
        cluster,
        sched,
        fleet,
        hop: hop.as_ref(),
        receipts,
        relays,
        receipted: 0,
        processor: processor.as_ref(),
        sent: &sent,
        report: Report {
            broker: broker.redacted(),
            database: db.engine().to_owned(),
            seed: args.seed,
            consumers: args.consumers,
            receipt_consumers: if args.two_hop {
                args.receipt_consumers.max(1)
            } else {
                0
            },
            relays: args.relays,
            sent: sent.publishes.len() as u64,
            unique: sent.unique.len() as u64,
            ..Default::default()
        },
        restart_due: Vec::new(),
        kill_all_done: 0,
        read_only_until: None,
        charged: 0,
        charged_unread: None,
        last_progress_check: None,
    };
    let outcome = run.drive().await;
    // Whatever happened, never leave the database read-only behind.
    if run.read_only_until.is_some() {
        let _ = postgres::make_read_only(&db, false).await;
    }
    // Upstream first: the consumers, then the relays, then the second hop.
    let mut stops = Vec::new();
    for role in [Role::Charge, Role::Relay, Role::Receipts] {
        if let Some(fleet) = run.fleet_mut(role) {
            for (slot, exit) in fleet.stop_all(STOP_GRACE).await {
                stops.push((format!("{} {slot}", role.name()), exit));
            }
        }
    }
    let mut report = match outcome {
        Ok(()) => run.check(stops).await?,
        Err(e) => {
            eprintln!("{}", run.log_tails(20));
            return Err(e.context(format!("run aborted; logs in {}", logs.display())));
        }
    };
    if let Some(c) = &run.cluster {
        report.broker_restarts = c.restarts();
    }
    report.elapsed_secs = started.elapsed().as_secs_f64();
    if let Some(m) = mosquitto {
        m.stop().await;
    }
    if report.anomalies.is_empty() && !args.keep {
        let _ = broker.teardown(&names).await;
        if let Some(hop) = &hop {
            let _ = broker.teardown(hop).await;
        }
        drop(run);
        db.drop_database().await?;
        let _ = std::fs::remove_dir_all(&work);
    } else {
        report.logs = Some(logs.display().to_string());
        if !report.anomalies.is_empty() {
            eprintln!("{}", run.log_tails(15));
        }
    }
    Ok(report)
}

/// The payments binary: `--payments`, else next to this executable (where `cargo build`
/// puts both).
fn locate_payments(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.payments {
        return Ok(p.clone());
    }
    let me = std::env::current_exe()?;
    let dir = me.parent().context("no parent folder")?;
    for candidate in [dir.join("payments"), dir.join("../payments")] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "no payments binary next to {}: build it with `cargo build -p payments --features crash-points` or pass --payments",
        me.display()
    )
}

/// The `idem` binary for `--relays`: `--idem`, else next to this executable.
fn locate_idem(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.idem {
        return Ok(p.clone());
    }
    let me = std::env::current_exe()?;
    let dir = me.parent().context("no parent folder")?;
    for candidate in [dir.join("idem"), dir.join("../idem")] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "no idem binary next to {}: build it with `cargo build -p idem-cli` or pass --idem",
        me.display()
    )
}

/// Refuses to run on a Kafka-protocol broker that skips records when a consumer fetches from
/// inside a stored batch (tansu's memory engine does): its losses would be counted as idem's,
/// or hide idem's. Runs idem-kafka's `check_broker` example, which the workspace build puts in
/// `examples/` next to this binary.
async fn check_kafka_broker(hosts: &str) -> Result<()> {
    let me = std::env::current_exe()?;
    let check = me
        .parent()
        .context("no parent folder")?
        .join("examples/check_broker");
    if !check.is_file() {
        bail!(
            "no {}: build it with `cargo build -p idem-kafka --example check_broker`; a Kafka run \
             needs the broker checked first",
            check.display()
        );
    }
    let out = tokio::process::Command::new(&check)
        .arg(hosts)
        .output()
        .await
        .context("running check_broker")?;
    if !out.status.success() {
        bail!(
            "the broker at {hosts} fails the mid-batch fetch check ({}), so a run on it would \
             measure the broker: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The kinds of process a run starts, kills and restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The first hop: `payments` charging (with `--two-hop`, writing the outbox and, without
    /// `--relays`, relaying it in process).
    Charge,
    /// The second hop: `payments --receipts`.
    Receipts,
    /// `--relays`: `idem relay`.
    Relay,
}

impl Role {
    const ALL: [Role; 3] = [Role::Charge, Role::Receipts, Role::Relay];

    fn name(self) -> &'static str {
        match self {
            Role::Charge => "consumer",
            Role::Receipts => "receipts consumer",
            Role::Relay => "relay",
        }
    }
}

struct Run<'a> {
    args: &'a Args,
    broker: &'a Broker,
    names: &'a Names,
    db: &'a RunDatabase,
    proxy: Option<&'a CutProxy>,
    cluster: Option<NatsCluster>,
    sched: Schedule,
    fleet: Fleet,
    /// `--two-hop`: the relayed events' destination and the second consumer's group.
    hop: Option<&'a Names>,
    /// `--two-hop`: the second hop's consumers.
    receipts: Option<Fleet>,
    /// `--relays`: the standalone relays.
    relays: Option<Fleet>,
    /// `--two-hop`: distinct payments with a receipt, at the last count.
    receipted: u64,
    /// `--phases consumer`: the card processor the consumers charge through.
    processor: Option<&'a Processor>,
    sent: &'a Sent,
    report: Report,
    /// Replicas to start again, and when.
    restart_due: Vec<(Role, usize, Instant)>,
    kill_all_done: usize,
    read_only_until: Option<Instant>,
    charged: u64,
    /// Why the last count of charged IDs failed, while it keeps failing.
    charged_unread: Option<String>,
    last_progress_check: Option<Instant>,
}

impl Run<'_> {
    /// The run's hops on the broker: the first, and `--two-hop`'s second.
    fn hops(&self) -> Vec<&Names> {
        std::iter::once(self.names).chain(self.hop).collect()
    }

    fn fleet_mut(&mut self, role: Role) -> Option<&mut Fleet> {
        match role {
            Role::Charge => Some(&mut self.fleet),
            Role::Receipts => self.receipts.as_mut(),
            Role::Relay => self.relays.as_mut(),
        }
    }

    fn fleet(&self, role: Role) -> Option<&Fleet> {
        match role {
            Role::Charge => Some(&self.fleet),
            Role::Receipts => self.receipts.as_ref(),
            Role::Relay => self.relays.as_ref(),
        }
    }

    /// Which crash points a replica of `role` can reach.
    fn reach(&self, role: Role) -> Reach {
        match role {
            Role::Charge if self.processor.is_some() => Reach::ConsumerAndPhases,
            Role::Charge if self.hop.is_some() && self.relays.is_none() => Reach::ConsumerAndRelay,
            Role::Charge | Role::Receipts => Reach::Consumer,
            Role::Relay => Reach::Relay,
        }
    }

    fn log_tails(&self, lines: usize) -> String {
        Role::ALL
            .iter()
            .filter_map(|r| self.fleet(*r))
            .map(|f| f.log_tails(lines))
            .collect()
    }

    /// Counts a kill (a SIGKILL, or an abort at `point`) of a replica of `role`.
    fn count_kill(&mut self, role: Role, point: Option<idem_consumer::crash::CrashPoint>) {
        self.report.kills += 1;
        match point {
            Some(p) => {
                self.report.crash_point_aborts += 1;
                *self.report.aborts_at.entry(p.to_string()).or_default() += 1;
            }
            None => self.report.sigkills += 1,
        }
        *match role {
            Role::Charge => &mut self.report.consumer_kills,
            Role::Receipts => &mut self.report.receipt_consumer_kills,
            Role::Relay => &mut self.report.relay_kills,
        } += 1;
    }

    async fn drive(&mut self) -> Result<()> {
        // The second hop first, so its source exists before the relays publish; the relays
        // after the consumers, which create the outbox table.
        for role in [Role::Receipts, Role::Charge, Role::Relay] {
            let n = self.fleet(role).map_or(0, Fleet::len);
            if role == Role::Relay && n > 0 {
                self.wait_for_outbox().await?;
            }
            for slot in 0..n {
                let armed = self.arm_next(role);
                if let Some(fleet) = self.fleet_mut(role) {
                    fleet.start(slot, armed)?;
                }
            }
        }
        let planned = self
            .args
            .kill_every
            .mul_f64(self.args.kills as f64)
            .max(self.args.min_fault_time);
        let mut publishing = tokio::spawn(publish(
            self.broker.clone(),
            self.names.clone(),
            self.sent.publishes.clone(),
            planned,
        ));
        let mut publish_done = false;
        if let Some(p) = self.proxy {
            p.state.arm(true);
        }

        // The fault phase.
        let phase_started = Instant::now();
        let mut next_kill = Instant::now() + self.sched.next_kill_in();
        let (mut db_restarts, mut failovers, mut broker_restarts) = (0u64, 0u64, 0u64);
        loop {
            tokio::time::sleep(TICK).await;
            if !publish_done && publishing.is_finished() {
                self.report.broker_dropped_repeats = (&mut publishing)
                    .await
                    .context("publisher task")?
                    .context("publishing")?;
                publish_done = true;
            }
            self.tend(true)?;
            self.kill_all_when_due().await?;
            let phase = if self.args.kills > 0 {
                self.report.kills as f64 / self.args.kills as f64
            } else {
                phase_started.elapsed().as_secs_f64()
                    / self.args.min_fault_time.as_secs_f64().max(1e-3)
            };
            if self.report.kills < self.args.kills && Instant::now() >= next_kill {
                let spare = self.args.spare_armed_for;
                // Every replica of every kind is a candidate: the consumers of both hops and
                // the relays.
                let killable: Vec<(Role, usize)> = Role::ALL
                    .iter()
                    .filter_map(|r| self.fleet(*r).map(|f| (*r, f)))
                    .flat_map(|(r, f)| {
                        (0..f.len())
                            .filter(move |&slot| f.killable(slot, spare))
                            .map(move |slot| (r, slot))
                    })
                    .collect();
                // With none killable (all armed and young, or restarting) the kill waits for
                // the next tick rather than being dropped.
                if !killable.is_empty() {
                    let (role, victim) = killable[self.sched.victim(killable.len())];
                    if self.fleet_mut(role).is_some_and(|f| f.kill(victim)) {
                        self.count_kill(role, None);
                    }
                    next_kill = Instant::now() + self.sched.next_kill_in();
                }
            }
            if due(db_restarts, self.args.restart_database, phase) {
                db_restarts += 1;
                eprintln!("idem-chaos: restarting PostgreSQL");
                postgres::restart(self.args.restart_database_command.as_deref()).await?;
                postgres::wait_until_up(self.db, Duration::from_secs(60)).await?;
                self.report.database_restarts += 1;
            }
            if self.read_only_until.is_none() && due(failovers, self.args.failover, phase) {
                failovers += 1;
                eprintln!("idem-chaos: failing the database over to read-only");
                postgres::make_read_only(self.db, true).await?;
                self.read_only_until = Some(Instant::now() + self.args.failover_for);
                self.report.failovers += 1;
            }
            if self
                .read_only_until
                .is_some_and(|until| Instant::now() >= until)
            {
                postgres::make_read_only(self.db, false).await?;
                self.read_only_until = None;
            }
            if let Some(cluster) = self.cluster.as_mut()
                && due(broker_restarts, self.args.restart_broker, phase)
            {
                eprintln!("idem-chaos: restarting NATS node {}", broker_restarts % 3);
                cluster
                    .restart_node(broker_restarts as usize, Duration::from_secs(1))
                    .await?;
                broker_restarts += 1;
            }
            let faults_done = self.report.kills >= self.args.kills
                && db_restarts >= self.args.restart_database
                && failovers >= self.args.failover
                && broker_restarts >= self.args.restart_broker
                && self.read_only_until.is_none()
                && phase_started.elapsed() >= self.args.min_fault_time;
            if faults_done && publish_done {
                break;
            }
        }
        if let Some(p) = self.proxy {
            p.state.arm(false);
        }

        // Drain: every replica up and unarmed, until all is committed and acknowledged.
        let drain_started = Instant::now();
        let mut progress = (self.charged + self.receipted, Instant::now());
        // MQTT: since when the end conditions have held, tick after tick.
        let mut quiet_since: Option<Instant> = None;
        loop {
            tokio::time::sleep(TICK * 5).await;
            self.tend(false)?;
            self.kill_all_when_due().await?;
            self.count_charged().await;
            let backlog = self.broker.backlog_of(&self.hops()).await.ok().flatten();
            // Rows published and not yet marked sent are published again: the run ends with
            // none, or a late repeat would reach the second hop after the check.
            let mut unsent = Some(0);
            if self.hop.is_some() {
                if let Ok(n) = self.db.receipted_ids().await {
                    self.receipted = n;
                }
                unsent = self.db.unsent_outbox_rows(OUTBOX_TABLE).await.ok();
            }
            let receipted = self.hop.is_none() || self.receipted >= self.report.unique;
            // --phases consumer: no record left in progress at a recovery point (a charge
            // whose redelivery is still to come, or the completer's to finish); a payment
            // whose operation was given up has no charge, and is done.
            let (settled, abandoned) = match self.processor {
                None => (true, 0),
                Some(_) => match self.db.request_keys(REQUESTS_TABLE).await {
                    Ok(keys) => (keys.stuck.is_empty(), keys.abandoned.len() as u64),
                    Err(_) => (false, 0),
                },
            };
            // Progress on either hop.
            let done = self.charged + self.receipted;
            if done > progress.0 {
                progress = (done, Instant::now());
            } else if progress.1.elapsed() >= STALL && backlog.is_some_and(|b| b > 0) {
                self.unorphan().await;
                progress.1 = Instant::now();
            }
            let all_kills = self.kill_all_done >= self.args.kill_all_at.len();
            if all_kills
                && self.charged + abandoned >= self.report.unique
                && receipted
                && backlog == Some(0)
                && unsent == Some(0)
                && settled
            {
                if self.broker.kind() != idem_any::Broker::Mqtt {
                    return Ok(());
                }
                match quiet_since {
                    Some(since) if since.elapsed() >= MQTT_QUIET => return Ok(()),
                    Some(_) => {}
                    None => quiet_since = Some(Instant::now()),
                }
            } else {
                quiet_since = None;
            }
            if drain_started.elapsed() > self.args.drain_timeout {
                let unread = match &self.charged_unread {
                    Some(e) => format!(" (the last count failed: {e})"),
                    None => String::new(),
                };
                let second = match self.hop {
                    Some(_) => format!(", {} receipted", self.receipted),
                    None => String::new(),
                };
                self.report.anomalies.push(format!(
                    "not drained {:?} after the faults: {} of {} IDs charged{second}{unread}, backlog {backlog:?}, unsent outbox rows {unsent:?}",
                    self.args.drain_timeout, self.charged, self.report.unique
                ));
                return Ok(());
            }
        }
    }

    /// The drain has stalled with messages left: if the running consumers of a hop hold fewer
    /// partitions than the topic has (by their own rebalance logs), the broker's group left
    /// some to no member (a tansu fault, RELIABILITY.md): count them and make the group
    /// rebalance. Partitions a consumer holds and does not consume are not touched: that would
    /// be idem's stall, and the drain timeout reports it.
    async fn unorphan(&mut self) {
        let hops = [(Role::Charge, Some(self.names)), (Role::Receipts, self.hop)];
        for (role, names) in hops {
            let (Some(names), Some(fleet)) = (names, self.fleet(role)) else {
                continue;
            };
            let total = match self.broker.partitions(names).await {
                Ok(Some(n)) => n,
                Ok(None) => continue,
                Err(e) => {
                    eprintln!("idem-chaos: reading the topic's partitions failed: {e:#}");
                    continue;
                }
            };
            let held = fleet.held_partitions();
            if held >= total {
                continue;
            }
            eprintln!(
                "idem-chaos: the {}s hold {held} of {total} partitions: the broker's group \
                 left {} to no member (a broker fault); making the group rebalance",
                role.name(),
                total - held
            );
            self.report.broker_orphaned_partitions += (total - held) as u64;
            if let Err(e) = self.broker.nudge_group(names).await {
                eprintln!("idem-chaos: the rebalance nudge failed: {e:#}");
            }
        }
    }

    /// Reads how many IDs are charged. A failed read (the database restarting under a fault,
    /// or out of connections) keeps the last count and is said once, so a drain that times
    /// out on a count the harness could not read says so instead of showing a stale figure.
    async fn count_charged(&mut self) {
        match self.db.charged_ids().await {
            Ok(n) => {
                self.charged = n;
                self.charged_unread = None;
            }
            Err(e) => {
                let e = format!("{e:#}");
                if self.charged_unread.is_none() {
                    eprintln!(
                        "idem-chaos: counting charged IDs failed (keeping {}): {e}",
                        self.charged
                    );
                }
                self.charged_unread = Some(e);
            }
        }
    }

    /// Waits until the consumers have created the outbox table: a relay deployed beside a
    /// service starts after its migration (a relay finding no outbox stops: a
    /// misconfiguration, not an outage).
    async fn wait_for_outbox(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.db.has_table(OUTBOX_TABLE).await.unwrap_or(false) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the consumers created no {OUTBOX_TABLE} table within 60 s");
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// The crash point for a (re)start of a replica of `role` while kills remain to be done.
    fn arm_next(&mut self, role: Role) -> Option<idem_consumer::crash::CrashAt> {
        if self.report.kills < self.args.kills {
            let reach = self.reach(role);
            self.sched.arm(reach)
        } else {
            None
        }
    }

    /// Reaps ended replicas, counts how they ended, and restarts them when due.
    fn tend(&mut self, faults: bool) -> Result<()> {
        let now = Instant::now();
        for role in Role::ALL {
            let ended = match self.fleet_mut(role) {
                Some(fleet) => fleet.reap(),
                None => continue,
            };
            for (slot, exit) in ended {
                let delay = match exit {
                    Exit::Killed => Duration::from_millis(200),
                    Exit::Crashed(at) => {
                        self.count_kill(role, Some(at.point));
                        Duration::from_millis(200)
                    }
                    Exit::Clean | Exit::Failed(..) => {
                        self.report.failed_exits += 1;
                        if !self.faults_configured() {
                            self.report.anomalies.push(format!(
                                "{} {slot} exited on its own ({exit:?}) with no database or broker fault in the run",
                                role.name()
                            ));
                        }
                        // A supervisor's back-off, e.g. while the database is read-only.
                        Duration::from_secs(1)
                    }
                };
                self.restart_due.push((role, slot, now + delay));
            }
        }
        let (due, later): (Vec<_>, Vec<_>) = self
            .restart_due
            .drain(..)
            .partition(|(_, _, at)| *at <= now);
        self.restart_due = later;
        for (role, slot, _) in due {
            let armed = if faults { self.arm_next(role) } else { None };
            if let Some(fleet) = self.fleet_mut(role) {
                fleet.start(slot, armed)?;
            }
            self.report.restarts += 1;
        }
        Ok(())
    }

    fn faults_configured(&self) -> bool {
        self.args.restart_database > 0
            || self.args.failover > 0
            || self.args.restart_broker > 0
            || self.args.cut_connections
    }

    /// `--kill-all-at`: SIGKILLs every replica once the committed share passes a mark.
    async fn kill_all_when_due(&mut self) -> Result<()> {
        let Some(mark) = self.args.kill_all_at.get(self.kill_all_done).copied() else {
            return Ok(());
        };
        let now = Instant::now();
        if self
            .last_progress_check
            .is_some_and(|t| now - t < Duration::from_millis(500))
        {
            return Ok(());
        }
        self.last_progress_check = Some(now);
        self.count_charged().await;
        if (self.charged as f64) < mark * self.report.unique as f64 {
            return Ok(());
        }
        eprintln!(
            "idem-chaos: {} of {} committed, killing every consumer",
            self.charged, self.report.unique
        );
        for slot in 0..self.fleet.len() {
            if self.fleet.kill(slot) {
                self.count_kill(Role::Charge, None);
            }
        }
        self.kill_all_done += 1;
        Ok(())
    }

    /// The ledger, the broker's leftovers and the consumers' last exits, into the report.
    async fn check(&mut self, stops: Vec<(String, Exit)>) -> Result<Report> {
        let mut report = std::mem::take(&mut self.report);
        for (who, exit) in stops {
            if !matches!(exit, Exit::Clean) {
                report
                    .anomalies
                    .push(format!("{who} did not stop cleanly on SIGTERM: {exit:?}"));
            }
        }
        // --phases consumer: a payment whose operation was given up has no charge by design.
        let abandoned = match self.processor {
            Some(_) => self.db.request_keys(REQUESTS_TABLE).await?.abandoned,
            None => Default::default(),
        };
        let ledger = self.db.check(self.sent, &abandoned).await?;
        report.effects = ledger.effects;
        report.lost = ledger.lost;
        report.duplicated = ledger.duplicated;
        report.unexpected = ledger.unexpected;
        report.balance_matches = ledger.balance_matches;
        report.lost_ids = ledger.lost_ids;
        report.duplicated_ids = ledger.duplicated_ids;
        report.dead_lettered = self.broker.dead_letters(self.names).await?;
        report.backlog = self.broker.backlog_of(&self.hops()).await?.unwrap_or(0);
        if let Some(hop) = self.hop {
            let receipts = self.db.check_receipts(self.sent).await?;
            report.receipts = receipts.receipts;
            report.receipts_lost = receipts.lost;
            report.receipts_duplicated = receipts.duplicated;
            report.receipts_unexpected = receipts.unexpected;
            report.receipts_lost_ids = receipts.lost_ids;
            report.receipts_duplicated_ids = receipts.duplicated_ids;
            report.dead_lettered += self.broker.dead_letters(hop).await?;
        }
        if let Some(p) = self.proxy {
            report.cuts_before_commit = p.state.cuts_before.load(Ordering::SeqCst);
            report.cuts_after_commit = p.state.cuts_after.load(Ordering::SeqCst);
            report.cuts = p.state.cuts();
            report.commits_seen = p.state.commits_seen.load(Ordering::SeqCst);
            report.proxied_connections = p.state.connections.load(Ordering::SeqCst);
            if report.cuts == 0 {
                report
                    .anomalies
                    .push("--cut-connections cut no connection: the fault never happened".into());
            }
        }
        for (what, n) in [
            ("lost", report.lost),
            ("duplicated", report.duplicated),
            ("unexpected", report.unexpected),
            ("dead-lettered", report.dead_lettered),
            ("left on the broker", report.backlog),
            ("payments without a receipt", report.receipts_lost),
            ("receipts doubled", report.receipts_duplicated),
            (
                "receipts for payments never sent",
                report.receipts_unexpected,
            ),
        ] {
            if n > 0 {
                report.anomalies.push(format!("{n} {what}"));
            }
        }
        if !report.balance_matches {
            report
                .anomalies
                .push("account balances differ from the charges".into());
        }
        if let Some(processor) = self.processor {
            // Each payment is an operation: its ID is its account (`Schedule::messages`).
            let ops: Vec<Op> = self
                .sent
                .unique
                .iter()
                .enumerate()
                .map(|(index, (id, amount))| Op {
                    index,
                    key: id.clone(),
                    account: id.clone(),
                    amount_cents: *amount,
                    give_up: false,
                })
                .collect();
            let mut figures = check::check(
                self.db,
                REQUESTS_TABLE,
                &ops,
                &processor.stats(),
                &Tally::default(),
                &mut report.anomalies,
            )
            .await?;
            figures.service = "consumer".to_owned();
            figures.scrambled_foreign_keys = self.args.scramble_foreign_keys;
            report.phases = Some(figures);
        }
        if report.kills < self.args.kills {
            report.anomalies.push(format!(
                "{} kills of the {} asked for",
                report.kills, self.args.kills
            ));
        }
        Ok(report)
    }
}

/// Whether the `done`-th of `total` evenly spread faults is due at `phase` (0 → 1).
fn due(done: u64, total: u64, phase: f64) -> bool {
    done < total && phase >= (done + 1) as f64 / (total + 1) as f64
}

/// Publishes `msgs` in slices spread over `over`, retrying a failed slice (its messages are
/// then published again: repeats, which is what a producer's retry makes too).
async fn publish(
    broker: Broker,
    names: Names,
    msgs: Vec<(String, Vec<u8>)>,
    over: Duration,
) -> Result<u64> {
    let publisher = broker.publisher(&names).await?;
    let slice = msgs.len().div_ceil(PUBLISH_SLICES).max(1);
    let pause = over / PUBLISH_SLICES as u32;
    let mut dropped = 0;
    for chunk in msgs.chunks(slice) {
        let mut tries = 0;
        loop {
            match publisher.publish_all(chunk).await {
                Ok(n) => {
                    dropped += n;
                    break;
                }
                Err(e) if tries < 20 => {
                    tries += 1;
                    eprintln!("idem-chaos: publishing failed ({e:#}); retrying the slice");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
        tokio::time::sleep(pause).await;
    }
    Ok(dropped)
}
