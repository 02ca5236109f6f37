//! Where the demo's randomness comes from: every random choice is drawn from a `ChaCha8Rng`
//! seeded by `--seed`, so two runs with the same seed make the same choices. ChaCha8's stream
//! is fixed by its specification (`rand`'s `SmallRng` and `StdRng` may change algorithm in
//! any release), so the README's figures for a seed stay true across dependency updates.
//!
//! Workers race, so which worker takes which delivery varies between runs. The crash decision
//! therefore does not come from a shared RNG stream (whose order would follow the race) but from
//! an RNG seeded by (seed, published copy, delivery attempt): the third delivery of copy 17
//! crashes or not regardless of which worker gets it or when. The idem run and the `--naive`
//! run on the same seed thus crash at the same deliveries.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Independent random streams, so adding a draw to one never shifts another.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stream {
    /// Accounts and amounts of the payment requests.
    Payments = 1,
    /// Which messages the producer publishes twice, and how much later.
    Publishing = 2,
    /// Whether a worker crashes between commit and ack.
    Crashes = 3,
}

/// An RNG for `stream`, further keyed by `a` and `b` (e.g. copy and attempt).
pub(crate) fn seeded_rng(seed: u64, stream: Stream, a: u64, b: u64) -> ChaCha8Rng {
    let mut key = splitmix64(seed ^ splitmix64(stream as u64));
    key = splitmix64(key ^ a);
    key = splitmix64(key ^ b.rotate_left(32));
    ChaCha8Rng::seed_from_u64(key)
}

/// SplitMix64's finaliser: spreads nearby inputs (copy 17 vs 18) over unrelated seeds.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A copy crashes on at most this many of its deliveries, so that even `--crash-rate 1` ends:
/// the naive consumer never records a crashed message as processed, and would otherwise charge
/// it and crash forever.
const MAX_CRASHES_PER_COPY: u32 = 3;

/// Decides which deliveries "crash" after their commit and before their ack.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CrashPlan {
    seed: u64,
    rate: f64,
}

impl CrashPlan {
    /// Crashes a fraction `rate` (validated to be within 0..=1) of deliveries.
    pub(crate) fn new(seed: u64, rate: f64) -> Self {
        Self { seed, rate }
    }

    /// Whether delivery `attempt` of published copy `copy` crashes after committing.
    pub(crate) fn crashes_after_commit(&self, copy: usize, attempt: u32) -> bool {
        if self.rate <= 0.0 || attempt > MAX_CRASHES_PER_COPY {
            return false;
        }
        let copy = u64::try_from(copy).unwrap_or(u64::MAX);
        seeded_rng(self.seed, Stream::Crashes, copy, u64::from(attempt)).gen_bool(self.rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_crashes_the_same_deliveries() {
        let a = CrashPlan::new(42, 0.3);
        let b = CrashPlan::new(42, 0.3);
        let pick = |p: &CrashPlan| {
            (0..200)
                .filter(|&c| p.crashes_after_commit(c, 1))
                .collect::<Vec<_>>()
        };
        assert_eq!(pick(&a), pick(&b));
        let n = pick(&a).len();
        assert!((30..=90).contains(&n), "{n} crashes out of 200 at rate 0.3");
        assert_ne!(pick(&a), pick(&CrashPlan::new(43, 0.3)));
    }

    #[test]
    fn rates_zero_and_one_are_never_and_always() {
        assert!((0..100).all(|c| !CrashPlan::new(1, 0.0).crashes_after_commit(c, 1)));
        assert!((0..100).all(|c| CrashPlan::new(1, 1.0).crashes_after_commit(c, 1)));
        assert!(!CrashPlan::new(1, 1.0).crashes_after_commit(0, MAX_CRASHES_PER_COPY + 1));
    }
}
