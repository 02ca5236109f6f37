//! `--phases`: operations of recovery points that charge a card processor, under kills at
//! every phase boundary.
//!
//! Each operation has an account of its own, so the fake card processor's charges per
//! account are the operation's effects whatever keys its attempts sent: a foreign key that
//! changed between attempts shows as a second charge (`--scramble-foreign-keys` makes one
//! change, to show the checker sees it). The services run with crash points compiled in; a
//! (re)started one is armed, at random, at one of the phase driver's points:
//! `phase-returned` (a phase's writes or its foreign call done — for the charge phase, the
//! processor charged and nothing is recorded), `point-committed` (a recovery point committed,
//! the next phase not started) or `response-committed` (the response committed, the caller
//! not answered). Random SIGKILLs land anywhere else.
//!
//! - [`http`]: `http-payments --card-processor` services behind clients that retry each
//!   operation with the same Idempotency-Key ([`clients`]).
//! - `--phases consumer` runs in the broker harness (`run`), its consumers given
//!   `--card-processor` and armed at the phase driver's points as well as the consumer's.
//! - [`check`]: at most one processor charge and one charge row (with the processor's ID)
//!   per operation, every record finished or abandoned, none stuck.
//! - [`scramble`]: `--scramble-foreign-keys`, the fault that shows the check catches a double.

pub(crate) mod check;
pub(crate) mod clients;
pub(crate) mod http;
pub(crate) mod scramble;

use anyhow::{Context, Result};
use idem_testkit::fake_processor::{FakeProcessor, Stats};

use scramble::Scrambler;

/// The card processor of a run: idem's fake one, in this process (it is never killed), and,
/// with `--scramble-foreign-keys`, the proxy the services reach it through.
#[derive(Debug)]
pub(crate) struct Processor {
    fake: FakeProcessor,
    scrambler: Option<Scrambler>,
}

impl Processor {
    /// Starts the fake processor, behind a scrambling proxy if `scramble`.
    pub(crate) async fn start(scramble: bool) -> Result<Self> {
        let fake = FakeProcessor::start()
            .await
            .context("starting the fake card processor")?;
        let scrambler = match scramble {
            true => Some(Scrambler::start(&fake.url()).await?),
            false => None,
        };
        Ok(Self { fake, scrambler })
    }

    /// The base URL the services are given (`--card-processor`).
    pub(crate) fn url(&self) -> String {
        self.scrambler
            .as_ref()
            .map_or_else(|| self.fake.url(), Scrambler::url)
    }

    /// What the processor charged.
    pub(crate) fn stats(&self) -> Stats {
        self.fake.stats()
    }
}

/// One operation a run asks for: its Idempotency-Key (the HTTP client's) and its charge,
/// to an account no other operation uses.
#[derive(Debug, Clone)]
pub(crate) struct Op {
    /// The operation's position, which spreads its attempts over the servers.
    pub(crate) index: usize,
    pub(crate) key: String,
    pub(crate) account: String,
    pub(crate) amount_cents: i64,
    /// The client gives up after the first attempt that fails: what the operation left in
    /// progress is the completer's.
    pub(crate) give_up: bool,
}

impl Op {
    /// The charge's JSON body.
    pub(crate) fn body(&self) -> String {
        serde_json::json!({ "account": self.account, "amount_cents": self.amount_cents })
            .to_string()
    }
}

/// `n` operations of run `tag`, the share `give_up` of them (drawn by `draw`) given up after a
/// failed first attempt.
pub(crate) fn operations(tag: &str, n: usize, mut draw: impl FnMut() -> bool) -> Vec<Op> {
    (0..n)
        .map(|i| {
            let key = format!("{tag}-op-{i:06}");
            Op {
                index: i,
                account: key.clone(),
                key,
                amount_cents: 1 + (i as i64 * 7919) % 1000,
                give_up: draw(),
            }
        })
        .collect()
}
