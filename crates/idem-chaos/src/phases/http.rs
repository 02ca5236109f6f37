//! `--phases http`: `--servers` `http-payments --card-processor` processes on one database
//! (each on a port of its own that it keeps across restarts), the fake card processor in this
//! process, and `--clients` clients sending `--messages` operations. While the clients work,
//! servers are SIGKILLed at random and (re)started armed at the phase driver's crash points;
//! then every server runs unarmed until each operation is answered (or its client gave up)
//! and no record is left in progress — the servers' completers finish those a client left —
//! and the check runs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use idem_consumer::crash::CrashAt;

use super::clients::Clients;
use super::{Processor, check};
use crate::Args;
use crate::fleet::{Exit, Fleet};
use crate::ledger::RunDatabase;
use crate::report::Report;
use crate::schedule::{Reach, Schedule};

/// How often the run looks at its servers.
const TICK: Duration = Duration::from_millis(100);
/// How long a SIGTERMed server may take to finish its requests.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// The records' table (http-payments keeps idem's default).
const REQUESTS_TABLE: &str = idem_core::DEFAULT_REQUESTS_TABLE;

/// Runs one `--phases http` run and reports; an `Err` is a harness or set-up failure.
pub(crate) async fn run(args: Args) -> Result<Report> {
    let started = Instant::now();
    let tag = format!("phases{}x{}", args.seed, std::process::id());
    let work = args
        .work_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("idem-{tag}")));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let program = locate(args.http_payments.as_deref(), "http-payments")?;
    let db = RunDatabase::create(&args.database, &tag, &work).await?;
    let processor = Processor::start(args.scramble_foreign_keys).await?;

    let servers = args.servers.max(1);
    let ports = free_ports(servers)?;
    let common = vec![
        "--database".to_owned(),
        db.service_url(None),
        "--card-processor".to_owned(),
        processor.url(),
        "--lease".to_owned(),
        format!("{}ms", args.lease.as_millis()),
        "--worker-threads".to_owned(),
        "2".to_owned(),
        // The completer looks for operations left in progress as often as a lease runs out.
        "--completer-interval".to_owned(),
        format!("{}ms", args.lease.as_millis()),
    ];
    let own = ports
        .iter()
        .map(|p| vec!["--listen".to_owned(), format!("127.0.0.1:{p}")])
        .collect();
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs)?;
    let fleet = Fleet::new(program, common, &logs, servers)
        .named("", "server")
        .with_slot_args(own);
    let mut sched = Schedule::new(
        args.seed,
        args.kill_every,
        args.crash_share,
        args.crash_within,
        1,
    );
    let ops = super::operations(&tag, args.messages, || sched.chance(args.give_up_share));
    let mut report = Report {
        broker: "-".to_owned(),
        database: db.engine().to_owned(),
        seed: args.seed,
        consumers: servers,
        unique: ops.len() as u64,
        ..Default::default()
    };
    let mut h = Harness {
        args: &args,
        fleet,
        sched,
        report: &mut report,
        restart_due: Vec::new(),
    };
    // The first server alone until it listens: it creates the tables, as a deployment
    // migrates before it scales out (PostgreSQL refuses concurrent `CREATE TABLE IF NOT
    // EXISTS` of one table with a unique violation on its catalog).
    let first = h.arm();
    h.fleet.start(0, first)?;
    wait_listening(ports[0], Duration::from_secs(60)).await?;
    for slot in 1..servers {
        let armed = h.arm();
        h.fleet.start(slot, armed)?;
    }
    // The operations spread over most of the fault phase, so servers die under them.
    let planned = args
        .kill_every
        .mul_f64(args.kills as f64)
        .max(args.min_fault_time);
    let urls = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let clients = Clients::start(ops.clone(), urls, args.clients, planned.mul_f64(0.9))?;

    // The fault phase.
    let phase_started = Instant::now();
    let mut next_kill = Instant::now() + h.sched.next_kill_in();
    loop {
        tokio::time::sleep(TICK).await;
        h.tend(true)?;
        if h.report.kills < args.kills && Instant::now() >= next_kill {
            let killable: Vec<usize> = (0..servers)
                .filter(|&s| h.fleet.killable(s, args.spare_armed_for))
                .collect();
            if !killable.is_empty() {
                let victim = killable[h.sched.victim(killable.len())];
                if h.fleet.kill(victim) {
                    h.count_kill(None);
                }
                next_kill = Instant::now() + h.sched.next_kill_in();
            }
        }
        if h.report.kills >= args.kills && phase_started.elapsed() >= args.min_fault_time {
            break;
        }
        if phase_started.elapsed() > planned * 4 + args.drain_timeout {
            h.report.anomalies.push(format!(
                "the fault phase did not end: {} kills of {} in {:?}",
                h.report.kills,
                args.kills,
                phase_started.elapsed()
            ));
            break;
        }
    }

    // The drain: every server unarmed (those armed still may abort), until every operation
    // is answered or given up and no record is in progress at a recovery point.
    let drain_started = Instant::now();
    loop {
        tokio::time::sleep(TICK * 5).await;
        h.tend(false)?;
        if clients.done() {
            match db.request_keys(REQUESTS_TABLE).await {
                Ok(keys) if keys.stuck.is_empty() => break,
                Ok(_) => {}
                Err(e) => eprintln!("idem-chaos: reading the records failed: {e:#}"),
            }
        }
        if drain_started.elapsed() > args.drain_timeout {
            h.report.anomalies.push(format!(
                "not drained {:?} after the faults: {} of {} operations answered or given up",
                args.drain_timeout,
                clients.finished(),
                ops.len()
            ));
            break;
        }
    }
    let tally = clients.stop().await;
    let stops = h.fleet.stop_all(STOP_GRACE).await;
    let tails = h.fleet.log_tails(15);
    for (slot, exit) in stops {
        if !matches!(exit, Exit::Clean) {
            report.anomalies.push(format!(
                "server {slot} did not stop cleanly on SIGTERM: {exit:?}"
            ));
        }
    }
    let stats = processor.stats();
    let mut figures = check::check(
        &db,
        REQUESTS_TABLE,
        &ops,
        &stats,
        &tally,
        &mut report.anomalies,
    )
    .await?;
    figures.service = "http".to_owned();
    figures.scrambled_foreign_keys = args.scramble_foreign_keys;
    report.effects = figures.charge_rows;
    report.duplicated = figures.doubled_effects + figures.doubled_rows;
    report.lost = figures.answered_without_effect;
    report.duplicated_ids = figures.doubled_ids.clone();
    report.phases = Some(figures);
    if report.kills < args.kills {
        report.anomalies.push(format!(
            "{} kills of the {} asked for",
            report.kills, args.kills
        ));
    }
    report.elapsed_secs = started.elapsed().as_secs_f64();
    if report.anomalies.is_empty() && !args.keep {
        db.drop_database().await?;
        let _ = std::fs::remove_dir_all(&work);
    } else {
        report.logs = Some(logs.display().to_string());
        if !report.anomalies.is_empty() {
            eprintln!("{tails}");
        }
    }
    Ok(report)
}

/// The servers of a run and the fault bookkeeping.
struct Harness<'a> {
    args: &'a Args,
    fleet: Fleet,
    sched: Schedule,
    report: &'a mut Report,
    /// Slots to start again, and when.
    restart_due: Vec<(usize, Instant)>,
}

impl Harness<'_> {
    /// The crash point for a (re)start while kills remain to be done.
    fn arm(&mut self) -> Option<CrashAt> {
        if self.report.kills < self.args.kills {
            self.sched.arm(Reach::Phases)
        } else {
            None
        }
    }

    /// Counts a kill: a SIGKILL, or an abort at `point`.
    fn count_kill(&mut self, point: Option<idem_consumer::crash::CrashPoint>) {
        self.report.kills += 1;
        self.report.consumer_kills += 1;
        match point {
            Some(p) => {
                self.report.crash_point_aborts += 1;
                *self.report.aborts_at.entry(p.to_string()).or_default() += 1;
            }
            None => self.report.sigkills += 1,
        }
    }

    /// Reaps ended servers, counts how they ended, and restarts them when due (armed while
    /// `faults`).
    fn tend(&mut self, faults: bool) -> Result<()> {
        let now = Instant::now();
        for (slot, exit) in self.fleet.reap() {
            let delay = match exit {
                Exit::Killed => Duration::from_millis(200),
                Exit::Crashed(at) => {
                    self.count_kill(Some(at.point));
                    Duration::from_millis(200)
                }
                Exit::Clean | Exit::Failed(..) => {
                    self.report.failed_exits += 1;
                    self.report.anomalies.push(format!(
                        "server {slot} exited on its own ({exit:?}) with no fault of the run's"
                    ));
                    Duration::from_secs(1)
                }
            };
            self.restart_due.push((slot, now + delay));
        }
        let (due, later): (Vec<_>, Vec<_>) =
            self.restart_due.drain(..).partition(|(_, at)| *at <= now);
        self.restart_due = later;
        for (slot, _) in due {
            let armed = if faults { self.arm() } else { None };
            self.fleet.start(slot, armed)?;
            self.report.restarts += 1;
        }
        Ok(())
    }
}

/// Waits until something accepts connections on loopback `port`.
async fn wait_listening(port: u16, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the first server did not listen on port {port} within {within:?}");
        }
        tokio::time::sleep(TICK).await;
    }
}

/// `n` loopback ports free now: each server keeps its own across restarts, so a client's
/// retry finds it again.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .context("finding free ports for the servers")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The service binary `name`: `given`, else next to this executable (where `cargo build`
/// puts both).
pub(crate) fn locate(given: Option<&Path>, name: &str) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_owned());
    }
    let me = std::env::current_exe()?;
    let dir = me.parent().context("no parent folder")?;
    for candidate in [dir.join(name), dir.join("..").join(name)] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "no {name} binary next to {}: build it with `cargo build -p {name} -p idem-chaos` (which \
         compiles the crash points in) or pass its path",
        me.display()
    )
}
