//! The store traits: small capabilities a backend implements, instead of one fat trait.
//!
//! | trait | what it gives | used by |
//! |---|---|---|
//! | [`TransactionalStore`] | begin / commit / rollback on the business database | every processing path |
//! | [`ClaimStore`] | one claim under the unique constraint, in the caller's transaction (or begun with it, in one flight where the driver pipelines) | [`Processor::process`] |
//! | [`Savepoints`] | roll back part of a transaction | handlers and callers of [`Processor::claim_in`] |
//! | [`BatchClaimStore`] | many claims in one statement | [`Processor::process_batch`], [`Processor::process_batch_set`] |
//! | [`Migrate`], [`Prune`], [`Stats`] | schema, retention, inspection | operators and `idem` CLI |
//! | [`RequestStore`] | idempotent-request records: lease with fencing, stored result | `idem-request`, `idem-http` |
//! | [`ReapRequests`] | expired request records removed in bounded batches | operators and `idem` CLI |
//!
//! [`Processor::process`]: crate::Processor::process
//! [`Processor::process_batch`]: crate::Processor::process_batch
//! [`Processor::claim_in`]: crate::Processor::claim_in
//! [`Processor::process_batch_set`]: crate::Processor::process_batch_set

use std::future::Future;

use std::time::Duration;

use crate::clock::{Stamp, Timestamp};
use crate::error::{Error, ErrorKind};
use crate::fingerprint::Fingerprint;
use crate::id::{ConsumerName, MessageId};

pub use crate::request::recovery::RecoveryStore;
pub use crate::request::store::{ReapRequests, RequestStore, reap_all};

/// One claim to record: (consumer, message ID) is the unique key.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// Namespace of the claim.
    pub consumer: &'a ConsumerName,
    /// The producer-set ID.
    pub id: &'a MessageId,
    /// Digest of this delivery's payload.
    pub fingerprint: &'a Fingerprint,
    /// When it is processed, by which clock; what retention is measured from.
    pub at: Stamp,
}

/// A store that runs transactions on the database where the handler's effects live.
pub trait TransactionalStore: Send + Sync {
    /// An open transaction; handlers receive `&mut` of it and run their writes on it.
    type Tx: Send;

    /// Begins a transaction. Stores that need a write lock up front (SQLite) take it here.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, Error>> + Send;

    /// Commits. A connection lost during commit is [`ErrorKind::OutcomeUnknown`].
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Error>> + Send;

    /// Rolls back.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Error>> + Send;

    /// Classifies an error a handler returned, if it came from this store's driver, so a
    /// deadlock inside the handler is [`ErrorKind::Transient`] rather than a handler failure,
    /// and a connection that broke under the handler's statements
    /// [`ErrorKind::ConnectionLost`]. The handler's statements are not idem's: a
    /// [`Misconfigured`](ErrorKind::Misconfigured) or
    /// [`InvalidConfig`](ErrorKind::InvalidConfig) answered here becomes that message's
    /// [`ErrorKind::Store`] failure in [`handler_error`], never a reason to stop a consumer.
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        let _ = error;
        None
    }

    /// Whether the store answers at all, asked on a connection of its own (never a
    /// transaction's): a consumer asks right after a message's connection was lost, to tell a
    /// store that is down for everyone (the probe fails too: an outage, waited out) from a
    /// message whose statements end their own session (the probe succeeds: the message spends
    /// an attempt). The SQL stores run `SELECT 1` on their pool. It says nothing about whether
    /// the store takes writes (a read-only standby answers it), so it is asked only about lost
    /// connections.
    ///
    /// The default cannot tell and answers [`ErrorKind::Unavailable`], so a store without a
    /// probe keeps treating every lost connection as an outage (bounded by the consumer's
    /// outage limit).
    fn probe(&self) -> impl Future<Output = Result<(), Error>> + Send {
        async {
            Err(Error::new(
                ErrorKind::Unavailable,
                "this store cannot be probed",
            ))
        }
    }
}

/// Records claims under a unique (consumer, message ID) constraint.
///
/// The insert must be one statement that cannot race (`INSERT … ON CONFLICT DO NOTHING` or the
/// store's equivalent), never a check followed by an insert. When another transaction holds an
/// uncommitted claim for the same key, the insert waits for it to finish.
pub trait ClaimStore: TransactionalStore {
    /// The longest message ID, in bytes, this store's schema holds.
    fn max_message_id_len(&self) -> usize;

    /// How long the store keeps every claim at least when it drops claims on its own, whatever
    /// a processor's pruning says: a PostgreSQL table partitioned by the ID's time drops whole
    /// days past the table's retention. `None` (the default): claims stay until pruned.
    /// [`ProcessorBuilder::build`](crate::ProcessorBuilder::build) refuses a redelivery window
    /// (plus its clock margin) longer than this.
    fn kept_for(&self) -> Option<Duration> {
        None
    }

    /// Inserts the claim. `None`: inserted by this transaction. `Some(fp)`: a claim already
    /// existed, recorded with fingerprint `fp`.
    fn claim(
        &self,
        tx: &mut Self::Tx,
        claim: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Option<Fingerprint>, Error>> + Send;

    /// Begins a transaction and inserts the claim in it: what [`Processor::process`] runs
    /// before the handler. Returns the open transaction and what [`claim`](Self::claim)
    /// returns; on an error no transaction is left open.
    ///
    /// The default is [`begin`](TransactionalStore::begin), then [`claim`](Self::claim), each
    /// waiting for the database's answer. A driver that can pipeline (send the claim before
    /// `BEGIN`'s answer arrives, as tokio-postgres does) overrides it, so the claim costs no
    /// round trip of its own.
    ///
    /// [`Processor::process`]: crate::Processor::process
    fn begin_and_claim(
        &self,
        claim: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<(Self::Tx, Option<Fingerprint>), Error>> + Send {
        async move {
            let mut tx = self.begin().await?;
            match self.claim(&mut tx, claim).await {
                Ok(found) => Ok((tx, found)),
                Err(e) => {
                    // A failed rollback means a broken connection, which the driver discards;
                    // the claim's error is the one worth reporting.
                    let _ = self.rollback(tx).await;
                    Err(e)
                }
            }
        }
    }
}

/// Claims a whole batch in one statement.
pub trait BatchClaimStore: ClaimStore {
    /// Inserts every claim; returns, in input order, `None` for those this statement inserted
    /// and `Some(stored fingerprint)` for those that already existed. The caller guarantees that
    /// the IDs are distinct and that all share `consumer` and `at`.
    fn claim_many(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> impl Future<Output = Result<Vec<Option<Fingerprint>>, Error>> + Send;

    /// Begins a transaction and claims the batch in it, as
    /// [`begin_and_claim`](ClaimStore::begin_and_claim) does for one message: what
    /// [`Processor::process_batch`] and [`Processor::process_batch_set`] run before their
    /// handlers. On an error no transaction is left open. The default waits for `BEGIN`'s
    /// answer before sending the claim; a pipelining driver overrides it.
    ///
    /// [`Processor::process_batch`]: crate::Processor::process_batch
    /// [`Processor::process_batch_set`]: crate::Processor::process_batch_set
    fn begin_and_claim_many(
        &self,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> impl Future<Output = Result<(Self::Tx, Vec<Option<Fingerprint>>), Error>> + Send {
        async move {
            let mut tx = self.begin().await?;
            match self.claim_many(&mut tx, consumer, items, at).await {
                Ok(found) => Ok((tx, found)),
                Err(e) => {
                    let _ = self.rollback(tx).await;
                    Err(e)
                }
            }
        }
    }
}

/// A single, non-nested savepoint inside a transaction.
pub trait Savepoints: TransactionalStore {
    /// Sets the savepoint.
    fn savepoint(&self, tx: &mut Self::Tx) -> impl Future<Output = Result<(), Error>> + Send;
    /// Keeps everything since the savepoint.
    fn release_savepoint(
        &self,
        tx: &mut Self::Tx,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Undoes everything since the savepoint; the transaction stays usable.
    fn rollback_to_savepoint(
        &self,
        tx: &mut Self::Tx,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Creates the processed-messages table and its indexes; safe to run many times.
pub trait Migrate: Send + Sync {
    /// Creates what is missing.
    fn migrate(&self) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Deletes old claims in bounded batches.
pub trait Prune: Send + Sync {
    /// Deletes at most `limit` claims (of `consumer`, or of every consumer) processed more than
    /// `older_than` before `now`, in its own short transaction. Returns how many were deleted.
    ///
    /// `now` is read on the same clock claims are stamped with: [`Stamp::StoreClock`] is the
    /// database server's clock where there is one, so the pruner's own clock never matters.
    fn prune_batch(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// Claims per consumer, for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerStats {
    /// The consumer.
    pub consumer: String,
    /// How many claims it holds.
    pub claims: u64,
    /// Oldest `processed_at`.
    pub oldest: Timestamp,
    /// Newest `processed_at`.
    pub newest: Timestamp,
}

/// Reports [`ConsumerStats`].
pub trait Stats: Send + Sync {
    /// One row per consumer, ordered by name.
    fn stats(&self) -> impl Future<Output = Result<Vec<ConsumerStats>, Error>> + Send;
}

/// Turns an error a handler returned — from any operation run in `store`'s transaction — into
/// an idem [`Error`]: an explicit idem error keeps its kind (e.g. [`Error::reject`]), the store
/// recognises its driver's errors (a deadlock is [`ErrorKind::Transient`], a read-only database
/// [`ErrorKind::Unavailable`], a connection that broke under the handler
/// [`ErrorKind::ConnectionLost`]), and anything else is a retryable [`ErrorKind::Handler`]
/// failure.
///
/// Who ran the statement decides what a refusal means. A table, column or privilege missing
/// under idem's own statements (claim, begin, commit) stops a consumer: every message would
/// fail the same way. Under the handler's own statements it is about this message — a
/// row-level-security check refusing its row, a table only some messages write — so the
/// store's [`Misconfigured`](ErrorKind::Misconfigured) (or
/// [`InvalidConfig`](ErrorKind::InvalidConfig)) becomes [`ErrorKind::Store`] here: retried,
/// then dead-lettered, while the consumer goes on with the next message.
pub fn handler_error<S: TransactionalStore + ?Sized>(store: &S, e: crate::BoxError) -> Error {
    let e = match e.downcast::<Error>() {
        Ok(ours) => return *ours,
        Err(e) => e,
    };
    let (kind, message) = match store.classify(&*e) {
        None => (ErrorKind::Handler, format!("handler failed: {e}")),
        Some(ErrorKind::Transient) => (
            ErrorKind::Transient,
            format!("handler hit a transient database error: {e}"),
        ),
        Some(ErrorKind::ConnectionLost) => (
            ErrorKind::ConnectionLost,
            format!("the database connection was lost while the handler ran: {e}"),
        ),
        Some(ErrorKind::Misconfigured | ErrorKind::InvalidConfig) => (
            ErrorKind::Store,
            format!("the database refused a statement of the handler: {e}"),
        ),
        Some(kind) => (kind, format!("handler failed: {e}")),
    };
    Error::new(kind, message).with_source(e)
}

/// Deletes every claim processed more than `older_than` before `now`, `batch` rows at a time,
/// so that pruning a large table never holds long locks or bloats one transaction.
pub async fn prune_all<S: Prune + ?Sized>(
    store: &S,
    consumer: Option<&ConsumerName>,
    now: Stamp,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = store.prune_batch(consumer, now, older_than, batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}
