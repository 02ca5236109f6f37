//! Recovery points (atomic phases): an operation made of named phases, whose record remembers
//! the last phase boundary it committed, so that a retry, a takeover or a completer resumes
//! there instead of starting over.
//!
//! A boundary is one commit on the store that holds the record: the phase's own writes, and
//! the record's new recovery point (its name and the state the next phase needs), written by
//! [`RecoveryStore::advance_in`] in the same transaction. A phase that committed is therefore
//! never run again; a phase that crashed before its boundary runs again from the last point,
//! and an external call it made repeats with the same derived key
//! ([`DerivedKey::for_phase`](crate::DerivedKey::for_phase)), so the third party
//! deduplicates it.
//!
//! The first point costs no commit of its own: [`RecoveryStore::begin_phases`] takes the
//! record and writes the operation's first point in the same statement, so an operation is
//! resumable — by the completer too, which knows no first phase — before its first phase
//! runs, whether that phase writes locally or calls a third party; and it returns where a
//! taken record stands, so nothing reads it in another round trip.
//!
//! Only a store whose transaction carries both the operation's writes and the record
//! implements [`RecoveryStore`]: the SQL stores. Redis does not — it shares no transaction
//! with the business database, so a point written there could commit while the phase's writes
//! did not (or the other way round).

use std::future::Future;
use std::time::Duration;

use super::{Begin, Fence, RequestKey};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::request::store::RequestStore;

/// Where a held record's last committed phase boundary left it, as the executor holding it
/// reads it ([`RecoveryStore::recovery`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Executions of this record so far, this one included: 1 on the first, one more on each
    /// takeover (a crashed executor, the completer).
    pub attempts: u32,
    /// The last recovery point, if a boundary was committed.
    pub resume: Option<Resume>,
}

/// A committed recovery point: where to resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// The point's name (for `idem-request`'s phases, the phase's name).
    pub point: String,
    /// What the next phase needs, as the boundary stored it.
    pub state: Vec<u8>,
}

/// A record the completer took over: in progress, its lease ran out (its client gave up or
/// its executor crashed), and it has a recovery point to resume at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stuck {
    /// The record.
    pub key: RequestKey,
    /// The completer's fencing token: every later write must carry it.
    pub fence: Fence,
    /// Where to resume; `resume` is always `Some`.
    pub recovery: Recovery,
}

/// A [`RequestStore`] whose records keep recovery points, written in the operation's own
/// transaction. `idem_testkit::recovery_conformance_tests!` checks the contract on the real
/// server (and `phases_conformance_tests!` / `completer_conformance_tests!` the phases and the
/// completer run on it end to end):
/// - [`advance_in`](Self::advance_in) writes the point only while `fence` holds the record
///   in progress, and otherwise fails with
///   [`RequestErrorKind::LeaseLost`](crate::RequestErrorKind::LeaseLost);
/// - a record with a recovery point is never started afresh or reaped for being past its TTL:
///   its next lookup after the lease ran out takes it over, so it resumes;
///   [`release`](RequestStore::release) ends its lease instead of deleting it;
/// - an abandoned record ([`abandon_in`](Self::abandon_in)) replays its stored result like a
///   completed one;
/// - [`take_stuck`](Self::take_stuck) takes over at most `limit` records past their lease that
///   have a point, skipping those another transaction holds, so several completers share the
///   work.
pub trait RecoveryStore: RequestStore {
    /// [`begin_request`](RequestStore::begin_request) for an operation of phases whose first
    /// recovery point is `point` with `state`: a record it inserts (or starts afresh, being
    /// expired) is born at that point, written by the statement that takes it — so the first
    /// point is committed before the first phase runs at no commit of its own. With an
    /// [`Acquired`](Begin::Acquired) record comes where it stands (`Some`): a new one at
    /// `point`, attempt 1; one taken over at its own last point (or none, if it never had
    /// one), attempts counted. `None` with every other answer.
    ///
    /// The engine resumes from what this returns without reading the record again
    /// ([`recovery`](Self::recovery) stays for a store that answers `None` with an acquired
    /// record).
    #[allow(clippy::too_many_arguments)]
    fn begin_phases(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        point: &str,
        state: &[u8],
    ) -> impl Future<Output = Result<(Begin, Option<Recovery>), Error>> + Send;

    /// The recovery state of the record `fence` holds in progress; `LeaseLost` when it no
    /// longer does.
    fn recovery(
        &self,
        key: &RequestKey,
        fence: Fence,
    ) -> impl Future<Output = Result<Recovery, Error>> + Send;

    /// Sets the record's recovery point to `point` with `state`, inside `tx` (the transaction
    /// carrying the phase's writes), only while `fence` holds it; `LeaseLost` otherwise, and
    /// the caller must roll `tx` back. Touches nothing else (not the lease, not the expiry).
    fn advance_in(
        &self,
        tx: &mut Self::Tx,
        key: &RequestKey,
        fence: Fence,
        point: &str,
        state: &[u8],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Ends the record held under `fence` as **abandoned** with `result`, replayed to every
    /// retry until `ttl` from now, inside `tx` (where a compensation's writes go).
    /// `LeaseLost` when `fence` no longer holds it.
    fn abandon_in(
        &self,
        tx: &mut Self::Tx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Takes over, under a lease of `lease`, at most `limit` records in progress whose lease
    /// ran out and that have a recovery point, oldest lease first. Records another transaction
    /// holds (a completer's, or an executor's still writing) are skipped, not waited for.
    fn take_stuck(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Stuck>, Error>> + Send;
}
