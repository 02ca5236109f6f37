//! The `redeliveries` scenario: the consumer runner with its local cache of committed claims
//! (`Consumer::local_cache`) off and on, side by side, on a stream where 30 % of the
//! deliveries are same-process redeliveries of a message committed shortly before.
//!
//! The runner is the real one (`idem_consumer::Consumer`), fed by idem-consumer's in-memory
//! broker so the database is the only outside party; the store is idem-sql's on PostgreSQL (a
//! schema of its own, dropped afterwards) and on SQLite (a temporary file). A wrapper around
//! the store counts its round trips: `BEGIN`, the claim statement, `COMMIT`/`ROLLBACK`, plus
//! the handler's one statement, so the report gives round trips per delivery with the cache
//! and without, next to deliveries per second.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_consumer::{CancellationToken, Consumer, InMemoryBroker, Json, LocalCache, RunStats};
use idem_core::{
    BatchClaimStore, BoxError, ClaimRequest, ClaimStore, ConsumerName, Error, ErrorKind,
    Fingerprint, Handler, Identified, Message, MessageId, Migrate, Processor, SetHandler, Stamp,
    TransactionalStore,
};
use idem_sql::{PostgresStore, PostgresTx, SqliteOptions, SqliteStore, SqliteTx};

/// Share of deliveries that repeat an earlier message.
const REDELIVERED: f64 = 0.30;
/// How far behind its first delivery a redelivery comes, in deliveries: after its commit.
const LAG: usize = 400;

/// One variant's measurement.
#[derive(Debug, Clone, Copy)]
struct Measured {
    per_second: f64,
    round_trips_per_delivery: f64,
    cache_hits: u64,
}

/// One table row: a store and a mode, the cache off and on (medians over the rounds).
#[derive(Debug)]
struct Row {
    store: &'static str,
    mode: String,
    deliveries: usize,
    off: Measured,
    on: Measured,
}

/// The scenario's report.
#[derive(Debug)]
pub(crate) struct Report {
    rows: Vec<Row>,
    rounds: usize,
}

/// A store wrapper counting the round trips each call makes on idem-sql's stores (which send
/// `BEGIN` and the claim one after the other).
#[derive(Debug, Clone)]
struct Counted<S> {
    inner: S,
    trips: Arc<AtomicU64>,
}

impl<S> Counted<S> {
    fn add(&self, n: u64) {
        self.trips.fetch_add(n, Ordering::Relaxed);
    }
}

impl<S: TransactionalStore> TransactionalStore for Counted<S> {
    type Tx = S::Tx;
    async fn begin(&self) -> Result<S::Tx, Error> {
        self.add(1);
        self.inner.begin().await
    }
    async fn commit(&self, tx: S::Tx) -> Result<(), Error> {
        self.add(1);
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: S::Tx) -> Result<(), Error> {
        self.add(1);
        self.inner.rollback(tx).await
    }
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        self.inner.classify(error)
    }
    async fn probe(&self) -> Result<(), Error> {
        self.inner.probe().await
    }
}

impl<S: ClaimStore + Sync> ClaimStore for Counted<S>
where
    S::Tx: Send,
{
    fn max_message_id_len(&self) -> usize {
        self.inner.max_message_id_len()
    }
    fn kept_for(&self) -> Option<Duration> {
        self.inner.kept_for()
    }
    async fn claim(
        &self,
        tx: &mut S::Tx,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        self.add(1);
        self.inner.claim(tx, claim).await
    }
}

impl<S: BatchClaimStore + Sync> BatchClaimStore for Counted<S>
where
    S::Tx: Send,
{
    async fn claim_many(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        self.add(1);
        self.inner.claim_many(tx, consumer, items, at).await
    }
}

#[derive(Debug, serde::Deserialize)]
struct Charge {
    amount: i64,
}

/// One `INSERT` per message (per batch in set mode), counted as a round trip.
#[derive(Debug, Clone)]
struct Insert {
    trips: Arc<AtomicU64>,
    table: String,
}

impl Handler<PostgresTx, Charge> for Insert {
    type Output = ();
    async fn handle(&self, tx: &mut PostgresTx, msg: &Message<Charge>) -> Result<(), BoxError> {
        self.trips.fetch_add(1, Ordering::Relaxed);
        sqlx::query(&format!(
            "INSERT INTO {} (id, amount) VALUES ($1, $2)",
            self.table
        ))
        .bind(msg.message_id().as_bytes())
        .bind(msg.payload().amount)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl SetHandler<PostgresTx, Charge> for Insert {
    type Output = ();
    async fn handle_set(
        &self,
        tx: &mut PostgresTx,
        msgs: &[&Message<Charge>],
    ) -> Result<(), BoxError> {
        self.trips.fetch_add(1, Ordering::Relaxed);
        let ids: Vec<Vec<u8>> = msgs
            .iter()
            .map(|m| m.message_id().as_bytes().to_vec())
            .collect();
        let amounts: Vec<i64> = msgs.iter().map(|m| m.payload().amount).collect();
        sqlx::query(&format!(
            "INSERT INTO {} (id, amount) SELECT * FROM unnest($1::bytea[], $2::bigint[])",
            self.table
        ))
        .bind(&ids)
        .bind(&amounts)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl Handler<SqliteTx, Charge> for Insert {
    type Output = ();
    async fn handle(&self, tx: &mut SqliteTx, msg: &Message<Charge>) -> Result<(), BoxError> {
        self.trips.fetch_add(1, Ordering::Relaxed);
        sqlx::query(&format!(
            "INSERT INTO {} (id, amount) VALUES (?, ?)",
            self.table
        ))
        .bind(msg.message_id().as_bytes())
        .bind(msg.payload().amount)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl SetHandler<SqliteTx, Charge> for Insert {
    type Output = ();
    async fn handle_set(
        &self,
        tx: &mut SqliteTx,
        msgs: &[&Message<Charge>],
    ) -> Result<(), BoxError> {
        for m in msgs {
            Handler::handle(self, tx, m).await?;
        }
        Ok(())
    }
}

/// How the consumer runs.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// One message per transaction, this many at once.
    PerMessage(usize),
    /// Set batches of this size, this many at once.
    Set(usize, usize),
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::PerMessage(c) => write!(f, "per message, concurrency {c}"),
            Mode::Set(b, c) => write!(f, "set batches of {b}, concurrency {c}"),
        }
    }
}

/// The delivery stream: `n` deliveries, [`REDELIVERED`] of them repeating the message first
/// delivered [`LAG`] deliveries earlier; `(ID, amount)`.
fn stream(tag: &str, n: usize) -> Vec<(String, i64)> {
    let mut out: Vec<(String, i64)> = Vec::with_capacity(n);
    let mut fresh = 0usize;
    // Spread evenly: a redelivery whenever the running share falls below the target.
    let mut redelivered = 0usize;
    for i in 0..n {
        let due = ((i + 1) as f64 * REDELIVERED) as usize;
        if i >= LAG && redelivered < due {
            let earlier = out[i - LAG].clone();
            out.push(earlier);
            redelivered += 1;
        } else {
            fresh += 1;
            out.push((format!("{tag}-{fresh}"), fresh as i64));
        }
    }
    out
}

/// One consumer run over `deliveries` with the cache on or off.
async fn measure<S, H>(
    store: &S,
    trips: &Arc<AtomicU64>,
    handler: H,
    consumer: String,
    deliveries: &[(String, i64)],
    mode: Mode,
    cache: bool,
) -> anyhow::Result<Measured>
where
    S: BatchClaimStore + Clone + Send + Sync + 'static,
    S::Tx: Send,
    H: Handler<S::Tx, Charge> + SetHandler<S::Tx, Charge> + 'static,
{
    let broker = InMemoryBroker::new();
    for (id, amount) in deliveries {
        broker.publish(
            &[("message-id", id.as_bytes())],
            format!(r#"{{"amount":{amount}}}"#),
        );
    }
    broker.close();
    let processor = Arc::new(Processor::builder(store.clone(), consumer).build()?);
    let mut runner = Consumer::new(processor, broker.source());
    if cache {
        runner = runner.local_cache(LocalCache::new(100_000));
    }
    let before = trips.load(Ordering::Relaxed);
    let started = Instant::now();
    let stop = CancellationToken::new();
    let stats: RunStats = match mode {
        Mode::PerMessage(c) => {
            runner
                .concurrency(c)
                .run(Json::<Charge>::new(), handler, stop)
                .await?
        }
        Mode::Set(b, c) => {
            runner
                .concurrency(c)
                .batch(b)
                .run_set(Json::<Charge>::new(), handler, stop)
                .await?
        }
    };
    let elapsed = started.elapsed().as_secs_f64();
    let used = trips.load(Ordering::Relaxed) - before;
    let settled = stats.processed + stats.duplicates;
    anyhow::ensure!(
        settled == deliveries.len() as u64 && stats.dead_lettered == 0,
        "the run settled {settled} of {} deliveries: {stats:?}",
        deliveries.len()
    );
    Ok(Measured {
        per_second: deliveries.len() as f64 / elapsed,
        round_trips_per_delivery: used as f64 / deliveries.len() as f64,
        cache_hits: stats.cache_hits,
    })
}

fn median(mut v: Vec<Measured>) -> Measured {
    v.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
    v[v.len() / 2]
}

/// Rounds of off/on, interleaved, on one store and mode.
#[allow(clippy::too_many_arguments)]
async fn compare<S, H>(
    name: &'static str,
    store: &S,
    trips: &Arc<AtomicU64>,
    handler: &H,
    tag: &str,
    deliveries: usize,
    mode: Mode,
    rounds: usize,
) -> anyhow::Result<Row>
where
    S: BatchClaimStore + Clone + Send + Sync + 'static,
    S::Tx: Send,
    H: Handler<S::Tx, Charge> + SetHandler<S::Tx, Charge> + Clone + 'static,
{
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for cache in [false, true] {
            let run = format!("{tag}-{round}-{}", if cache { "on" } else { "off" });
            let msgs = stream(&run, deliveries);
            let m = measure(store, trips, handler.clone(), run, &msgs, mode, cache).await?;
            if cache { on.push(m) } else { off.push(m) }
        }
    }
    Ok(Row {
        store: name,
        mode: mode.to_string(),
        deliveries,
        off: median(off),
        on: median(on),
    })
}

/// Runs the scenario on PostgreSQL at `url` and on a temporary SQLite file.
pub(crate) async fn run(url: &str, run_tag: u32, rounds: usize) -> anyhow::Result<Report> {
    let mut rows = Vec::new();
    let tag = format!("rd{run_tag:x}");

    // PostgreSQL, in a schema of its own.
    let schema = format!("idem_bench_rd_{run_tag:x}");
    let admin = sqlx::PgPool::connect(url).await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await?;
    let result = async {
        let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(url)?
            .options([("search_path", schema.as_str())]);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await?;
        let inner = PostgresStore::from_pool(pool.clone());
        inner.migrate().await?;
        sqlx::query("CREATE TABLE charges (id bytea NOT NULL, amount bigint NOT NULL)")
            .execute(&pool)
            .await?;
        let trips = Arc::new(AtomicU64::new(0));
        let store = Counted {
            inner,
            trips: trips.clone(),
        };
        let handler = Insert {
            trips: trips.clone(),
            table: "charges".to_owned(),
        };
        for (mode, n) in [(Mode::PerMessage(8), 6_000), (Mode::Set(100, 4), 40_000)] {
            rows.push(
                compare(
                    "PostgreSQL",
                    &store,
                    &trips,
                    &handler,
                    &tag,
                    n,
                    mode,
                    rounds,
                )
                .await?,
            );
        }
        pool.close().await;
        anyhow::Ok(())
    }
    .await;
    let _ = sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await;
    admin.close().await;
    result?;

    // SQLite, in a temporary file.
    let dir = tempfile_dir()?;
    let inner = SqliteStore::open(dir.join("redeliveries.db"), SqliteOptions::default()).await?;
    inner.migrate().await?;
    sqlx::query("CREATE TABLE charges (id BLOB NOT NULL, amount INTEGER NOT NULL)")
        .execute(inner.pool())
        .await?;
    let trips = Arc::new(AtomicU64::new(0));
    let store = Counted {
        inner,
        trips: trips.clone(),
    };
    let handler = Insert {
        trips: trips.clone(),
        table: "charges".to_owned(),
    };
    let sqlite = compare(
        "SQLite",
        &store,
        &trips,
        &handler,
        &tag,
        3_000,
        Mode::PerMessage(1),
        rounds,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    rows.push(sqlite?);
    Ok(Report { rows, rounds })
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "idem-bench-rd-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

impl Report {
    fn lines(&self) -> Vec<[String; 7]> {
        self.rows
            .iter()
            .map(|r| {
                [
                    format!("{} ({}, {} deliveries)", r.store, r.mode, r.deliveries),
                    format!("{:.0}", r.off.per_second),
                    format!("{:.0}", r.on.per_second),
                    format!("{:.2}×", r.on.per_second / r.off.per_second),
                    format!("{:.2}", r.off.round_trips_per_delivery),
                    format!("{:.2}", r.on.round_trips_per_delivery),
                    format!("{}", r.on.cache_hits),
                ]
            })
            .collect()
    }

    const HEAD: [&'static str; 7] = [
        "workload (30 % same-process redeliveries)",
        "cache off (deliveries/s)",
        "cache on (deliveries/s)",
        "on / off",
        "round trips / delivery, off",
        "round trips / delivery, on",
        "cache hits",
    ];

    /// The report as Markdown.
    pub(crate) fn markdown(&self) -> String {
        let mut s = format!(
            "\n#### Local cache of committed claims, 30 % same-process redeliveries (median of {} interleaved rounds)\n\n| {} |\n|{}\n",
            self.rounds,
            Self::HEAD.join(" | "),
            "---|".repeat(Self::HEAD.len())
        );
        for l in self.lines() {
            s.push_str(&format!("| {} |\n", l.join(" | ")));
        }
        s
    }

    /// The report as plain text.
    pub(crate) fn plain(&self) -> String {
        let mut s = format!(
            "\nLocal cache of committed claims, 30 % same-process redeliveries (median of {} rounds)\n",
            self.rounds
        );
        for l in self.lines() {
            s.push_str(&format!(
                "  {}: off {} /s, on {} /s ({}); round trips per delivery {} → {}; {} cache hits\n",
                l[0], l[1], l[2], l[3], l[4], l[5], l[6]
            ));
        }
        s
    }
}
