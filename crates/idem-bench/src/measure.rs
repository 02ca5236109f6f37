//! Timing: fixed wall-clock windows with a warm-up, interleaved rounds, medians.
//!
//! Throughput over a fixed window (rather than a fixed message count) keeps every measurement
//! equally long whatever the variant's speed, so slow variants cannot stretch the run and all
//! variants see the same amount of machine noise. Rounds are interleaved and rotated
//! (round 1: a b c d, round 2: b c d a, …) so drift — autovacuum, checkpoints, thermal
//! throttling, a neighbour's build — lands on every variant alike instead of on whichever ran
//! last; the median of the rounds then discards the odd outlier.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long one measurement lasts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    /// Run but do not count: fills connection statement caches, the buffer cache and the
    /// allocator before counting starts.
    pub(crate) warmup: Duration,
    /// Count completed messages during this long.
    pub(crate) measure: Duration,
}

/// One measurement of one variant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// Messages per second over the counted window.
    pub(crate) rate: f64,
    /// Operations that failed with a retryable error (deadlock, serialization failure, busy
    /// database) and were dropped: the load would retry them, so they count as lost time.
    pub(crate) retries: u64,
    /// CPU time of this process per counted message, in microseconds (Linux only).
    pub(crate) client_us: Option<f64>,
    /// CPU time of the database server processes serving the workers, per counted message.
    pub(crate) server_us: Option<f64>,
}

/// Reads CPU time from Linux's per-task scheduler statistics (`/proc/…/schedstat`, in
/// nanoseconds). Throughput says how fast; CPU per message says where the time goes, and
/// stays meaningful when other processes compete for the cores and make throughput noisy.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuProbe {
    server_pids: Vec<u32>,
}

impl CpuProbe {
    /// Measures this process, and the server processes `server_pids` (PostgreSQL backends on
    /// this machine; empty when the server is remote or in-process).
    pub(crate) fn new(server_pids: Vec<u32>) -> Self {
        Self { server_pids }
    }

    /// A PostgreSQL backend on this machine, as opposed to a remote server whose pid means
    /// nothing here.
    pub(crate) fn is_local_postgres(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.trim_end().starts_with("postgres"))
    }

    fn snapshot(&self) -> (Option<u64>, Option<u64>) {
        // A thread that exits inside the window takes its time with it; the runtime's threads
        // live as long as the run.
        let client = std::fs::read_dir("/proc/self/task").ok().map(|tasks| {
            tasks
                .filter_map(|t| t.ok().and_then(|t| run_ns(&t.path().join("schedstat"))))
                .sum::<u64>()
        });
        let server = if self.server_pids.is_empty() {
            None
        } else {
            self.server_pids
                .iter()
                .map(|pid| run_ns(std::path::Path::new(&format!("/proc/{pid}/schedstat"))))
                .sum()
        };
        (client, server)
    }
}

/// The first field of a schedstat file: nanoseconds spent running.
fn run_ns(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// One unit of work a worker repeats: one message or one batch.
///
/// `open` runs before the clock starts, once per worker, for state the worker keeps across
/// operations (e.g. a connection it holds for the whole measurement).
pub(crate) trait Op: Send + Sync + 'static {
    /// Per-worker state.
    type State: Send + 'static;

    /// Prepares worker `worker`.
    fn open(&self, worker: usize) -> impl Future<Output = anyhow::Result<Self::State>> + Send;

    /// Runs operation number `seq` of worker `worker`; returns how many messages it handled.
    fn run(
        &self,
        state: &mut Self::State,
        worker: usize,
        seq: u64,
    ) -> impl Future<Output = anyhow::Result<u64>> + Send;
}

/// Runs `workers` concurrent tasks repeating `op` for the warm-up plus the window and returns
/// the messages completed per second inside the window.
pub(crate) async fn throughput<O: Op>(
    op: O,
    workers: usize,
    window: Window,
    cpu: &CpuProbe,
) -> anyhow::Result<Sample> {
    let op = Arc::new(op);
    let mut states = Vec::with_capacity(workers);
    for w in 0..workers {
        states.push(op.open(w).await?);
    }
    // The clock starts only once every worker is ready, so connection setup is never timed.
    let warm_end = Instant::now() + window.warmup;
    let end = warm_end + window.measure;
    let mut tasks = Vec::with_capacity(workers);
    for (w, state) in states.into_iter().enumerate() {
        let op = Arc::clone(&op);
        tasks.push(tokio::spawn(work(op, state, w, warm_end, end)));
    }
    // CPU is read at the same instants that bound the counted window.
    tokio::time::sleep_until(warm_end.into()).await;
    let before = cpu.snapshot();
    tokio::time::sleep_until(end.into()).await;
    let after = cpu.snapshot();
    let (mut messages, mut retries) = (0u64, 0u64);
    for task in tasks {
        let (m, r) = task.await.context("benchmark worker panicked")??;
        messages += m;
        retries += r;
    }
    let per_message = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) if messages > 0 => {
            Some(b.saturating_sub(a) as f64 / 1000.0 / messages as f64)
        }
        _ => None,
    };
    Ok(Sample {
        rate: messages as f64 / window.measure.as_secs_f64(),
        retries,
        client_us: per_message(before.0, after.0),
        server_us: per_message(before.1, after.1),
    })
}

async fn work<O: Op>(
    op: Arc<O>,
    mut state: O::State,
    worker: usize,
    warm_end: Instant,
    end: Instant,
) -> anyhow::Result<(u64, u64)> {
    let (mut counted, mut retries) = (0u64, 0u64);
    let mut seq = 0u64;
    while Instant::now() < end {
        let result = op.run(&mut state, worker, seq).await;
        // Every sequence number is used once, even after a failure, so message IDs stay fresh.
        seq += 1;
        let done = Instant::now();
        match result {
            // Count what completed inside the window; work finishing after it is not counted.
            Ok(n) if done >= warm_end && done <= end => counted += n,
            Ok(_) => {}
            Err(e) if is_retryable(&e) => retries += 1,
            Err(e) => return Err(e.context(format!("worker {worker}, operation {seq}"))),
        }
    }
    Ok((counted, retries))
}

/// Deadlocks and serialization failures (PostgreSQL 40P01/40001) and a busy SQLite database
/// are part of running concurrent writers; a real consumer retries them.
fn is_retryable(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        if let Some(ours) = cause.downcast_ref::<idem_core::Error>() {
            return ours.is_retryable();
        }
        match cause.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Database(db)) => matches!(
                db.code().as_deref(),
                Some("40001" | "40P01" | "5" | "6" | "517")
            ),
            _ => false,
        }
    })
}

/// Measures every variant `rounds` times, interleaved and rotated, and returns the samples per
/// variant in the order of `variants`. `measure_one(variant, round)` runs one measurement.
pub(crate) async fn interleaved<V: Copy>(
    variants: &[V],
    rounds: usize,
    mut measure_one: impl AsyncFnMut(V, usize) -> anyhow::Result<Sample>,
) -> anyhow::Result<Vec<Vec<Sample>>> {
    let mut samples: Vec<Vec<Sample>> = variants.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..variants.len() {
            let i = (k + round) % variants.len();
            let sample = measure_one(variants[i], round).await?;
            samples[i].push(sample);
        }
    }
    Ok(samples)
}

/// The median rate; the mean of the middle two for an even count.
pub(crate) fn median(samples: &[Sample]) -> f64 {
    median_of(samples.iter().map(|s| s.rate)).unwrap_or(0.0)
}

/// The median of the values present, if any.
pub(crate) fn median_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(rate: f64) -> Sample {
        Sample {
            rate,
            retries: 0,
            client_us: None,
            server_us: None,
        }
    }

    #[test]
    fn this_process_has_cpu_time() {
        if cfg!(target_os = "linux") {
            assert!(CpuProbe::default().snapshot().0.is_some_and(|ns| ns > 0));
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[s(3.0), s(1.0), s(2.0)]), 2.0);
        assert_eq!(median(&[s(4.0), s(1.0), s(2.0), s(3.0)]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[tokio::test]
    async fn rounds_rotate_and_samples_stay_with_their_variant() -> anyhow::Result<()> {
        let mut order = Vec::new();
        let samples = interleaved(&['a', 'b', 'c'], 2, async |v, _| {
            order.push(v);
            Ok(s(f64::from(u32::from(v))))
        })
        .await?;
        assert_eq!(order, ['a', 'b', 'c', 'b', 'c', 'a']);
        assert!(
            samples[1]
                .iter()
                .all(|x| x.rate == f64::from(u32::from('b')))
        );
        Ok(())
    }
}
