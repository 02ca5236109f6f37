//! `idem-bench`: the same handler (insert a charge, update a balance) with and without the
//! idempotency claim, measured side by side in one run.
//!
//! This file owns the options, the order in which scenarios run and the report. The
//! scenarios live in [`postgres`] (P1 per message, P2 batched, and pruning under load) and
//! [`sqlite`] (P3); the timing loop and the interleaving of rounds in [`measure`]; the message
//! stream in [`workload`].
//!
//! Each scenario compares variants of one workload, so the report gives ratios to the bare
//! variant of the same table rather than absolute numbers across tables: absolute rates depend
//! on the disk's fsync latency and the core count far more than on idem.

mod measure;
mod phases;
mod postgres;
mod redeliveries;
mod sqlite;
mod workload;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::bail;
use clap::Parser as _;
use idem_core::Timestamp;

use measure::{Sample, Window};

/// The PostgreSQL URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for BenchArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchArgs")
            .field(
                "postgres",
                &self.postgres.as_deref().map(idem_redact::redact_url),
            )
            .field("sqlite", &self.sqlite)
            .field("only", &self.only)
            .field("seconds", &self.seconds)
            .field("rounds", &self.rounds)
            .field("markdown", &self.markdown)
            .field("batch", &self.batch)
            .field("experimental", &self.experimental)
            .field("variants", &self.variants)
            .field("claims", &self.claims)
            .field("prune_workers", &self.prune_workers)
            .field("prune_batch", &self.prune_batch)
            .field("prune_cap", &self.prune_cap)
            .field("prune_tables", &self.prune_tables)
            .field(
                "outbox_brokers",
                &self
                    .outbox_brokers
                    .iter()
                    .map(|u| idem_redact::redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("outbox_parts", &self.outbox_parts)
            .field("outbox_rows", &self.outbox_rows)
            .field("outbox_workers", &self.outbox_workers)
            .field("outbox_rate", &self.outbox_rate)
            .field("outbox_latency_seconds", &self.outbox_latency_seconds)
            .field("outbox_pipeline", &self.outbox_pipeline)
            .field("outbox_size", &self.outbox_size)
            .field("phases_workers", &self.phases_workers)
            .finish()
    }
}

/// Default PostgreSQL when neither `--postgres` nor `IDEM_TEST_POSTGRES_URL` is given.
const DEFAULT_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Measure the claim's overhead against the same handler without it.
#[derive(clap::Parser)]
#[command(name = "idem-bench", version)]
struct BenchArgs {
    /// PostgreSQL for P1 and P2 (default: $IDEM_TEST_POSTGRES_URL, else
    /// postgres://postgres@127.0.0.1:5432/test). The bench creates, truncates and finally drops
    /// its own idem_bench_* tables there.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// SQLite database file for P3 [default: a temporary file, deleted afterwards].
    #[arg(long, value_name = "PATH")]
    sqlite: Option<PathBuf>,
    /// Scenarios to run: p1 (per message, PostgreSQL), p2 (batched, PostgreSQL), p3 (SQLite);
    /// prune (a large claims table pruned under a running consumer, PostgreSQL; minutes, so
    /// only when asked for); outbox (the transactional outbox on PostgreSQL: relay throughput
    /// next to the broker's own, enqueue cost in a set batch, commit → confirm latency; needs
    /// the brokers of --outbox-brokers; only when asked for); phases (recovery points through
    /// `run_phases` against the same work by hand, PostgreSQL and SQLite; only when asked for);
    /// redeliveries (the consumer's local cache off and on with 30 % same-process
    /// redeliveries, PostgreSQL and SQLite; only when asked for).
    #[arg(long, value_delimiter = ',', default_value = "p1,p2,p3")]
    only: Vec<Scenario>,
    /// Counted seconds per measurement (a short warm-up runs before each) [default: 3]; for
    /// prune, the windows before and after pruning [default: 15].
    #[arg(long)]
    seconds: Option<f64>,
    /// Interleaved rounds per variant; the report gives the median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print the report as Markdown, ready for BENCHMARKS.md.
    #[arg(long)]
    markdown: bool,
    /// Concurrent workers for P1, one measurement table per count.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    p1_workers: Vec<usize>,
    /// Concurrent workers for P2.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    p2_workers: Vec<usize>,
    /// Concurrent workers for P3 (SQLite has one writer at a time).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    p3_workers: Vec<usize>,
    /// Messages per transaction in the batched scenarios.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Also measure the experimental variants (where P1's time goes; faster claim prototypes).
    #[arg(long)]
    experimental: bool,
    /// Only these variants, by the keys the ratio lines use (bare, idem, idem-set, …): for
    /// profiling one variant. Experimental keys need --experimental.
    #[arg(long, value_delimiter = ',', value_name = "KEYS")]
    variants: Vec<String>,
    /// Prune: synthetic claims in the table before the consumer starts, spread over 14 days.
    #[arg(long, default_value_t = 10_000_000)]
    claims: u64,
    /// Prune: the consumer's concurrent workers.
    #[arg(long, default_value_t = 8)]
    prune_workers: usize,
    /// Prune: claims per row-wise prune batch.
    #[arg(long, default_value_t = 10_000)]
    prune_batch: u32,
    /// Prune: stop row-wise pruning after this many seconds (checked between batches).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    prune_cap: f64,
    /// Prune: the tables to prune, in order: plain (row-wise), legacy (partitioned with a
    /// DEFAULT partition: drop under an exclusive lock), partitioned (bounded: detach
    /// concurrently).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "plain,legacy,partitioned"
    )]
    prune_tables: Vec<postgres::PruneLayout>,
    /// Outbox: broker URLs relayed to, one throughput table and one latency run each
    /// [default: $IDEM_TEST_NATS_URL, else nats://127.0.0.1:4222].
    #[arg(long, value_delimiter = ',', value_name = "URLS")]
    outbox_brokers: Vec<String>,
    /// Outbox: the parts to run: drain (relay throughput next to the broker's), enqueue (the
    /// cost in a set batch), latency (commit → confirm with NOTIFY), lease (the lease
    /// statements side by side) and size (the table's size at a constant rate, Redis brokers
    /// only; minutes): the last two only when asked for.
    #[arg(long, value_delimiter = ',', default_value = "drain,enqueue,latency")]
    outbox_parts: Vec<postgres::OutboxPart>,
    /// Outbox: committed rows the relay drains per throughput measurement.
    #[arg(long, default_value_t = 20_000)]
    outbox_rows: usize,
    /// Outbox: concurrent workers for the enqueue-cost tables.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    outbox_workers: Vec<usize>,
    /// Outbox: commits per second in the latency run.
    #[arg(long, default_value_t = 1000)]
    outbox_rate: u32,
    /// Outbox: how long the latency run writes.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    outbox_latency_seconds: f64,
    /// Outbox: rounds in flight for the relay variants of the drain part (the relay's
    /// `pipeline`); the `pipeline 1` rows are measured next to them either way.
    #[arg(long, value_name = "ROUNDS")]
    outbox_pipeline: Option<usize>,
    #[command(flatten)]
    outbox_size: postgres::OutboxSizeArgs,
    /// Phases: concurrent workers, one table per count and database.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    phases_workers: Vec<usize>,
}

fn main() -> ExitCode {
    let args = BenchArgs::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}`: the error and its causes, on one line.
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    P1,
    P2,
    P3,
    Prune,
    Outbox,
    Phases,
    /// The consumer's local cache of committed claims off and on, 30 % same-process
    /// redeliveries (module `redeliveries`; only when asked for).
    Redeliveries,
}

/// What every scenario needs to know about the run.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) window: Window,
    pub(crate) rounds: usize,
    pub(crate) batch: usize,
    pub(crate) experimental: bool,
    variants: Arc<[String]>,
    run: u32,
}

/// Numbers measurements within a run, so every measurement's message IDs are new.
static MEASUREMENT: AtomicU32 = AtomicU32::new(0);

impl Settings {
    /// IDs for a new measurement.
    pub(crate) fn ids(&self) -> workload::Ids {
        workload::Ids::new(self.run, MEASUREMENT.fetch_add(1, Ordering::Relaxed))
    }

    fn wants(&self, key: &str) -> bool {
        self.variants.is_empty() || self.variants.iter().any(|k| k == key)
    }
}

/// A measured variant, as the report names it.
pub(crate) trait Variant: Copy {
    /// Short name used by the targets.
    fn key(self) -> &'static str;
    /// What the report calls it.
    fn label(self) -> &'static str;
    /// Client–server round trips per message (or per batch), as counted from the code path.
    fn round_trips(self) -> &'static str;
}

/// One table of the report: variants of one workload.
#[derive(Debug)]
pub(crate) struct Group {
    title: String,
    rows: Vec<Row>,
    targets: Vec<Target>,
    notes: Vec<String>,
}

#[derive(Debug)]
struct Row {
    key: &'static str,
    label: &'static str,
    round_trips: &'static str,
    samples: Vec<Sample>,
}

/// A goal from the issue, checked against the medians.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    /// `of / to >= at_least` (or `>` when `strict`).
    Ratio {
        of: &'static str,
        to: &'static str,
        at_least: f64,
        strict: bool,
    },
    /// `of` reaches `at_least` messages per second.
    Rate { of: &'static str, at_least: f64 },
    /// `of / to`, reported without a goal.
    Compare { of: &'static str, to: &'static str },
}

impl Group {
    /// Measures `variants` in interleaved rounds; `one(variant)` runs one measurement.
    pub(crate) async fn measure<V: Variant>(
        title: String,
        variants: &[V],
        settings: &Settings,
        mut one: impl AsyncFnMut(V) -> anyhow::Result<Sample>,
    ) -> anyhow::Result<Self> {
        let variants: Vec<V> = variants
            .iter()
            .copied()
            .filter(|v| settings.wants(v.key()))
            .collect();
        if !variants.is_empty() {
            eprintln!("{title}");
        }
        let rounds = settings.rounds;
        let samples = measure::interleaved(&variants, rounds, async |v: V, round| {
            let sample = one(v).await?;
            eprintln!(
                "  round {}/{rounds}  {:<44} {:>10} msg/s",
                round + 1,
                v.label(),
                thousands(sample.rate)
            );
            Ok(sample)
        })
        .await?;
        let rows = variants
            .iter()
            .zip(samples)
            .map(|(v, samples)| Row {
                key: v.key(),
                label: v.label(),
                round_trips: v.round_trips(),
                samples,
            })
            .collect();
        Ok(Self {
            title,
            rows,
            targets: Vec::new(),
            notes: Vec::new(),
        })
    }

    /// Adds goals to check.
    pub(crate) fn targets(mut self, targets: impl IntoIterator<Item = Target>) -> Self {
        self.targets.extend(targets);
        self
    }

    /// Adds a line under the table.
    pub(crate) fn note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    fn median(&self, key: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.key == key)
            .map(|r| measure::median(&r.samples))
    }

    fn checks(&self) -> Vec<String> {
        let mut out = Vec::new();
        for t in &self.targets {
            match *t {
                Target::Ratio {
                    of,
                    to,
                    at_least,
                    strict,
                } => {
                    let (Some(a), Some(b)) = (self.median(of), self.median(to)) else {
                        continue;
                    };
                    let ratio = if b > 0.0 { a / b } else { 0.0 };
                    let met = if strict {
                        ratio > at_least
                    } else {
                        ratio >= at_least
                    };
                    let op = if strict { ">" } else { "≥" };
                    out.push(format!(
                        "{of} / {to} = {ratio:.2} (target {op} {at_least:.2}): {}",
                        verdict(met)
                    ));
                }
                Target::Compare { of, to } => {
                    if let (Some(a), Some(b)) = (self.median(of), self.median(to))
                        && b > 0.0
                    {
                        out.push(format!("{of} / {to} = {:.2}", a / b));
                    }
                }
                Target::Rate { of, at_least } => {
                    let Some(a) = self.median(of) else { continue };
                    out.push(format!(
                        "{of} = {} msg/s (target ≥ {}): {}",
                        thousands(a),
                        thousands(at_least),
                        verdict(a >= at_least)
                    ));
                }
            }
        }
        let retries: u64 = self
            .rows
            .iter()
            .flat_map(|r| &r.samples)
            .map(|s| s.retries)
            .sum();
        if retries > 0 {
            let per: Vec<String> = self
                .rows
                .iter()
                .map(|r| (r.label, r.samples.iter().map(|s| s.retries).sum::<u64>()))
                .filter(|(_, n)| *n > 0)
                .map(|(l, n)| format!("{l}: {n}"))
                .collect();
            out.push(format!(
                "retryable errors (deadlock/busy), dropped and not counted: {}",
                per.join(", ")
            ));
        }
        out
    }
}

impl Row {
    /// Median CPU per message: "client + server" when the server's processes are visible,
    /// the client alone when the database runs in-process.
    fn cpu(&self) -> String {
        let client = measure::median_of(self.samples.iter().filter_map(|s| s.client_us));
        let server = measure::median_of(self.samples.iter().filter_map(|s| s.server_us));
        match (client, server) {
            (Some(c), Some(s)) => format!("{c:.0} + {s:.0}"),
            (Some(c), None) => format!("{c:.0}"),
            _ => "–".to_string(),
        }
    }
}

impl Target {
    /// `of / to` must reach `at_least`.
    pub(crate) fn at_least(of: &'static str, to: &'static str, at_least: f64) -> Self {
        Self::Ratio {
            of,
            to,
            at_least,
            strict: false,
        }
    }

    /// A ratio worth reading, without a goal of its own.
    pub(crate) fn compare(of: &'static str, to: &'static str) -> Self {
        Self::Compare { of, to }
    }
}

/// "1 worker", "8 workers".
pub(crate) fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

/// Runs the scenarios `args` selects and prints the report.
async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let seconds = |default: f64| -> anyhow::Result<Duration> {
        let s = args.seconds.unwrap_or(default);
        if !(s.is_finite() && s > 0.0 && s <= 3600.0) {
            bail!("--seconds must be a positive number of seconds (at most 3600)");
        }
        Ok(Duration::from_secs_f64(s))
    };
    if args.rounds == 0 || args.rounds > 100 {
        bail!("--rounds must be between 1 and 100");
    }
    if args.batch == 0 || args.batch > 10_000 {
        bail!("--batch must be between 1 and 10000");
    }
    for (flag, counts) in [
        ("--p1-workers", &args.p1_workers),
        ("--p2-workers", &args.p2_workers),
        ("--p3-workers", &args.p3_workers),
        ("--phases-workers", &args.phases_workers),
    ] {
        if counts.iter().any(|&w| w == 0 || w > 256) {
            bail!("{flag}: worker counts must be between 1 and 256");
        }
    }
    let measure = seconds(3.0)?;
    let settings = Settings {
        // Long enough to fill statement caches and reach steady state, short next to the window.
        window: Window {
            warmup: (measure / 5).clamp(Duration::from_millis(100), Duration::from_millis(500)),
            measure,
        },
        rounds: args.rounds,
        batch: args.batch,
        experimental: args.experimental,
        variants: args.variants.clone().into(),
        run: run_tag(),
    };
    let wants = |s| args.only.contains(&s);

    let prune = if wants(Scenario::Prune) {
        if args.prune_workers == 0 || args.prune_workers > 256 {
            bail!("--prune-workers must be between 1 and 256");
        }
        if args.prune_batch == 0 {
            bail!("--prune-batch must be at least 1");
        }
        if !(args.prune_cap.is_finite() && args.prune_cap > 0.0) {
            bail!("--prune-cap must be a positive number of seconds");
        }
        let window = seconds(15.0)?;
        Some(postgres::PruneOptions {
            claims: args.claims,
            workers: args.prune_workers,
            before: window,
            after: window,
            cap: Duration::from_secs_f64(args.prune_cap),
            batch: args.prune_batch,
            layouts: args.prune_tables.clone(),
        })
    } else {
        None
    };

    let outbox = if wants(Scenario::Outbox) {
        if args.outbox_rows == 0 || args.outbox_rows > 10_000_000 {
            bail!("--outbox-rows must be between 1 and 10000000");
        }
        if args.outbox_workers.iter().any(|&w| w == 0 || w > 256) {
            bail!("--outbox-workers: worker counts must be between 1 and 256");
        }
        if args.outbox_rate == 0 || args.outbox_rate > 100_000 {
            bail!("--outbox-rate must be between 1 and 100000 commits per second");
        }
        let s = args.outbox_latency_seconds;
        if !(s.is_finite() && s > 1.0 && s <= 3600.0) {
            bail!("--outbox-latency-seconds must be more than 1 and at most 3600");
        }
        let brokers = if args.outbox_brokers.is_empty() {
            vec![
                std::env::var("IDEM_TEST_NATS_URL")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_string()),
            ]
        } else {
            args.outbox_brokers.clone()
        };
        Some(postgres::OutboxOptions {
            brokers,
            parts: args.outbox_parts.clone(),
            rows: args.outbox_rows,
            workers: args.outbox_workers.clone(),
            rate: args.outbox_rate,
            latency_window: Duration::from_secs_f64(s),
            pipeline: args.outbox_pipeline,
            size: args.outbox_size.options()?,
        })
    } else {
        None
    };

    let mut env = Environment::probe();
    let host_before = HostCpu::read();
    let mut groups = Vec::new();
    let mut pruned = None;
    let mut outboxed = None;
    let mut skipped = Vec::new();

    if wants(Scenario::P1) || wants(Scenario::P2) || prune.is_some() || outbox.is_some() {
        let url = args
            .postgres
            .clone()
            .or_else(|| std::env::var("IDEM_TEST_POSTGRES_URL").ok())
            .unwrap_or_else(|| DEFAULT_POSTGRES.to_string());
        match postgres::Bench::connect(&url, &settings).await {
            Ok(pg) => {
                env.postgres = Some(pg.describe().to_string());
                if wants(Scenario::P1) || wants(Scenario::P2) || outbox.is_some() {
                    pg.create_tables().await?;
                    if wants(Scenario::P1) {
                        groups.extend(pg.p1(&args.p1_workers).await?);
                    }
                    if wants(Scenario::P2) {
                        groups.extend(pg.p2(&args.p2_workers).await?);
                    }
                    if let Some(options) = &outbox {
                        let (tables, report) = pg.outbox(options).await?;
                        groups.extend(tables);
                        outboxed = Some(report);
                    }
                    pg.cleanup().await;
                }
                if let Some(options) = &prune {
                    pruned = Some(pg.prune(options).await?);
                }
            }
            Err(e) => {
                let line = format!(
                    "PostgreSQL scenarios skipped: PostgreSQL at {} is unreachable ({e:#})",
                    idem_redact::redact_url(&url)
                );
                if prune.is_some() || outbox.is_some() {
                    // Nothing else would tell the caller that the scenario they asked for
                    // did not run.
                    bail!("{line}");
                }
                eprintln!("{line}");
                skipped.push(line);
            }
        }
    }
    let phased = if wants(Scenario::Phases) {
        let url = args
            .postgres
            .clone()
            .or_else(|| std::env::var("IDEM_TEST_POSTGRES_URL").ok())
            .unwrap_or_else(|| DEFAULT_POSTGRES.to_string());
        Some(phases::run(&url, &settings, &args.phases_workers).await?)
    } else {
        None
    };
    let redelivered = if wants(Scenario::Redeliveries) {
        let url = args
            .postgres
            .clone()
            .or_else(|| std::env::var("IDEM_TEST_POSTGRES_URL").ok())
            .unwrap_or_else(|| DEFAULT_POSTGRES.to_string());
        Some(redeliveries::run(&url, settings.run, settings.rounds).await?)
    } else {
        None
    };
    if wants(Scenario::P3) {
        let bench = sqlite::Bench::open(args.sqlite.clone(), &settings).await?;
        env.sqlite = Some(bench.describe().to_string());
        let result = bench.p3(&args.p3_workers).await;
        bench.cleanup().await;
        groups.extend(result?);
    }

    env.noise = host_before
        .zip(HostCpu::read())
        .map(|(a, b)| a.noise_until(&b));
    let mut report = if args.markdown {
        markdown(&env, &settings, &groups, &skipped)
    } else {
        plain(&env, &settings, &groups, &skipped)
    };
    if let Some(pruned) = &pruned {
        report.push_str(&if args.markdown {
            pruned.markdown()
        } else {
            pruned.plain()
        });
    }
    if let Some(outboxed) = &outboxed {
        report.push_str(&if args.markdown {
            outboxed.markdown()
        } else {
            outboxed.plain()
        });
    }
    if let Some(r) = &redelivered {
        report.push_str(&if args.markdown {
            r.markdown()
        } else {
            r.plain()
        });
    }
    if let Some(phased) = &phased {
        report.push_str(&if args.markdown {
            phased.markdown()
        } else {
            phased.plain()
        });
    }
    print!("{report}");
    Ok(())
}

/// Tags this run's message IDs; only needs to differ between runs sharing a database.
fn run_tag() -> u32 {
    let micros = Timestamp::from(SystemTime::now()).as_micros();
    (micros as u64 ^ (u64::from(std::process::id()) << 20)) as u32
}

/// What the numbers were measured on.
#[derive(Debug)]
struct Environment {
    command: String,
    cpus: usize,
    cpu_model: Option<String>,
    date: String,
    postgres: Option<String>,
    sqlite: Option<String>,
    noise: Option<String>,
    /// `/proc/loadavg` as the run starts: others' work on a shared machine.
    load: Option<String>,
}

/// The machine-wide CPU counters of `/proc/stat`, to say how noisy the run was: a shared or
/// virtual machine loses time to other tenants (steal) and to other processes.
#[derive(Debug, Clone, Copy)]
struct HostCpu {
    busy: u64,
    steal: u64,
    total: u64,
}

impl HostCpu {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        // user nice system idle iowait irq softirq steal …
        let (idle, steal) = (v.get(3)? + v.get(4)?, *v.get(7)?);
        let total: u64 = v.iter().take(8).sum();
        Some(Self {
            busy: total.saturating_sub(idle + steal),
            steal,
            total,
        })
    }

    fn noise_until(&self, later: &Self) -> String {
        let total = later.total.saturating_sub(self.total).max(1) as f64;
        format!(
            "host during the run: {:.0}% of all CPU time busy (bench, database and anything \
             else), {:.1}% stolen by the hypervisor; rerun if the ranges are wide",
            100.0 * later.busy.saturating_sub(self.busy) as f64 / total,
            100.0 * later.steal.saturating_sub(self.steal) as f64 / total
        )
    }
}

impl Environment {
    fn probe() -> Self {
        let command = std::env::args()
            .map(|a| {
                if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'') {
                    format!("'{}'", a.replace('\'', r"'\''"))
                } else {
                    a
                }
            })
            .collect::<Vec<_>>()
            .join(" ");
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        Self {
            command,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            date: Timestamp::from(SystemTime::now())
                .to_string()
                .chars()
                .take(10)
                .collect(),
            postgres: None,
            noise: None,
            sqlite: None,
            load: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")),
        }
    }

    /// The header's lines; `rounds`: whether the interleaved-rounds scenarios ran.
    fn lines(&self, settings: &Settings, rounds: bool) -> Vec<String> {
        let mut lines = vec![format!(
            "machine: {} CPUs (nproc){}; {}",
            self.cpus,
            self.cpu_model
                .as_deref()
                .map(|m| format!(", {m}"))
                .unwrap_or_default(),
            self.date
        )];
        if let Some(load) = &self.load {
            lines.push(format!("load average at the start (1, 5, 15 min): {load}"));
        }
        if rounds {
            lines.push(format!(
                "method: {} interleaved rounds per variant, each {:.1} s counted after a {:.1} s \
                 warm-up; median shown; every message has a fresh ID (every claim is a real \
                 insert); tables truncated before each measurement",
                settings.rounds,
                settings.window.measure.as_secs_f64(),
                settings.window.warmup.as_secs_f64()
            ));
        }
        if let Some(pg) = &self.postgres {
            lines.push(format!("PostgreSQL: {pg}"));
        }
        if let Some(noise) = &self.noise {
            lines.push(noise.clone());
        }
        if let Some(sqlite) = &self.sqlite {
            lines.push(format!("SQLite: {sqlite}"));
        }
        if !rounds {
            return lines;
        }
        lines.push(
            "round trips: pool pings are sqlx's (one when a pooled connection is acquired, one \
             when it is returned)"
                .to_string(),
        );
        lines.push(
            "CPU µs/msg: this process (workers, sqlx, and SQLite, which runs in-process) + the \
             PostgreSQL backends serving it, when on this machine; background writers not \
             counted"
                .to_string(),
        );
        lines
    }
}

fn markdown(
    env: &Environment,
    settings: &Settings,
    groups: &[Group],
    skipped: &[String],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## `idem-bench`\n");
    let _ = writeln!(out, "- command: `{}`", env.command);
    for line in env.lines(settings, !groups.is_empty()) {
        let _ = writeln!(out, "- {line}");
    }
    for line in skipped {
        let _ = writeln!(out, "- **{line}**");
    }
    for g in groups.iter().filter(|g| !g.rows.is_empty()) {
        let _ = writeln!(out, "\n### {}\n", g.title);
        let _ = writeln!(
            out,
            "| variant | round trips | msg/s (median) | min – max | × bare | CPU µs/msg |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
        let base = g.rows.first().map(|r| measure::median(&r.samples));
        for r in &g.rows {
            let (med, lo, hi) = stats(&r.samples);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} – {} | {} | {} |",
                r.label,
                r.round_trips,
                thousands(med),
                thousands(lo),
                thousands(hi),
                ratio(med, base),
                r.cpu()
            );
        }
        let checks = g.checks();
        if !checks.is_empty() || !g.notes.is_empty() {
            let _ = writeln!(out);
        }
        for c in checks.iter().chain(&g.notes) {
            let _ = writeln!(out, "- {c}");
        }
    }
    out
}

fn plain(env: &Environment, settings: &Settings, groups: &[Group], skipped: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "idem-bench: {}", env.command);
    for line in env
        .lines(settings, !groups.is_empty())
        .iter()
        .chain(skipped)
    {
        let _ = writeln!(out, "  {line}");
    }
    for g in groups.iter().filter(|g| !g.rows.is_empty()) {
        let _ = writeln!(out, "\n{}", g.title);
        let _ = writeln!(
            out,
            "  {:<46} {:<28} {:>9} {:>19} {:>6} {:>14}",
            "variant", "round trips", "msg/s", "min – max", "× bare", "CPU µs/msg"
        );
        let base = g.rows.first().map(|r| measure::median(&r.samples));
        for r in &g.rows {
            let (med, lo, hi) = stats(&r.samples);
            let _ = writeln!(
                out,
                "  {:<46} {:<28} {:>9} {:>19} {:>6} {:>14}",
                r.label,
                r.round_trips,
                thousands(med),
                format!("{} – {}", thousands(lo), thousands(hi)),
                ratio(med, base),
                r.cpu()
            );
        }
        for c in g.checks().iter().chain(&g.notes) {
            let _ = writeln!(out, "  · {c}");
        }
    }
    out
}

fn stats(samples: &[Sample]) -> (f64, f64, f64) {
    let lo = samples.iter().map(|s| s.rate).fold(f64::INFINITY, f64::min);
    let hi = samples.iter().map(|s| s.rate).fold(0.0, f64::max);
    (
        measure::median(samples),
        if lo.is_finite() { lo } else { 0.0 },
        hi,
    )
}

fn ratio(x: f64, base: Option<f64>) -> String {
    match base {
        Some(b) if b > 0.0 => format!("{:.2}", x / b),
        _ => "–".to_string(),
    }
}

/// `12345.6` as `12,346`: rates are read, not computed with.
fn thousands(x: f64) -> String {
    let digits = (x.round().max(0.0) as u64).to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1234.5), "1,235");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }
}
