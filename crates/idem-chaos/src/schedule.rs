//! The seeded schedule of faults: every decision the harness makes (when to kill, whom, which
//! crash point to arm and after how many visits, which messages to publish twice) comes from
//! one generator seeded by `--seed`, so a run's fault schedule can be replayed.

use std::time::Duration;

use idem_consumer::crash::{CrashAt, CrashPoint};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
// ChaCha8: a stream fixed by its specification, so a seed replays the same schedule after a
// `rand` update (`StdRng` may change algorithm in any release).
use rand_chacha::ChaCha8Rng;

#[derive(Debug)]
pub(crate) struct Schedule {
    rng: ChaCha8Rng,
    kill_every: Duration,
    crash_share: f64,
    crash_within: u64,
    /// The consumer's points (`before-claim` … `in-batch`).
    consumer_points: Vec<CrashPoint>,
    /// The outbox relay's points (`relay-after-lease` … `relay-after-mark`).
    relay_points: Vec<CrashPoint>,
}

/// What a replica runs, so which crash points it can reach: one armed at a point it never
/// reaches is never aborted there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// A consumer alone.
    Consumer,
    /// A consumer with the outbox relay in its process (`payments --emit`).
    ConsumerAndRelay,
    /// A relay alone (`idem relay`).
    Relay,
    /// A service whose operations run as recovery points (`http-payments --card-processor`):
    /// the phase driver's points.
    Phases,
    /// A consumer whose handler runs recovery points (`payments --card-processor`).
    ConsumerAndPhases,
}

impl Schedule {
    pub(crate) fn new(
        seed: u64,
        kill_every: Duration,
        crash_share: f64,
        crash_within: u64,
        batch: usize,
    ) -> Self {
        // In-batch needs a batch to be inside of.
        let consumer_points = CrashPoint::ALL
            .into_iter()
            .filter(|p| batch > 1 || *p != CrashPoint::InBatch)
            .collect();
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            kill_every,
            crash_share: crash_share.clamp(0.0, 1.0),
            crash_within: crash_within.max(1),
            consumer_points,
            relay_points: CrashPoint::RELAY.to_vec(),
        }
    }

    /// The wait before the next kill: uniform in [0.5, 1.5] × the mean.
    pub(crate) fn next_kill_in(&mut self) -> Duration {
        self.kill_every.mul_f64(self.rng.gen_range(0.5..1.5))
    }

    /// Which replica to kill.
    pub(crate) fn victim(&mut self, replicas: usize) -> usize {
        self.rng.gen_range(0..replicas.max(1))
    }

    /// The crash point a (re)started replica that runs `reach` is armed with, if any.
    pub(crate) fn arm(&mut self, reach: Reach) -> Option<CrashAt> {
        if !self.rng.gen_bool(self.crash_share) {
            return None;
        }
        let points: Vec<CrashPoint> = match reach {
            Reach::Consumer => self.consumer_points.clone(),
            Reach::ConsumerAndRelay => [&self.consumer_points[..], &self.relay_points[..]].concat(),
            Reach::Relay => self.relay_points.clone(),
            Reach::Phases => CrashPoint::PHASES.to_vec(),
            Reach::ConsumerAndPhases => {
                [&self.consumer_points[..], &CrashPoint::PHASES[..]].concat()
            }
        };
        let point = *points.choose(&mut self.rng)?;
        Some(CrashAt {
            point,
            hit: self.rng.gen_range(1..=self.crash_within),
        })
    }

    /// True with probability `share` (which `--phases` operations give up).
    pub(crate) fn chance(&mut self, share: f64) -> bool {
        self.rng.gen_bool(share.clamp(0.0, 1.0))
    }

    /// A seed for a component with its own generator (the cut proxy).
    pub(crate) fn fork(&mut self) -> u64 {
        self.rng.r#gen()
    }

    /// The run's publishes: each of `n` IDs once, and `share` of them a second time, the
    /// repeat at a random later position (a producer retrying after a lost confirm). With
    /// `own_accounts` each payment charges an account of its own, named as its ID (`--phases`
    /// counts the processor's charges per account), else one of 32.
    pub(crate) fn messages(
        &mut self,
        tag: &str,
        n: usize,
        share: f64,
        own_accounts: bool,
    ) -> crate::ledger::Sent {
        let mut sent = crate::ledger::Sent::default();
        for i in 0..n {
            let id = format!("{tag}-{i:07}");
            let amount = 1 + (i as i64 * 7919) % 1000;
            let account = match own_accounts {
                true => id.clone(),
                false => format!("acct-{}", i % 32),
            };
            let payload = format!(r#"{{"account":"{account}","amount_cents":{amount}}}"#);
            sent.unique.push((id.clone(), amount));
            sent.publishes.push((id, payload.into_bytes()));
        }
        for i in 0..n {
            if self.rng.gen_bool(share.clamp(0.0, 1.0)) {
                let repeat = sent.publishes[i].clone();
                let at = self.rng.gen_range(i + 1..=sent.publishes.len());
                sent.publishes.insert(at, repeat);
            }
        }
        sent
    }
}
