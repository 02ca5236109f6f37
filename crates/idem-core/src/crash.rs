//! Crash points: the places in the processing path where a fault-injection run makes the
//! process die, to prove that a crash at the worst moment loses nothing and doubles nothing.
//!
//! Compiled in only with the `crash-points` feature; without it the crash check is an empty inline
//! function and the environment is never read. With it, a process started with
//! `IDEM_CRASH_AT=<point>:<n>` aborts (`SIGABRT`: no destructors, no flush, no ack, like a
//! `SIGKILL`) the `n`-th time it reaches `<point>`. `idem-chaos` sets it on the consumers and
//! services it starts.
//!
//! The module lives in idem-core so that every path with points reaches the same counter:
//! the consumer's runner (idem-consumer, which re-exports it as `idem_consumer::crash`), the
//! outbox relay (idem-relay) and the phase driver of recovery points (idem-request). Each of
//! those crates forwards the feature.
//!
//! | point | where |
//! |---|---|
//! | `before-claim` | a message is about to be claimed (before its transaction begins, or inside a batch's) |
//! | `after-handler` | the handler returned, its transaction is not committed yet |
//! | `after-commit` | the transaction committed, the delivery is not acknowledged yet |
//! | `in-batch` | inside a batch transaction, after the first message's handler and before the next one |
//! | `relay-after-lease` | the outbox relay leased a batch of rows, nothing of it published yet |
//! | `relay-after-publish` | the broker confirmed one row's publish, the row is not marked sent yet |
//! | `relay-after-mark` | a mark-sent transaction committed (a chunk of confirmed rows) |
//! | `phase-returned` | a phase of recovery points returned: its writes are made, its foreign call answered (for a charge: the processor charged), the next recovery point or the response is not committed |
//! | `point-committed` | a recovery point committed, the next phase not started |
//! | `response-committed` | an idempotent request or an operation of phases committed its response (or gave up), the caller not answered yet (no HTTP answer) |
//!
//! The first four are a consumer's ([`CrashPoint::ALL`]); the `relay-*` points are the relay's
//! ([`CrashPoint::RELAY`], in `idem-relay`), reached only in a process that runs a relay (the
//! `idem relay` command, `payments --emit`); the last three are the phase driver's
//! ([`CrashPoint::PHASES`], in idem-request: `run_phases`' loop, and the completion every
//! idempotent request ends with), reached where operations run as phases
//! (`http-payments --card-processor`, `payments --card-processor`).

use std::fmt;
use std::str::FromStr;

/// The environment variable that arms a crash point: `<point>:<n>`, e.g. `after-commit:25`.
pub const CRASH_AT_ENV: &str = "IDEM_CRASH_AT";

/// Whether this build has crash points compiled in (the `crash-points` feature).
pub const ENABLED: bool = cfg!(feature = "crash-points");

/// A place in the processing path where the process can be made to abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CrashPoint {
    /// Before a transaction's first claim (of its message, or of its batch).
    BeforeClaim,
    /// After a handler returned (in a batch: any message's), before COMMIT.
    AfterHandler,
    /// After COMMIT, before the acknowledgement.
    AfterCommit,
    /// Inside a batch transaction, between two handler calls.
    InBatch,
    /// The relay leased rows and published none of them yet.
    RelayAfterLease,
    /// The broker confirmed a row's publish; the row is not marked sent yet.
    RelayAfterPublish,
    /// A mark-sent transaction committed.
    RelayAfterMark,
    /// A phase returned (its writes made, its foreign call answered); its boundary is not
    /// committed.
    PhaseReturned,
    /// A recovery point committed; the next phase has not started.
    PointCommitted,
    /// An idempotent request (an operation of phases among them) committed its response, or
    /// gave up; its caller is not answered yet.
    ResponseCommitted,
}

impl CrashPoint {
    /// Every crash point of a consumer's processing path, in processing order (what a
    /// consumer process can be armed with; the relay's are [`RELAY`](Self::RELAY)).
    pub const ALL: [CrashPoint; 4] = [
        CrashPoint::BeforeClaim,
        CrashPoint::AfterHandler,
        CrashPoint::AfterCommit,
        CrashPoint::InBatch,
    ];

    /// The outbox relay's crash points, in the order a row meets them.
    pub const RELAY: [CrashPoint; 3] = [
        CrashPoint::RelayAfterLease,
        CrashPoint::RelayAfterPublish,
        CrashPoint::RelayAfterMark,
    ];

    /// The phase driver's crash points (recovery points), in the order an operation meets
    /// them.
    pub const PHASES: [CrashPoint; 3] = [
        CrashPoint::PhaseReturned,
        CrashPoint::PointCommitted,
        CrashPoint::ResponseCommitted,
    ];

    /// Every point, the consumer's, the relay's and the phase driver's.
    fn every() -> impl Iterator<Item = CrashPoint> {
        CrashPoint::ALL
            .into_iter()
            .chain(CrashPoint::RELAY)
            .chain(CrashPoint::PHASES)
    }

    /// The name used in [`CRASH_AT_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::BeforeClaim => "before-claim",
            CrashPoint::AfterHandler => "after-handler",
            CrashPoint::AfterCommit => "after-commit",
            CrashPoint::InBatch => "in-batch",
            CrashPoint::RelayAfterLease => "relay-after-lease",
            CrashPoint::RelayAfterPublish => "relay-after-publish",
            CrashPoint::RelayAfterMark => "relay-after-mark",
            CrashPoint::PhaseReturned => "phase-returned",
            CrashPoint::PointCommitted => "point-committed",
            CrashPoint::ResponseCommitted => "response-committed",
        }
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CrashPoint::every().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<_> = CrashPoint::every().map(|p| p.name()).collect();
            format!(
                "unknown crash point {s:?}: expected one of {}",
                names.join(", ")
            )
        })
    }
}

/// An armed crash point: abort on the `hit`-th time `point` is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashAt {
    /// Where.
    pub point: CrashPoint,
    /// On which visit, counting from 1.
    pub hit: u64,
}

impl FromStr for CrashAt {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (point, hit) = s
            .split_once(':')
            .ok_or_else(|| format!("{CRASH_AT_ENV}={s:?}: expected <point>:<n>"))?;
        let hit = hit
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{CRASH_AT_ENV}={s:?}: <n> must be a positive integer"))?;
        Ok(CrashAt {
            point: point.parse()?,
            hit,
        })
    }
}

impl fmt::Display for CrashAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.point, self.hit)
    }
}

/// Checks [`CRASH_AT_ENV`] at start-up, so a typo fails the process at once instead of
/// silently never crashing: `Ok(None)` when unset, an error when malformed or when this build
/// has no crash points to arm.
pub fn from_env() -> Result<Option<CrashAt>, String> {
    let Some(value) = std::env::var_os(CRASH_AT_ENV) else {
        return Ok(None);
    };
    let value = value
        .into_string()
        .map_err(|_| format!("{CRASH_AT_ENV} is not UTF-8"))?;
    let at: CrashAt = value.parse()?;
    if !ENABLED {
        return Err(format!(
            "{CRASH_AT_ENV}={at} is set, but this build has no crash points (build with the `crash-points` feature)"
        ));
    }
    Ok(Some(at))
}

/// Marks that the processing path reached `point`; aborts the process if it is armed there
/// and this is the armed visit. Public for the crates whose paths have points of their own
/// (idem-consumer, idem-relay, idem-request); without the `crash-points` feature it does nothing.
#[inline(always)]
pub fn reached(point: CrashPoint) {
    #[cfg(feature = "crash-points")]
    armed::reached(point);
    #[cfg(not(feature = "crash-points"))]
    let _ = point;
}

#[cfg(feature = "crash-points")]
mod armed {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::{CrashAt, CrashPoint};

    static ARMED: OnceLock<Option<CrashAt>> = OnceLock::new();
    static VISITS: AtomicU64 = AtomicU64::new(0);

    pub(super) fn reached(point: CrashPoint) {
        // A malformed variable was already refused by `from_env` in a process that checks it;
        // one that does not check gets no crash rather than a crash at a random place.
        let armed = ARMED.get_or_init(|| super::from_env().ok().flatten());
        let Some(at) = armed else { return };
        if at.point != point {
            return;
        }
        if VISITS.fetch_add(1, Ordering::SeqCst) + 1 == at.hit {
            // stderr is unbuffered: the line is out before the abort.
            eprintln!("idem: crash point {at} reached, aborting");
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_points_and_visits() {
        let at: CrashAt = "after-commit:25".parse().unwrap();
        assert_eq!(
            at,
            CrashAt {
                point: CrashPoint::AfterCommit,
                hit: 25
            }
        );
        assert_eq!(at.to_string(), "after-commit:25");
        for p in CrashPoint::every() {
            assert_eq!(p.name().parse::<CrashPoint>().unwrap(), p);
        }
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in [
            "after-commit",
            "after-commit:0",
            "after-commit:-1",
            "nowhere:3",
            "",
        ] {
            assert!(bad.parse::<CrashAt>().is_err(), "{bad:?} accepted");
        }
    }
}
