//! The function-level API (`Idempotency::call`) on Redis next to AWS Powertools for Python's
//! `idempotent_function` on the same Redis: first calls/s and replays/s, single-threaded,
//! against the round-trip floor (the client's PING rate: a first call needs two round trips,
//! a replay one), the Redis commands each costs, and where the CPU goes (the client's thread
//! and `redis-server`, from `/proc/<pid>/stat`).

use std::collections::BTreeMap;

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use idem_core::{IdempotencyKey, RequestScope};
use idem_redis::RedisRequestStore;
use idem_request::Idempotency;
use serde::{Deserialize, Serialize};

/// Calls per second, round trips to Redis per call (counted by the client) and commands Redis
/// ran per call (INFO commandstats, which counts those a Lua script runs too).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Rates {
    pub(crate) first_per_s: f64,
    pub(crate) replay_per_s: f64,
    pub(crate) round_trips_per_first: f64,
    pub(crate) round_trips_per_replay: f64,
    pub(crate) commands_per_first: f64,
    pub(crate) commands_per_replay: f64,
    /// The client's floor: `PING`s per second, one at a time (one round trip, no work).
    pub(crate) pings_per_s: f64,
    /// The Powertools version, when it is Powertools.
    #[serde(default)]
    pub(crate) powertools: Option<String>,
    /// Commands per first call and per replay by name (`INFO commandstats`).
    #[serde(default)]
    pub(crate) mix_first: BTreeMap<String, f64>,
    #[serde(default)]
    pub(crate) mix_replay: BTreeMap<String, f64>,
    /// CPU µs per first call and per replay of the client (its one thread) and of
    /// `redis-server` (0 when it is not on this machine), over the timed legs.
    #[serde(default)]
    pub(crate) client_cpu_us_first: f64,
    #[serde(default)]
    pub(crate) client_cpu_us_replay: f64,
    #[serde(default)]
    pub(crate) redis_cpu_us_first: f64,
    #[serde(default)]
    pub(crate) redis_cpu_us_replay: f64,
}

impl Rates {
    /// First calls/s over the floor of two round trips (half the PING rate).
    pub(crate) fn first_vs_floor(&self) -> f64 {
        2.0 * self.first_per_s / self.pings_per_s.max(f64::MIN_POSITIVE)
    }

    /// Replays/s over the floor of one round trip (the PING rate).
    pub(crate) fn replay_vs_floor(&self) -> f64 {
        self.replay_per_s / self.pings_per_s.max(f64::MIN_POSITIVE)
    }
}

impl Rates {
    /// The median of each figure over `rounds` (not empty).
    pub(crate) fn median(rounds: &[Rates]) -> Rates {
        let m = |f: fn(&Rates) -> f64| {
            let mut v: Vec<f64> = rounds.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        Rates {
            first_per_s: m(|r| r.first_per_s),
            replay_per_s: m(|r| r.replay_per_s),
            round_trips_per_first: m(|r| r.round_trips_per_first),
            round_trips_per_replay: m(|r| r.round_trips_per_replay),
            commands_per_first: m(|r| r.commands_per_first),
            commands_per_replay: m(|r| r.commands_per_replay),
            pings_per_s: m(|r| r.pings_per_s),
            powertools: rounds.first().and_then(|r| r.powertools.clone()),
            mix_first: rounds
                .first()
                .map(|r| r.mix_first.clone())
                .unwrap_or_default(),
            mix_replay: rounds
                .first()
                .map(|r| r.mix_replay.clone())
                .unwrap_or_default(),
            client_cpu_us_first: m(|r| r.client_cpu_us_first),
            client_cpu_us_replay: m(|r| r.client_cpu_us_replay),
            redis_cpu_us_first: m(|r| r.redis_cpu_us_first),
            redis_cpu_us_replay: m(|r| r.redis_cpu_us_replay),
        }
    }
}

#[derive(Debug, Serialize)]
struct Order<'a> {
    id: &'a str,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Charged {
    order_id: String,
    status: String,
    amount_cents: i64,
}

/// A connection that counts its round trips: one per command, one per pipeline.
#[derive(Clone)]
struct Counting {
    inner: redis::aio::ConnectionManager,
    round_trips: Arc<AtomicU64>,
}

impl redis::aio::ConnectionLike for Counting {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// Commands the server has run by name, all clients together (`INFO commandstats`, which
/// counts the commands a script runs as well as its `EVALSHA`).
pub(crate) async fn command_calls(
    conn: &mut redis::aio::MultiplexedConnection,
) -> Result<BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect())
}

/// What ran between two readings, per operation, without the `INFO` that took the first.
pub(crate) fn commands_per(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    ops: u64,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .map(|(name, n)| {
            let ran = n.saturating_sub(before.get(name).copied().unwrap_or(0));
            (name.clone(), ran as f64 / ops.max(1) as f64)
        })
        .filter(|(_, n)| *n > 0.0)
        .collect()
}

/// `evalsha 2.0, get 2.0` for the report.
pub(crate) fn mix_text(mix: &BTreeMap<String, f64>) -> String {
    if mix.is_empty() {
        return "—".to_owned();
    }
    mix.iter()
        .map(|(name, n)| format!("{name} {n:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// idem's side, on a current-thread runtime of its own: one task, one call at a time.
pub(crate) fn idem_rates(
    redis_url: &str,
    redis_pid: Option<u32>,
    seconds: f64,
    count_ops: u32,
) -> Result<Rates> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let run = format!("{}-{}", std::process::id(), rand::random::<u32>());
        let client = redis::Client::open(redis_url)?;
        let round_trips = Arc::new(AtomicU64::new(0));
        let conn = Counting {
            inner: client
                .get_connection_manager()
                .await
                .context("connecting to Redis")?,
            round_trips: round_trips.clone(),
        };
        let store = RedisRequestStore::with_connection(conn, format!("idem-bench:{run}"))?;
        let idem = Idempotency::builder(store)
            .ttl(Duration::from_secs(600))
            .build()?;
        let scope = RequestScope::new(["charge", "bench"]);
        let call = async |id: &str| -> Result<()> {
            let key = IdempotencyKey::new(id)?;
            let order = Order {
                id,
                amount_cents: 1250,
            };
            let _: Charged = idem
                .call(scope, &key, &order, async |_tx| {
                    Ok::<_, Infallible>(Charged {
                        order_id: id.to_owned(),
                        status: "charged".to_owned(),
                        amount_cents: 1250,
                    })
                })
                .await?;
            Ok(())
        };
        let timed = async |prefix: &str,
                           repeat: bool,
                           seconds: f64,
                           limit: Option<u32>|
               -> Result<(u64, f64)> {
            let start = Instant::now();
            let deadline = start + Duration::from_secs_f64(seconds);
            let mut n: u64 = 0;
            loop {
                match limit {
                    Some(l) if n >= u64::from(l) => break,
                    None if Instant::now() >= deadline => break,
                    _ => {}
                }
                let id = if repeat {
                    format!("{run}-{prefix}")
                } else {
                    format!("{run}-{prefix}-{n}")
                };
                call(&id).await?;
                n += 1;
            }
            Ok((n, start.elapsed().as_secs_f64()))
        };
        // The floor of any call that needs one round trip: PING, one at a time.
        let mut ping = client.get_multiplexed_async_connection().await?;
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(seconds.min(1.0));
        let mut pings: u64 = 0;
        while Instant::now() < deadline {
            let _: String = redis::cmd("PING").query_async(&mut ping).await?;
            pings += 1;
        }
        let pings_per_s = pings as f64 / start.elapsed().as_secs_f64();
        call(&format!("{run}-replay")).await?;
        timed("warm", false, 0.3, None).await?;
        timed("replay", true, 0.3, None).await?;
        // CPU of this thread (the whole client: a current-thread runtime) and of redis-server.
        let cpu = || {
            (
                super::load::thread_cpu_micros(),
                redis_pid.map_or(0, super::load::cpu_micros),
            )
        };
        let per_op = |a: (u64, u64), b: (u64, u64), n: u64| {
            let n = n.max(1) as f64;
            (
                b.0.saturating_sub(a.0) as f64 / n,
                b.1.saturating_sub(a.1) as f64 / n,
            )
        };
        let c0 = cpu();
        let (n_first, t_first) = timed("first", false, seconds, None).await?;
        let c1 = cpu();
        let (n_replay, t_replay) = timed("replay", true, seconds, None).await?;
        let c2 = cpu();
        let (client_cpu_us_first, redis_cpu_us_first) = per_op(c0, c1, n_first);
        let (client_cpu_us_replay, redis_cpu_us_replay) = per_op(c1, c2, n_replay);

        let mut info = client.get_multiplexed_async_connection().await?;
        let trips = || round_trips.load(Ordering::Relaxed);
        let (before, trips_before) = (command_calls(&mut info).await?, trips());
        timed("count", false, 0.0, Some(count_ops)).await?;
        let (middle, trips_middle) = (command_calls(&mut info).await?, trips());
        timed("replay", true, 0.0, Some(count_ops)).await?;
        let (after, trips_after) = (command_calls(&mut info).await?, trips());
        let mix_first = commands_per(&before, &middle, u64::from(count_ops));
        let mix_replay = commands_per(&middle, &after, u64::from(count_ops));
        let per_trip = |a: u64, b: u64| (b - a) as f64 / f64::from(count_ops);
        Ok(Rates {
            first_per_s: n_first as f64 / t_first,
            replay_per_s: n_replay as f64 / t_replay,
            round_trips_per_first: per_trip(trips_before, trips_middle),
            round_trips_per_replay: per_trip(trips_middle, trips_after),
            commands_per_first: mix_first.values().sum(),
            commands_per_replay: mix_replay.values().sum(),
            pings_per_s,
            powertools: None,
            mix_first,
            mix_replay,
            client_cpu_us_first,
            client_cpu_us_replay,
            redis_cpu_us_first,
            redis_cpu_us_replay,
        })
    })
}

/// Powertools' side: the script under `scripts/`, run with `python`.
pub(crate) fn powertools_rates(
    python: &str,
    script: &Path,
    redis_url: &str,
    redis_pid: Option<u32>,
    seconds: f64,
    count_ops: u32,
) -> Result<Rates> {
    let pid = redis_pid.map(|p| vec!["--redis-pid".to_owned(), p.to_string()]);
    let out = std::process::Command::new(python)
        .arg(script)
        .args(["--redis", redis_url, "--seconds", &seconds.to_string()])
        .args(pid.unwrap_or_default())
        .args(["--count-ops", &count_ops.to_string()])
        .output()
        .with_context(|| format!("running {python} {}", script.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("reading the Powertools result {line:?}"))
}
