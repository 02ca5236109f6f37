//! The benchmark's messages: a charge to one of a fixed set of accounts, with a fresh ID.
//!
//! Every variant of every scenario handles exactly the same message stream, so the only
//! difference measured is how the message is made idempotent.

use std::collections::BTreeMap;

use idem_core::{Fingerprint, Identified, MessageId};

/// Accounts the charges spread over: enough that 8 concurrent workers rarely update the same
/// row at once, few enough that the table stays in cache as in a real hot ledger.
pub(crate) const ACCOUNTS: u64 = 1000;

/// The consumer name claims are recorded under.
pub(crate) const CONSUMER: &str = "bench";

/// One delivered message: "charge `amount` to `account`".
#[derive(Debug)]
pub(crate) struct Delivery {
    pub(crate) id: MessageId,
    pub(crate) account: String,
    pub(crate) amount: i64,
}

impl Identified for Delivery {
    fn message_id(&self) -> &MessageId {
        &self.id
    }

    /// Over the fields rather than a serialised payload, as a consumer that decodes its
    /// messages would do; computed only by the variants that store it.
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::hasher()
            .field(self.account.as_bytes())
            .field(self.amount.to_be_bytes())
            .finish()
    }
}

/// Hands out message IDs that never repeat within a run, shaped like the UUIDs most brokers
/// carry (36 bytes), so the claim index sees realistic key widths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ids {
    run: u32,
    measurement: u32,
}

impl Ids {
    /// IDs for measurement number `measurement` of the run tagged `run`.
    pub(crate) fn new(run: u32, measurement: u32) -> Self {
        Self { run, measurement }
    }

    /// Message `n` of worker `worker`. The account and amount depend only on `(worker, n)`, so
    /// every variant charges the same accounts in the same order.
    pub(crate) fn delivery(&self, worker: usize, n: u64) -> anyhow::Result<Delivery> {
        let id = format!(
            "{:08x}-{:04x}-{:04x}-8000-{:012x}",
            self.run,
            self.measurement & 0xffff,
            worker & 0xffff,
            n & 0xffff_ffff_ffff
        );
        Ok(charge(MessageId::new(id)?, worker, n))
    }

    /// Message `n` of worker `worker` with a UUIDv7 ID made at `ms` (Unix milliseconds), as
    /// producers that partition by ID time send: the charge is [`Self::delivery`]'s. The 74
    /// random bits are the worker (12 bits), then this measurement (14) and `n` (48), so IDs
    /// stay distinct even within one millisecond.
    pub(crate) fn delivery_v7(&self, worker: usize, n: u64, ms: u64) -> anyhow::Result<Delivery> {
        let rand_a = worker as u64 & 0xfff;
        let rand_b = (u64::from(self.measurement & 0x3fff) << 48) | (n & 0xffff_ffff_ffff);
        let id = format!(
            "{:08x}-{:04x}-7{rand_a:03x}-{:04x}-{:012x}",
            (ms >> 16) & 0xffff_ffff,
            ms & 0xffff,
            0x8000 | (rand_b >> 48), // the RFC variant, 0b10, then 14 random bits
            rand_b & 0xffff_ffff_ffff
        );
        Ok(charge(MessageId::new(id)?, worker, n))
    }

    /// Batch `seq` of `size` messages of worker `worker`.
    pub(crate) fn batch(
        &self,
        worker: usize,
        seq: u64,
        size: usize,
    ) -> anyhow::Result<Vec<Delivery>> {
        let size64 = size as u64;
        (0..size64)
            .map(|i| self.delivery(worker, seq * size64 + i))
            .collect()
    }
}

/// "Charge `amount` to `account`", depending only on `(worker, n)`.
fn charge(id: MessageId, worker: usize, n: u64) -> Delivery {
    let h = mix(((worker as u64) << 40) ^ n);
    Delivery {
        id,
        account: account_name(h % ACCOUNTS),
        amount: 1 + ((h >> 32) % 100) as i64,
    }
}

/// The primary key of account number `i`.
pub(crate) fn account_name(i: u64) -> String {
    format!("acc-{i:04}")
}

/// Amounts summed per account, in account order: one aggregated UPDATE per batch. Sorted, so a
/// handler that locks in input order locks in one global order (see `postgres::CREDIT_SET` for
/// why that alone is not enough on PostgreSQL).
pub(crate) fn per_account<'a>(charges: &[&'a Delivery]) -> (Vec<&'a str>, Vec<i64>) {
    let mut sums: BTreeMap<&str, i64> = BTreeMap::new();
    for d in charges {
        *sums.entry(d.account.as_str()).or_default() += d.amount;
    }
    sums.into_iter().unzip()
}

/// SplitMix64: a fast, well-mixed, stateless hash, so the account sequence needs no shared RNG.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_uuid_shaped_and_distinct_across_workers_and_measurements() -> anyhow::Result<()> {
        let a = Ids::new(7, 1).delivery(0, 5)?;
        assert_eq!(a.id.len(), 36);
        assert_ne!(a.id, Ids::new(7, 1).delivery(1, 5)?.id);
        assert_ne!(a.id, Ids::new(7, 2).delivery(0, 5)?.id);
        // Same account stream for every measurement: variants stay comparable.
        assert_eq!(a.account, Ids::new(9, 3).delivery(0, 5)?.account);
        Ok(())
    }

    #[test]
    fn v7_ids_carry_their_time_and_stay_distinct() -> anyhow::Result<()> {
        let ms = 1_733_000_000_123;
        let a = Ids::new(7, 1).delivery_v7(3, 5, ms)?;
        assert_eq!(a.id.len(), 36);
        let t = idem_sql::partition::uuid_v7(&a.id).map(|t| t.as_micros());
        assert_eq!(t, Some(ms as i64 * 1000));
        assert_ne!(a.id, Ids::new(7, 1).delivery_v7(4, 5, ms)?.id);
        assert_ne!(a.id, Ids::new(7, 1).delivery_v7(3, 6, ms)?.id);
        assert_ne!(a.id, Ids::new(7, 2).delivery_v7(3, 5, ms)?.id);
        assert_eq!(a.account, Ids::new(7, 1).delivery(3, 5)?.account);
        Ok(())
    }

    #[test]
    fn amounts_are_summed_per_account_in_order() -> anyhow::Result<()> {
        let ds = Ids::new(1, 1).batch(0, 0, 50)?;
        let refs: Vec<&Delivery> = ds.iter().collect();
        let (accounts, sums) = per_account(&refs);
        assert!(accounts.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            sums.iter().sum::<i64>(),
            ds.iter().map(|d| d.amount).sum::<i64>()
        );
        Ok(())
    }
}
