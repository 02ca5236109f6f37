//! Phases: an operation with a foreign call between two local phases, through
//! `Idempotency::run_phases`, next to the same work written by hand.
//!
//! The operation: phase A inserts an order; phase B calls a third party (an HTTP server on
//! loopback in this process, answering 200 JSON) with a key derived from the idempotency key
//! as `Idempotency-Key`; phase C inserts the charge with the answer. Variants:
//!
//! - `idem`: `run_phases` with phases A → B → C → Done.
//! - `hand`: what a careful user writes without idem, with a recovery point: take the key
//!   (insert into a key table), commit; A's insert and the point's UPDATE, commit; the call;
//!   C's insert and the final UPDATE (the response), commit.
//! - `hand-4`: by hand with idem's four commits: the key with the first point; A and the
//!   point; the call's answer as a point of its own; C and the response. (Before the take
//!   wrote the first point, idem made five: the first point committed alone.)
//! - `hand-min`: the fewest commits a correct version needs: the key, A and the point in one
//!   commit; the call; C and the response in one commit.
//!
//! Commits per operation are counted on PostgreSQL (the `xact_commit` delta of a database of
//! the bench's own, over a separate pass, which counts every autocommit statement too, reads
//! included; each connection is made to report its counts before they are read) and on SQLite
//! (a commit hook on every pooled connection: write transactions only).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{IdempotencyKey, Migrate as _, RequestScope};
use idem_request::{Idempotency, PhaseCtx, Step};
use idem_sql::{PostgresStore, SqliteOptions, SqliteStore};
use serde::{Deserialize, Serialize};
use sqlx::ConnectOptions as _;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::{Settings, measure, plural, thousands};

/// The PostgreSQL schema the part works in, dropped at the end.
const SCHEMA: &str = "idem_bench_phases";
/// Operations per commit-counting pass.
const COUNT_OPS: u64 = 200;

/// The three ways of writing the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Idem,
    Hand,
    HandIdem,
    HandMin,
}

impl Way {
    const ALL: [Way; 4] = [Way::Idem, Way::Hand, Way::HandIdem, Way::HandMin];

    fn label(self) -> &'static str {
        match self {
            Way::Idem => "idem run_phases (A, B foreign, C)",
            Way::Hand => "by hand, same points (3 commits)",
            Way::HandIdem => "by hand, idem's commits (4)",
            Way::HandMin => "by hand, fewest commits (2)",
        }
    }
}

/// The phases of the idem variant.
#[derive(Serialize, Deserialize)]
enum Phase {
    /// Local: the order row.
    Order,
    /// Foreign: the call to the third party.
    Charge { order: i64 },
    /// Local: the charge row with the third party's answer.
    Record { order: i64, charge: String },
}

/// The third party's answer.
#[derive(Deserialize)]
struct Charged {
    charge: String,
}

/// The in-process third party: answers every POST with the key it was sent, as JSON.
async fn serve() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/charge",
        axum::routing::post(async |headers: axum::http::HeaderMap| {
            let key = headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                format!("{{\"charge\":\"ch_{}\"}}", key.len()),
            )
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("warning: the phases bench's HTTP server stopped: {e}");
        }
    });
    Ok(format!("http://{addr}/charge"))
}

/// Calls the third party with `key`; returns its charge ID.
async fn call(http: &reqwest::Client, url: &str, key: &str) -> anyhow::Result<String> {
    let body = http
        .post(url)
        .header("Idempotency-Key", key)
        .send()
        .await?
        .error_for_status()?
        .bytes()
        .await?;
    Ok(serde_json::from_slice::<Charged>(&body)?.charge)
}

/// Tables of the part, the same DDL on both databases.
const TABLES: &str = "CREATE TABLE phase_orders (id INTEGER PRIMARY KEY{AUTO}, op TEXT NOT NULL);
     CREATE TABLE phase_charges (order_id BIGINT NOT NULL, charge TEXT NOT NULL);
     CREATE TABLE phase_keys (key TEXT PRIMARY KEY, point TEXT NOT NULL, order_id BIGINT,
                              response TEXT)";
const ORDER: &str = "INSERT INTO phase_orders (op) VALUES ($1) RETURNING id";
const CHARGE: &str = "INSERT INTO phase_charges (order_id, charge) VALUES ($1, $2)";
const TAKE: &str = "INSERT INTO phase_keys (key, point) VALUES ($1, 'order')";
const TAKE_AT: &str = "INSERT INTO phase_keys (key, point, order_id) VALUES ($1, 'charge', $2)";
const POINT: &str = "UPDATE phase_keys SET point = 'charge', order_id = $1 WHERE key = $2";
const ANSWER: &str = "UPDATE phase_keys SET point = 'record', response = $1 WHERE key = $2";
const FINISH: &str = "UPDATE phase_keys SET point = 'done', response = $1 WHERE key = $2";

/// One operation of each way, on one store type (the SQL is the same on both).
macro_rules! ways {
    ($name:ident, $store:ty) => {
        async fn $name(
            way: Way,
            store: &$store,
            idem: &Idempotency<$store>,
            http: &reqwest::Client,
            url: &str,
            op: &str,
        ) -> anyhow::Result<()> {
            let foreign = format!("{op}/charge");
            match way {
                Way::Idem => {
                    let key = IdempotencyKey::new(op)?;
                    let _: String = idem
                        .run_phases(
                            RequestScope::new(["phases"]),
                            &key,
                            &1250_i64,
                            Phase::Order,
                            async |phase, ctx: &mut PhaseCtx<$store>| {
                                Ok::<_, anyhow::Error>(match phase {
                                    Phase::Order => {
                                        let order: i64 = sqlx::query_scalar(ORDER)
                                            .bind(op)
                                            .fetch_one(&mut **ctx.tx())
                                            .await?;
                                        Step::Next(Phase::Charge { order })
                                    }
                                    Phase::Charge { order } => {
                                        let key = ctx.foreign_key("charge").to_string();
                                        let charge = call(http, url, &key).await?;
                                        Step::Next(Phase::Record { order, charge })
                                    }
                                    Phase::Record { order, charge } => {
                                        sqlx::query(CHARGE)
                                            .bind(order)
                                            .bind(&charge)
                                            .execute(&mut **ctx.tx())
                                            .await?;
                                        Step::Done(charge)
                                    }
                                })
                            },
                        )
                        .await?;
                }
                Way::Hand => {
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(TAKE).bind(op).execute(&mut *tx).await?;
                    tx.commit().await?;
                    let mut tx = store.begin_tx().await?;
                    let order: i64 = sqlx::query_scalar(ORDER)
                        .bind(op)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(POINT)
                        .bind(order)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    let charge = call(http, url, &foreign).await?;
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(CHARGE)
                        .bind(order)
                        .bind(&charge)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query(FINISH)
                        .bind(&charge)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
                Way::HandIdem => {
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(TAKE).bind(op).execute(&mut *tx).await?;
                    tx.commit().await?;
                    let mut tx = store.begin_tx().await?;
                    let order: i64 = sqlx::query_scalar(ORDER)
                        .bind(op)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(POINT)
                        .bind(order)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    let charge = call(http, url, &foreign).await?;
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(ANSWER)
                        .bind(&charge)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(CHARGE)
                        .bind(order)
                        .bind(&charge)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query(FINISH)
                        .bind(&charge)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
                Way::HandMin => {
                    let mut tx = store.begin_tx().await?;
                    let order: i64 = sqlx::query_scalar(ORDER)
                        .bind(op)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(TAKE_AT)
                        .bind(op)
                        .bind(order)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    let charge = call(http, url, &foreign).await?;
                    let mut tx = store.begin_tx().await?;
                    sqlx::query(CHARGE)
                        .bind(order)
                        .bind(&charge)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query(FINISH)
                        .bind(&charge)
                        .bind(op)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
            }
            Ok(())
        }
    };
}

ways!(pg_op, PostgresStore);
ways!(sqlite_op, SqliteStore);

/// A store of either kind, with its engine.
#[derive(Clone)]
enum Backend {
    Pg(PostgresStore, Idempotency<PostgresStore>),
    Sqlite(SqliteStore, Idempotency<SqliteStore>),
}

impl Backend {
    async fn run(
        &self,
        way: Way,
        http: &reqwest::Client,
        url: &str,
        op: &str,
    ) -> anyhow::Result<()> {
        match self {
            Backend::Pg(s, i) => pg_op(way, s, i, http, url, op).await,
            Backend::Sqlite(s, i) => sqlite_op(way, s, i, http, url, op).await,
        }
    }
}

/// Numbers operations across the whole part, so every idempotency key is new.
static OPS: AtomicU64 = AtomicU64::new(0);

fn next_op(run: u32) -> String {
    format!("op-{run:08x}-{}", OPS.fetch_add(1, Ordering::Relaxed))
}

/// One measurement: operations per second in the window, and every counted latency.
async fn window(
    backend: &Backend,
    way: Way,
    workers: usize,
    settings: &Settings,
    http: &reqwest::Client,
    url: &str,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let w = settings.window;
    let warm_end = Instant::now() + w.warmup;
    let end = warm_end + w.measure;
    // The workers are polled by this task rather than spawned: an async closure over
    // `&mut PhaseCtx` does not prove `Send` for every lifetime (the same reason the completer's
    // registration wraps `step`). The work is I/O (the database, the HTTP server on its own
    // tasks), the same for every variant.
    let worker = async |_| {
        let mut lat = Vec::new();
        while Instant::now() < end {
            let op = next_op(settings.run);
            let t = Instant::now();
            backend.run(way, http, url, &op).await?;
            let done = Instant::now();
            if t >= warm_end && done <= end {
                lat.push(done - t);
            }
        }
        anyhow::Ok(lat)
    };
    let all: Vec<Duration> = futures_util::future::try_join_all((0..workers).map(worker))
        .await?
        .into_iter()
        .flatten()
        .collect();
    Ok((all.len() as f64 / w.measure.as_secs_f64(), all))
}

/// The measured figures of one way.
struct Row {
    way: Way,
    rates: Vec<f64>,
    latencies: Vec<Duration>,
    commits: Option<f64>,
}

impl Row {
    fn rate(&self) -> f64 {
        measure::median_of(self.rates.iter().copied()).unwrap_or(0.0)
    }

    fn pct(&self, p: f64) -> f64 {
        let mut v: Vec<Duration> = self.latencies.clone();
        v.sort();
        if v.is_empty() {
            return 0.0;
        }
        let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
        v[i].as_secs_f64() * 1000.0
    }
}

/// One table: the three ways on one database at one worker count.
struct Table {
    title: String,
    rows: Vec<Row>,
}

/// The part's report.
pub(crate) struct Report {
    tables: Vec<Table>,
    notes: Vec<String>,
}

impl Report {
    /// The tables as Markdown.
    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        for t in &self.tables {
            let _ = writeln!(out, "\n### {}\n", t.title);
            let _ = writeln!(
                out,
                "| variant | commits/op (counted) | ops/s (median) | min – max | p50 ms | p99 ms | × idem |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
            let idem = t.rows.first().map(Row::rate).unwrap_or(0.0);
            for r in &t.rows {
                let lo = r.rates.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = r.rates.iter().copied().fold(0.0, f64::max);
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} – {} | {:.2} | {:.2} | {} |",
                    r.way.label(),
                    r.commits.map_or("–".to_string(), |c| format!("{c:.2}")),
                    thousands(r.rate()),
                    thousands(if lo.is_finite() { lo } else { 0.0 }),
                    thousands(hi),
                    r.pct(0.5),
                    r.pct(0.99),
                    if idem > 0.0 {
                        format!("{:.2}", r.rate() / idem)
                    } else {
                        "–".to_string()
                    }
                );
            }
            let _ = writeln!(out);
            if let (Some(i), Some(h)) = (t.rows.first(), t.rows.get(1))
                && h.rate() > 0.0
            {
                let _ = writeln!(
                    out,
                    "- idem ÷ by hand (same points): {:.2} ops/s, {:.2} p50",
                    i.rate() / h.rate(),
                    if h.pct(0.5) > 0.0 {
                        i.pct(0.5) / h.pct(0.5)
                    } else {
                        0.0
                    }
                );
            }
            if let (Some(i), Some(h)) = (t.rows.first(), t.rows.get(2))
                && h.rate() > 0.0
            {
                let _ = writeln!(
                    out,
                    "- idem ÷ by hand with idem's commits: {:.2} ops/s, {:.2} p50",
                    i.rate() / h.rate(),
                    if h.pct(0.5) > 0.0 {
                        i.pct(0.5) / h.pct(0.5)
                    } else {
                        0.0
                    }
                );
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "- {n}");
        }
        out
    }

    /// The tables as plain text (the same Markdown: it reads fine in a terminal).
    pub(crate) fn plain(&self) -> String {
        self.markdown()
    }
}

/// Measures the three ways on PostgreSQL (when reachable) and SQLite.
pub(crate) async fn run(
    pg_url: &str,
    settings: &Settings,
    worker_counts: &[usize],
) -> anyhow::Result<Report> {
    let url = serve().await?;
    let http = reqwest::Client::new();
    let mut tables = Vec::new();
    let mut notes = Vec::new();

    // PostgreSQL, in a schema of its own.
    match pg_store(pg_url, 16).await {
        Ok((store, admin)) => {
            let backend = Backend::Pg(store.clone(), Idempotency::builder(store.clone()).build()?);
            let counts = pg_commits(pg_url, &http, &url, settings).await?;
            for &w in worker_counts {
                tables.push(
                    measure_table(
                        format!("Phases, PostgreSQL, {}", plural(w, "worker")),
                        &backend,
                        w,
                        settings,
                        &http,
                        &url,
                        &counts,
                    )
                    .await?,
                );
            }
            store.pool().close().await;
            let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
                .execute(&admin)
                .await;
        }
        Err(e) => notes.push(format!(
            "PostgreSQL skipped: {} unreachable ({e:#})",
            idem_redact::redact_url(pg_url)
        )),
    }

    // SQLite, a temporary file with the store's defaults.
    let dir = std::env::temp_dir().join(format!("idem-bench-phases-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = sqlite_part(&dir, settings, worker_counts, &http, &url).await;
    let _ = std::fs::remove_dir_all(&dir);
    tables.extend(result?);
    notes.push(format!(
        "commits/op: PostgreSQL, the xact_commit delta of a database of the bench's own \
         ({COUNT_DB}) over {COUNT_OPS} sequential operations on a pool of {COUNT_CONNS} \
         connections, each made to report its counts before every read (every transaction \
         counts, an autocommit read too; median of 3 passes); SQLite, a commit hook on every \
         pooled connection over {COUNT_OPS} operations (write transactions only)"
    ));
    Ok(Report { tables, notes })
}

async fn sqlite_part(
    dir: &std::path::Path,
    settings: &Settings,
    worker_counts: &[usize],
    http: &reqwest::Client,
    url: &str,
) -> anyhow::Result<Vec<Table>> {
    let store = SqliteStore::open(dir.join("phases.sqlite"), SqliteOptions::default()).await?;
    store.migrate().await?;
    sqlx::raw_sql(&TABLES.replace("{AUTO}", ""))
        .execute(store.pool())
        .await?;
    let idem = Idempotency::builder(store.clone()).build()?;
    let backend = Backend::Sqlite(store.clone(), idem);
    // A commit hook on every connection the pool holds.
    let commits = Arc::new(AtomicU64::new(0));
    let mut held = Vec::new();
    for _ in 0..store.pool().options().get_max_connections() {
        let mut conn = store.pool().acquire().await?;
        let c = Arc::clone(&commits);
        conn.lock_handle().await?.set_commit_hook(move || {
            c.fetch_add(1, Ordering::Relaxed);
            true
        });
        held.push(conn);
    }
    drop(held);
    let mut counts = Vec::new();
    for way in Way::ALL {
        let before = commits.load(Ordering::Relaxed);
        for _ in 0..COUNT_OPS {
            backend.run(way, http, url, &next_op(settings.run)).await?;
        }
        counts.push(Some(
            (commits.load(Ordering::Relaxed) - before) as f64 / COUNT_OPS as f64,
        ));
    }
    let mut tables = Vec::new();
    for &w in worker_counts {
        tables.push(
            measure_table(
                format!("Phases, SQLite, {}", plural(w, "worker")),
                &backend,
                w,
                settings,
                http,
                url,
                &counts,
            )
            .await?,
        );
    }
    store.pool().close().await;
    Ok(tables)
}

async fn measure_table(
    title: String,
    backend: &Backend,
    workers: usize,
    settings: &Settings,
    http: &reqwest::Client,
    url: &str,
    commits: &[Option<f64>],
) -> anyhow::Result<Table> {
    eprintln!("{title}");
    let mut rows: Vec<Row> = Way::ALL
        .iter()
        .zip(commits)
        .map(|(&way, &commits)| Row {
            way,
            rates: Vec::new(),
            latencies: Vec::new(),
            commits,
        })
        .collect();
    let n = rows.len();
    for round in 0..settings.rounds {
        for k in 0..n {
            let i = (k + round) % n;
            let (rate, lat) = window(backend, rows[i].way, workers, settings, http, url).await?;
            eprintln!(
                "  round {}/{}  {:<40} {:>8} ops/s",
                round + 1,
                settings.rounds,
                rows[i].way.label(),
                thousands(rate)
            );
            rows[i].rates.push(rate);
            rows[i].latencies.extend(lat);
        }
    }
    Ok(Table { title, rows })
}

/// A store in [`SCHEMA`] (created afresh, tables and migration included) with `max`
/// connections, and an admin pool outside it.
async fn pg_store(url: &str, max: u32) -> anyhow::Result<(PostgresStore, sqlx::PgPool)> {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await?;
    sqlx::raw_sql(&format!(
        "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}"
    ))
    .execute(&admin)
    .await?;
    let store = PostgresStore::from_pool(schema_pool(url, max).await?);
    store.migrate().await?;
    sqlx::raw_sql(
        &TABLES
            .replace("{AUTO}", " GENERATED ALWAYS AS IDENTITY")
            .replace("id INTEGER", "id BIGINT"),
    )
    .execute(store.pool())
    .await?;
    Ok((store, admin))
}

async fn schema_pool(url: &str, max: u32) -> anyhow::Result<sqlx::PgPool> {
    let options: PgConnectOptions = url
        .parse::<PgConnectOptions>()?
        .options([("search_path", SCHEMA)])
        .disable_statement_logging();
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await?)
}

/// The database commits are counted in: the bench's own, so that no other session's commits
/// add (the shared test database's count moves with every other user's), dropped at the end.
const COUNT_DB: &str = "idem_bench_phases_count";
/// Connections of the counting pool: an execution's transaction and its take's lookup.
const COUNT_CONNS: u32 = 2;

/// Commits per operation of every way on PostgreSQL, in [`COUNT_DB`]: for each, the median of
/// 3 passes of [`COUNT_OPS`] sequential operations.
///
/// A backend adds its commits to the database's `xact_commit` when it reports its statistics:
/// at most once a second while idle, and when it exits — late, after the client has gone,
/// which is why reading the count right after closing a pool undercounted (4.00 for idem's
/// 7). Here every connection of the pool is made to report before each read
/// (`pg_stat_force_next_flush()`, PostgreSQL 15+: the report then goes out before the
/// statement's answer), so the count is exact; the reads run on a connection to another
/// database, and the one reporting statement per connection is subtracted.
async fn pg_commits(
    url: &str,
    http: &reqwest::Client,
    call_url: &str,
    settings: &Settings,
) -> anyhow::Result<Vec<Option<f64>>> {
    let mut admin = url.parse::<PgConnectOptions>()?.connect().await?;
    let drop_db = format!("DROP DATABASE IF EXISTS {COUNT_DB} WITH (FORCE)");
    sqlx::raw_sql(&drop_db).execute(&mut admin).await?;
    sqlx::raw_sql(&format!("CREATE DATABASE {COUNT_DB}"))
        .execute(&mut admin)
        .await?;
    let counted = async {
        let options = url
            .parse::<PgConnectOptions>()?
            .database(COUNT_DB)
            .disable_statement_logging();
        let setup = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await?;
        PostgresStore::from_pool(setup.clone()).migrate().await?;
        sqlx::raw_sql(
            &TABLES
                .replace("{AUTO}", " GENERATED ALWAYS AS IDENTITY")
                .replace("id INTEGER", "id BIGINT"),
        )
        .execute(&setup)
        .await?;
        setup.close().await;
        let mut counts = Vec::new();
        for way in Way::ALL {
            let mut passes = Vec::new();
            for _ in 0..3 {
                let pool = PgPoolOptions::new()
                    .max_connections(COUNT_CONNS)
                    .connect_with(options.clone())
                    .await?;
                report_all(&pool).await?;
                let before = xact_commit(&mut admin).await?;
                let store = PostgresStore::from_pool(pool.clone());
                let backend = Backend::Pg(store.clone(), Idempotency::builder(store).build()?);
                for _ in 0..COUNT_OPS {
                    backend
                        .run(way, http, call_url, &next_op(settings.run))
                        .await?;
                }
                report_all(&pool).await?;
                let after = xact_commit(&mut admin).await?;
                pool.close().await;
                let n = after
                    .saturating_sub(before)
                    .saturating_sub(u64::from(COUNT_CONNS));
                passes.push(n as f64 / COUNT_OPS as f64);
            }
            counts.push(measure::median_of(passes.into_iter()));
        }
        anyhow::Ok(counts)
    }
    .await;
    let _ = sqlx::raw_sql(&drop_db).execute(&mut admin).await;
    counted
}

/// Makes every connection of `pool` (all [`COUNT_CONNS`] of them, opened if need be, each held
/// at once so none is visited twice) report its statistics now: one commit each.
async fn report_all(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let mut held = Vec::new();
    for _ in 0..COUNT_CONNS {
        held.push(pool.acquire().await?);
    }
    for conn in &mut held {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&mut **conn)
            .await?;
    }
    Ok(())
}

/// The committed transactions of [`COUNT_DB`] so far, read from another database.
async fn xact_commit(admin: &mut sqlx::PgConnection) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(COUNT_DB)
        .fetch_one(admin)
        .await?;
    Ok(u64::try_from(n)?)
}
