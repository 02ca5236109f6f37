//! `http-payments bench`: the layer's cost per request on each store next to the same service
//! without it, and the function-level API next to AWS Powertools, in one run.
//!
//! Every server is this binary started as a child process on a loopback port (the layer, the
//! same routes without it, or a static answer without any database — the HTTP floor); the load
//! generator is in this process. Variants of one store run in interleaved rounds, so drift of
//! the machine hits them alike; the median round is shown.
//!
//! Besides the handler as shipped (one write, at once), each store is measured with a slow
//! handler — `--work-ms` (50) of work before its one write, at `--work-clients` (16) — with and
//! without the layer: what the layer costs when handlers do something before they write. On
//! SQLite that shows whether the layer holds the database's one write lock while the handler
//! works (issue 19, point 4: it must not).

mod function;
mod load;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};

use load::{Keys, Sample};

/// Benchmark options.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Seconds measured per cell and round (after a warm-up of a fifth of that).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Interleaved rounds per cell; the median is shown.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    clients: Vec<usize>,
    /// The slow handler's work before its one write, in milliseconds (0: no slow-handler
    /// cells).
    #[arg(long, value_name = "MS", default_value_t = 50)]
    work_ms: u64,
    /// Concurrent clients of the slow-handler cells.
    #[arg(long, value_name = "N", default_value_t = 16)]
    work_clients: usize,
    /// Stores to measure, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "sqlite,postgres,mysql,redis"
    )]
    stores: Vec<String>,
    /// PostgreSQL (default $IDEM_TEST_POSTGRES_URL, else the local server). The bench works
    /// in a schema of its own, dropped at the end; it is also the ledger of the Redis runs.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// MySQL/MariaDB (default $IDEM_TEST_MYSQL_URL, else the local server); the bench works in
    /// a database of its own, dropped at the end.
    #[arg(long, value_name = "URL")]
    mysql: Option<String>,
    /// Redis (default $IDEM_TEST_REDIS_URL, else the local server).
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// The Python with `aws-lambda-powertools[redis]` installed (scripts/bench-http-payments
    /// makes a virtualenv with it).
    #[arg(long, value_name = "PATH", default_value = "python3")]
    python: String,
    /// The layered servers' `--held-connections` on PostgreSQL and MySQL (0: the layer's
    /// store on sqlx's pool, with its pings, as the server without the layer is).
    #[arg(long, value_name = "N", default_value_t = 16)]
    held_connections: u32,
    /// Worker threads of every server (default: one per core).
    #[arg(long, value_name = "N")]
    server_threads: Option<usize>,
    /// Skip the function-level comparison with Powertools.
    #[arg(long)]
    no_function: bool,
    /// Print Markdown tables.
    #[arg(long)]
    markdown: bool,
}

fn url_or(arg: &Option<String>, var: &str, default: &str) -> String {
    arg.clone()
        .or_else(|| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
        .unwrap_or_else(|| default.to_owned())
}

/// A server child process, killed when dropped.
struct Server {
    child: tokio::process::Child,
    addr: SocketAddr,
}

/// Runs one cell against `server`, with the CPU the server (and Redis, `redis.pid`) spent on
/// it and, on Redis, the commands Redis ran per request.
#[allow(clippy::too_many_arguments)] // each call site names them
async fn measure_cell(
    server: &Server,
    redis: Option<&RedisServer>,
    clients: usize,
    keys: Keys,
    work_ms: Option<u64>,
    id: &str,
    warmup: Duration,
    measure: Duration,
) -> Result<Sample> {
    let pid = server.child.id().unwrap_or(0);
    let redis_pid = redis.and_then(|r| r.pid);
    let mut stats = match redis {
        Some(r) => Some(r.client.get_multiplexed_async_connection().await?),
        None => None,
    };
    let commands0 = match stats.as_mut() {
        Some(conn) => Some(function::command_calls(conn).await?),
        None => None,
    };
    let (cpu0, redis0) = (load::cpu_micros(pid), redis_pid.map_or(0, load::cpu_micros));
    let mut sample = load::run(server.addr, clients, keys, work_ms, id, warmup, measure).await?;
    let (cpu1, redis1) = (load::cpu_micros(pid), redis_pid.map_or(0, load::cpu_micros));
    let sent = sample.sent.max(1) as f64;
    sample.server_cpu_us = (cpu1 - cpu0) as f64 / sent;
    sample.redis_cpu_us = (redis1.saturating_sub(redis0)) as f64 / sent;
    if let (Some(conn), Some(before)) = (stats.as_mut(), commands0) {
        let after = function::command_calls(conn).await?;
        let per = function::commands_per(&before, &after, sample.sent);
        // `+ 0.0`: an empty sum is -0.0.
        sample.redis_commands = Some(per.values().sum::<f64>() + 0.0);
    }
    Ok(sample)
}

/// The Redis of the Redis rows: a client for `INFO commandstats`, and its process when it runs
/// on this machine.
struct RedisServer {
    client: redis::Client,
    pid: Option<u32>,
}

/// The process ID of the Redis server at `url`, when it runs on this machine.
async fn redis_pid(url: &str) -> Option<u32> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))?
        .trim()
        .parse()
        .ok()?;
    std::path::Path::new(&format!("/proc/{pid}"))
        .exists()
        .then_some(pid)
}

impl Server {
    async fn start(args: &[&str], threads: Option<usize>) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let threads = threads.map(|n| vec!["--worker-threads".to_owned(), n.to_string()]);
        let mut child = tokio::process::Command::new(exe)
            // Records of a bench outlive it by ten minutes, not a day, on a shared Redis.
            .args(["--listen", "127.0.0.1:0", "--ttl", "10m"])
            .args(args)
            .args(threads.unwrap_or_default())
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting a server")?;
        let stderr = child.stderr.take().context("server stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(addr) = listening_addr(&line) {
                    return Ok(addr);
                }
                seen.push(line);
            }
            anyhow::bail!("the server exited: {}", seen.join("\n"))
        })
        .await
        .context("the server did not start within 60 s")??;
        // Keep draining its log so it never blocks on a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("WARN") || line.contains("ERROR") {
                    eprintln!("server: {line}");
                }
            }
        });
        Ok(Self { child, addr })
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// The address in the server's `listening addr=…` log line.
fn listening_addr(line: &str) -> Option<SocketAddr> {
    if !line.contains("listening") {
        return None;
    }
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .and_then(|a| a.parse().ok())
}

/// A store's database, isolated for this run.
struct Target {
    name: &'static str,
    /// `--database` (and `--ledger`) for the servers.
    args: Vec<String>,
    cleanup: Cleanup,
}

enum Cleanup {
    PgSchema(String, String),
    MySqlDatabase(String, String),
    None,
}

impl Cleanup {
    async fn run(self) {
        let result: Result<()> = async {
            match self {
                Cleanup::PgSchema(url, schema) => {
                    let pool = sqlx::PgPool::connect(&url).await?;
                    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .execute(&pool)
                        .await?;
                    pool.close().await;
                }
                Cleanup::MySqlDatabase(url, db) => {
                    let pool = sqlx::MySqlPool::connect(&url).await?;
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {db}"))
                        .execute(&pool)
                        .await?;
                    pool.close().await;
                }
                Cleanup::None => {}
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            eprintln!("note: cleaning up after the bench failed: {e:#}");
        }
    }
}

/// A PostgreSQL schema of this run's own, and a URL whose connections use it.
async fn pg_schema(base: &str, run: &str) -> Result<(String, Cleanup)> {
    let schema = format!("http_bench_{run}");
    let pool = sqlx::PgPool::connect(base)
        .await
        .with_context(|| format!("connecting to {}", idem_redact::redact_url(base)))?;
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&pool)
        .await?;
    pool.close().await;
    let mut url = url::Url::parse(base)?;
    url.query_pairs_mut()
        .append_pair("options", &format!("-c search_path={schema}"));
    Ok((url.to_string(), Cleanup::PgSchema(base.to_owned(), schema)))
}

async fn target(name: &str, a: &BenchArgs, run: &str, tmp: &std::path::Path) -> Result<Target> {
    let pg = url_or(
        &a.postgres,
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    Ok(match name {
        "sqlite" => Target {
            name: "SQLite",
            args: vec![
                "--database".into(),
                format!("sqlite:{}", tmp.join("bench.db").display()),
            ],
            cleanup: Cleanup::None,
        },
        "postgres" => {
            let (url, cleanup) = pg_schema(&pg, run).await?;
            Target {
                name: "PostgreSQL",
                args: vec!["--database".into(), url],
                cleanup,
            }
        }
        "mysql" => {
            let base = url_or(
                &a.mysql,
                "IDEM_TEST_MYSQL_URL",
                "mysql://root@127.0.0.1:3306/test",
            );
            let db = format!("http_bench_{run}");
            let pool = sqlx::MySqlPool::connect(&base)
                .await
                .with_context(|| format!("connecting to {}", idem_redact::redact_url(&base)))?;
            sqlx::query(&format!("CREATE DATABASE {db}"))
                .execute(&pool)
                .await?;
            pool.close().await;
            let mut url = url::Url::parse(&base)?;
            url.set_path(&db);
            Target {
                name: "MySQL",
                args: vec!["--database".into(), url.to_string()],
                cleanup: Cleanup::MySqlDatabase(base, db),
            }
        }
        "redis" => {
            let redis = url_or(&a.redis, "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
            let (ledger, cleanup) = pg_schema(&pg, &format!("{run}_ledger")).await?;
            Target {
                name: "Redis (ledger on PostgreSQL)",
                args: vec!["--database".into(), redis, "--ledger".into(), ledger],
                cleanup,
            }
        }
        other => {
            anyhow::bail!("unknown store {other:?}: expected sqlite, postgres, mysql or redis")
        }
    })
}

/// The slow handler's variants (see the module docs).
const SLOW_BARE: &str = "no layer, slow handler";
const SLOW_LAYER: &str = "layer, first execution, slow handler";

/// One row of the HTTP table: a variant at a client count, over the rounds.
#[derive(Debug)]
struct Row {
    store: String,
    variant: &'static str,
    clients: usize,
    rounds: Vec<Sample>,
}

impl Row {
    /// The round with the median throughput.
    fn median(&self) -> &Sample {
        let mut idx: Vec<usize> = (0..self.rounds.len()).collect();
        idx.sort_by(|&a, &b| {
            self.rounds[a]
                .per_second
                .total_cmp(&self.rounds[b].per_second)
        });
        &self.rounds[idx[idx.len() / 2]]
    }
}

/// A median over the rounds of one statistic.
fn median_of(rounds: &[Sample], f: impl Fn(&Sample) -> f64) -> f64 {
    let mut v: Vec<f64> = rounds.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Jiffies of all CPUs from `/proc/stat`: (busy, steal, total). Zeros off Linux.
fn host_cpu() -> (u64, u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal
    let total: u64 = (0..8).map(get).sum();
    let idle = get(3) + get(4);
    (total - idle - get(7), get(7), total)
}

pub(crate) async fn run(a: BenchArgs) -> Result<()> {
    let cpu_start = host_cpu();
    let run = format!("{}_{}", std::process::id(), rand::random::<u16>());
    let tmp = std::env::temp_dir().join(format!("http-payments-bench-{run}"));
    std::fs::create_dir_all(&tmp)?;
    let measure = Duration::from_secs_f64(a.seconds);
    let warmup = measure / 5;
    let mut rows: Vec<Row> = Vec::new();
    let mut notes: Vec<String> = Vec::new();

    // The HTTP floor: the same server, no layer, no database.
    {
        let floor_db = format!("sqlite:{}", tmp.join("floor.db").display());
        let server = Server::start(
            &["--database", &floor_db, "--mode", "static"],
            a.server_threads,
        )
        .await?;
        for &clients in &a.clients {
            let mut row = Row {
                store: "none".into(),
                variant: "HTTP floor (no layer, no database)",
                clients,
                rounds: Vec::new(),
            };
            for round in 0..a.rounds {
                let id = format!("floor-{run}-{clients}-{round}");
                row.rounds.push(
                    measure_cell(
                        &server,
                        None,
                        clients,
                        Keys::None,
                        None,
                        &id,
                        warmup,
                        measure,
                    )
                    .await?,
                );
            }
            rows.push(row);
        }
        server.stop().await;
    }

    for name in &a.stores {
        let t = match target(name, &a, &run, &tmp).await {
            Ok(t) => t,
            Err(e) => {
                let line = format!("{name}: skipped ({e:#})");
                eprintln!("{line}");
                notes.push(line);
                continue;
            }
        };
        let args: Vec<&str> = t.args.iter().map(String::as_str).collect();
        let redis = if name == "redis" {
            let url = url_or(&a.redis, "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
            Some(RedisServer {
                client: redis::Client::open(url.as_str())?,
                pid: redis_pid(&url).await,
            })
        } else {
            None
        };
        let result = async {
            // `--test-hooks`: the slow handler's `X-Test-Work-Ms`; no other request sends one.
            let mut args = args.clone();
            args.push("--test-hooks");
            let mut bare_args = args.clone();
            bare_args.extend(["--mode", "bare"]);
            let held = a.held_connections.to_string();
            args.extend(["--held-connections", &held]);
            // The layered server first: it migrates the store and creates the charges table.
            let layered = Server::start(&args, a.server_threads).await?;
            let bare = Server::start(&bare_args, a.server_threads).await?;
            type Variant<'s> = (&'static str, &'s Server, Keys, Option<u64>);
            let variants: [Variant<'_>; 3] = [
                ("no layer", &bare, Keys::None, None),
                ("layer, first execution", &layered, Keys::Fresh, None),
                ("layer, replay", &layered, Keys::Repeated, None),
            ];
            let work = Some(a.work_ms).filter(|ms| *ms > 0);
            let slow: [Variant<'_>; 2] = [
                (SLOW_BARE, &bare, Keys::None, work),
                (SLOW_LAYER, &layered, Keys::Fresh, work),
            ];
            // One group of cells per client count, the slow handler's last; the cells of a
            // group rotate each round.
            let mut groups: Vec<(usize, &[Variant<'_>])> =
                a.clients.iter().map(|&c| (c, &variants[..])).collect();
            if work.is_some() {
                groups.push((a.work_clients, &slow[..]));
            }
            let mut store_rows: Vec<Vec<Row>> = groups
                .iter()
                .map(|&(clients, cells)| {
                    cells
                        .iter()
                        .map(|&(variant, ..)| Row {
                            store: t.name.to_owned(),
                            variant,
                            clients,
                            rounds: Vec::new(),
                        })
                        .collect()
                })
                .collect();
            for round in 0..a.rounds {
                for (g, &(clients, cells)) in groups.iter().enumerate() {
                    for k in 0..cells.len() {
                        let v = (k + round) % cells.len();
                        let (_, server, keys, work) = cells[v];
                        let id = format!("{name}-{run}-{g}-{clients}-{round}-{v}");
                        let sample = measure_cell(
                            server,
                            redis.as_ref(),
                            clients,
                            keys,
                            work,
                            &id,
                            warmup,
                            measure,
                        )
                        .await?;
                        store_rows[g][v].rounds.push(sample);
                    }
                }
            }
            let store_rows: Vec<Row> = store_rows.into_iter().flatten().collect();
            layered.stop().await;
            bare.stop().await;
            anyhow::Ok(store_rows)
        }
        .await;
        t.cleanup.run().await;
        match result {
            Ok(r) => rows.extend(r),
            Err(e) => {
                let line = format!("{name}: failed ({e:#})");
                eprintln!("{line}");
                notes.push(line);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);

    let function = if a.no_function {
        None
    } else {
        // Interleaved rounds, idem then Powertools, so that drift hits both; medians shown.
        let redis = url_or(&a.redis, "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
        let seconds = a.seconds;
        let count = 1000;
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-powertools.py");
        let pid = redis_pid(&redis).await;
        let (mut idem, mut powertools) = (Vec::new(), Vec::new());
        let mut powertools_error = None;
        for _ in 0..a.rounds.max(1) {
            let r = redis.clone();
            idem.push(
                tokio::task::spawn_blocking(move || function::idem_rates(&r, pid, seconds, count))
                    .await??,
            );
            if powertools_error.is_some() {
                continue;
            }
            let (python, script, r) = (a.python.clone(), script.clone(), redis.clone());
            match tokio::task::spawn_blocking(move || {
                function::powertools_rates(&python, &script, &r, pid, seconds, count)
            })
            .await?
            {
                Ok(p) => powertools.push(p),
                Err(e) => powertools_error = Some(e),
            }
        }
        if let Some(e) = powertools_error {
            let line = format!("Powertools: skipped ({e:#})");
            eprintln!("{line}");
            notes.push(line);
        }
        let idem = function::Rates::median(&idem);
        let powertools = (!powertools.is_empty()).then(|| function::Rates::median(&powertools));
        Some((idem, powertools))
    };

    let cpu_end = host_cpu();
    let total = cpu_end.2.saturating_sub(cpu_start.2).max(1) as f64;
    notes.push(format!(
        "host during the run: {:.0} % of all CPU time busy (bench, servers, databases and anything else), {:.1} % stolen by the hypervisor; {} CPUs",
        100.0 * cpu_end.0.saturating_sub(cpu_start.0) as f64 / total,
        100.0 * cpu_end.1.saturating_sub(cpu_start.1) as f64 / total,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let ping = if a.stores.iter().any(|s| s == "redis") {
        let redis = url_or(&a.redis, "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
        redis_ping_p50(&redis).await.ok()
    } else {
        None
    };
    print!("{}", report(&a, &rows, function.as_ref(), ping, &notes));
    Ok(())
}

/// The median latency of one Redis round trip (PING) from this process, in µs.
async fn redis_ping_p50(url: &str) -> Result<f64> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut micros = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = std::time::Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        micros.push(t.elapsed().as_secs_f64() * 1e6);
    }
    micros.sort_by(f64::total_cmp);
    Ok(micros[micros.len() / 2])
}

fn report(
    a: &BenchArgs,
    rows: &[Row],
    function: Option<&(function::Rates, Option<function::Rates>)>,
    redis_ping_p50: Option<f64>,
    notes: &[String],
) -> String {
    let mut out = String::new();
    // A variant's baseline: the same handler without the layer.
    let baseline = |variant: &str| {
        if variant == SLOW_LAYER || variant == SLOW_BARE {
            SLOW_BARE
        } else {
            "no layer"
        }
    };
    let base = |store: &str, clients: usize, variant: &str| {
        rows.iter()
            .find(|r| r.store == store && r.clients == clients && r.variant == baseline(variant))
            .map(|r| median_of(&r.rounds, |s| f64::from(s.p50_us)))
    };
    let floor = |clients: usize| {
        rows.iter()
            .find(|r| r.store == "none" && r.clients == clients)
            .map(|r| median_of(&r.rounds, |s| f64::from(s.p50_us)))
    };
    let _ = writeln!(
        out,
        "\nHTTP: POST /charges over loopback TCP, keep-alive HTTP/1.1, {} s per cell after a {} s warm-up, {} interleaved rounds (median round shown; min–max req/s across rounds); slow handler: {} ms of work before its one write; the layer's store on PostgreSQL and MySQL: {}\n",
        a.seconds,
        a.seconds / 5.0,
        a.rounds,
        a.work_ms,
        match a.held_connections {
            0 => "sqlx's pool (as the service without the layer)".to_owned(),
            n => format!("{n} held connections (the service without the layer: sqlx's pool)"),
        }
    );
    let _ = writeln!(
        out,
        "| store | variant | clients | req/s | min – max | p50 µs | p99 µs | p50 − no layer | p50 − floor | server CPU µs/req | unexpected |"
    );
    let _ = writeln!(
        out,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let m = r.median();
        let lo = r
            .rounds
            .iter()
            .map(|s| s.per_second)
            .fold(f64::INFINITY, f64::min);
        let hi = r.rounds.iter().map(|s| s.per_second).fold(0.0, f64::max);
        let p50 = median_of(&r.rounds, |s| f64::from(s.p50_us));
        let p99 = median_of(&r.rounds, |s| f64::from(s.p99_us));
        let vs = |b: Option<f64>| match b {
            Some(b) if baseline(r.variant) != r.variant && r.store != "none" => {
                format!("{:+.0}", p50 - b)
            }
            _ => "—".to_owned(),
        };
        let unexpected: usize = r.rounds.iter().map(|s| s.unexpected).sum();
        let cpu = median_of(&r.rounds, |s| s.server_cpu_us);
        let redis_cpu = median_of(&r.rounds, |s| s.redis_cpu_us);
        let cpu = if redis_cpu > 0.0 {
            format!("{cpu:.0} + Redis {redis_cpu:.0}")
        } else {
            format!("{cpu:.0}")
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.0} – {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |",
            r.store,
            r.variant,
            r.clients,
            m.per_second,
            lo,
            hi,
            p50,
            p99,
            vs(base(&r.store, r.clients, r.variant)),
            if r.store == "none" {
                "—".to_owned()
            } else {
                format!("{:+.0}", p50 - floor(r.clients).unwrap_or(0.0))
            },
            cpu,
            unexpected
        );
        if let Some(example) = r.rounds.iter().find_map(|s| s.example.as_ref()) {
            let _ = writeln!(
                out,
                "|  | first unexpected answer: {} |  |  |  |  |  |  |  |  |  |",
                example.replace('|', "\\|")
            );
        }
    }
    // Redis commands per request of the Redis rows.
    let mut commands = Vec::new();
    for r in rows.iter().filter(|r| r.store.starts_with("Redis")) {
        let mut per: Vec<f64> = r.rounds.iter().filter_map(|s| s.redis_commands).collect();
        if per.is_empty() {
            continue;
        }
        per.sort_by(f64::total_cmp);
        commands.push(format!(
            "- Redis commands per request, {}, {} client(s): {:.2}",
            r.variant,
            r.clients,
            per[per.len() / 2]
        ));
    }
    if !commands.is_empty() {
        let _ = writeln!(
            out,
            "\nRedis commands per request (median over the rounds; INFO commandstats over each cell, warm-up included, counting the commands a script runs; all clients of the server together, so other users of the server add to it):\n"
        );
        for line in commands {
            let _ = writeln!(out, "{line}");
        }
    }
    if let Some((idem, powertools)) = function {
        let _ = writeln!(
            out,
            "\nFunction level on Redis, single-threaded (one call at a time), {} s per leg, {} interleaved rounds (median of each column); the floor is the client's own PING rate (one round trip, no work): a first call needs two round trips (floor = PING/s ÷ 2), a replay one (floor = PING/s); round trips counted by each client, commands by Redis (INFO commandstats, which counts the commands a Lua script runs too), over 1000 calls each; µs over PING = a call's time less one PING's, i.e. the library's own cost on the client plus the server's work\n",
            a.seconds,
            a.rounds.max(1)
        );
        let _ = writeln!(
            out,
            "| implementation | first calls/s | replays/s | client's PING/s (the floor) | first calls ÷ floor | replays ÷ floor | round trips per first call | per replay | Redis commands per first call | per replay | replay µs over one PING |"
        );
        let _ = writeln!(
            out,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let name = |r: &function::Rates| match &r.powertools {
            Some(v) => format!("Powertools {v} `idempotent_function` (Redis persistence layer)"),
            None => "idem `Idempotency::call` (idem-redis)".to_owned(),
        };
        let all: Vec<&function::Rates> = std::iter::once(idem).chain(powertools.as_ref()).collect();
        for r in &all {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
                name(r),
                r.first_per_s,
                r.replay_per_s,
                r.pings_per_s,
                r.first_vs_floor(),
                r.replay_vs_floor(),
                r.round_trips_per_first,
                r.round_trips_per_replay,
                r.commands_per_first,
                r.commands_per_replay,
                1e6 / r.replay_per_s - 1e6 / r.pings_per_s
            );
        }
        let _ = writeln!(
            out,
            "\nWhere a call's time goes (CPU µs per call over the timed legs, from /proc/<pid>/stat: the client's thread — idem's current-thread runtime, Powertools' Python process — and redis-server; the rest of a call's wall time is waiting: the round trips' wake-ups and the network stack)\n"
        );
        let _ = writeln!(
            out,
            "| implementation | first call: wall µs | client CPU µs | redis-server CPU µs | replay: wall µs | client CPU µs | redis-server CPU µs | one PING: wall µs |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &all {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
                name(r),
                1e6 / r.first_per_s,
                r.client_cpu_us_first,
                r.redis_cpu_us_first,
                1e6 / r.replay_per_s,
                r.client_cpu_us_replay,
                r.redis_cpu_us_replay,
                1e6 / r.pings_per_s
            );
        }
        let _ = writeln!(out);
        for r in &all {
            let _ = writeln!(
                out,
                "- Redis commands by name, {}: first call {}; replay {}",
                name(r),
                function::mix_text(&r.mix_first),
                function::mix_text(&r.mix_replay)
            );
        }
        let verdict = |x: f64| if x >= 0.9 { "met" } else { "missed" };
        let _ = writeln!(
            out,
            "- idem against the round-trip floor: first calls {:.2}× ({}), replays {:.2}× ({}) (target ≥ 0.9×)",
            idem.first_vs_floor(),
            verdict(idem.first_vs_floor()),
            idem.replay_vs_floor(),
            verdict(idem.replay_vs_floor())
        );
        if let Some(p) = powertools {
            let _ = writeln!(
                out,
                "- idem / Powertools: first calls {:.1}×, replays {:.1}× (target ≥ 10×)",
                idem.first_per_s / p.first_per_s,
                idem.replay_per_s / p.replay_per_s
            );
        }
    }
    for r in rows
        .iter()
        .filter(|r| r.store.starts_with("Redis") && r.variant == "layer, replay")
    {
        let p50 = median_of(&r.rounds, |s| f64::from(s.p50_us));
        if let Some(f) = floor(r.clients) {
            let rtt = match redis_ping_p50 {
                Some(rtt) if r.clients == 1 => format!(
                    "; one Redis round trip (PING from the bench process) is {rtt:.0} µs p50, leaving {:+.0} µs for the layer's own work",
                    p50 - f - rtt
                ),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "- Redis replay, {} client(s): p50 {:.0} µs, {:+.0} µs over the HTTP floor (target ≤ +100 µs){rtt}",
                r.clients,
                p50,
                p50 - f
            );
        }
    }
    for r in rows.iter().filter(|r| r.variant == SLOW_LAYER) {
        let bare = rows
            .iter()
            .find(|b| b.store == r.store && b.clients == r.clients && b.variant == SLOW_BARE);
        if let Some(bare) = bare {
            let (layer, bare) = (r.median().per_second, bare.median().per_second);
            let _ = writeln!(
                out,
                "- slow handler ({} ms of work, then one write), {} clients, {}: {:.0} req/s with the layer, {:.0} without ({:.2}×; the work alone allows {:.0})",
                a.work_ms,
                r.clients,
                r.store,
                layer,
                bare,
                layer / bare.max(f64::MIN_POSITIVE),
                r.clients as f64 * 1000.0 / a.work_ms.max(1) as f64
            );
        }
    }
    for n in notes {
        let _ = writeln!(out, "- {n}");
    }
    if !a.markdown {
        out = out.replace("| ", "").replace(" |", "  ");
    }
    out
}
