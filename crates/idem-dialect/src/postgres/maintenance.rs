//! Maintenance of a claims table partitioned by the ID's time ([`super::partition`]): the
//! partitions' names, the catalog reads, the DDL scripts, and the pure [`plan`] of what to
//! create and drop — all text and decisions, which both PostgreSQL stores execute with their
//! own driver under the same locks, so either maintains a table the other claims in.
//!
//! pg_partman could do the create-ahead and drop-behind, but it is an extension a managed
//! PostgreSQL may not offer, wants a background worker or cron for its maintenance, and knows
//! nothing of the two moves correctness needs here (claims of a day out of the default
//! partition when that day's partition is created; claims younger than the retention out of a
//! day's partition before it is dropped). The few statements below do exactly that, under one
//! advisory lock, from the consumer's own pruning loop.
//!
//! Two layouts. Every table `migrate` creates is **bounded** (no PostgreSQL DEFAULT
//! partition): days are attached and detached concurrently and no step of a round makes a
//! claim wait ([`round`]). A table made by earlier versions has a DEFAULT partition
//! ([`is_legacy`]); it is maintained as before — each day created and dropped under a moment
//! of ACCESS EXCLUSIVE on the table, which stalls the claims for that moment — until
//! [`bound_legacy`] converts it.
//!
//! Rules that keep maintenance safe beside running consumers. Its waits are bounded
//! ([`LOCK_TIMEOUT`], the advisory lock included): a busy round fails and the next one tries
//! again (a bounded round cut short leaves nothing the next cannot finish), and `migrate` goes
//! on without it. On a legacy table it locks the parent table before a partition, in the mode
//! its DDL needs, as a claim locks the parent before the partition its key routes to (the
//! other order deadlocks with such a claim). And the table records how it is partitioned
//! ([`PartitionRecord`], in its comment): a store reading IDs with another extractor is
//! refused, and a store not configured partitioned never prunes the table.
//!
//! One round, as a store runs it: read [`DAYS`] (the table's comment, checked with
//! [`check_record`]); then on a connection of its own, [`session_start`], the clock
//! ([`READ_CLOCK`](super::READ_CLOCK)) and [`RELATIONS`]; on a bounded table run the
//! [`round`]'s steps; then [`session_end`], error or not. On a legacy table: [`plan`] the
//! round from [`days_of`]; then for each day to create, in a transaction opened with
//! [`maintenance_lock`]: [`EXISTS`], and unless it does, [`create_day`]; for each day to drop,
//! likewise: [`EXISTS`], [`ESTIMATE`], [`look_before_drop`], then [`drop_day`].

use idem_core::{Error, ErrorKind, TableName, Timestamp};

use super::partition::{Day, PartitionKind, PartitionRecord, Partitioning};

/// The suffix of the partition holding IDs whose time is outside every day's partition.
pub const DEFAULT: &str = "default";

/// The suffix of the partition holding IDs with no readable time (key
/// [`UNDATED`](super::partition::UNDATED)).
pub const UNDATED: &str = "undated";

/// How long maintenance waits for a lock before giving up until the next round: for the
/// claims table (creating or dropping a partition takes an exclusive lock on the parent for a
/// moment, and a queue of claims behind a waiting DDL would stall the consumer longer than
/// skipping), and for the maintenance lock itself (another replica holding it is doing the
/// same work). A wait past it fails with [`LOCK_NOT_AVAILABLE`](super::sqlstate::LOCK_NOT_AVAILABLE).
pub const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";

/// A table's kind (`r` plain, `p` partitioned) and comment (where a partitioned table records
/// its partitioning), by its (possibly qualified) name `$1`; no row when it does not exist.
pub const SHAPE: &str = "SELECT relkind::text, obj_description(oid, 'pg_class') FROM pg_class \
     WHERE oid = to_regclass($1)";

/// A table's comment and the names of the partitions attached to it, by its name `$1`, in one
/// catalog read. Names only: sizing a partition would wait for the lock another replica's
/// maintenance holds on it.
pub const DAYS: &str = "SELECT obj_description(to_regclass($1), 'pg_class'), \
     ARRAY(SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     WHERE i.inhparent = to_regclass($1))";

/// The partitions attached to table `$1`: name, the planner's row estimate, size with indexes.
pub const LIST: &str = "SELECT c.relname::text, c.reltuples::bigint, pg_total_relation_size(c.oid) \
     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     WHERE i.inhparent = to_regclass($1) ORDER BY c.relname";

/// Whether the relation `$1` exists.
pub const EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL";

/// The planner's estimate of the rows of relation `$1` (`-1` when never analysed).
pub const ESTIMATE: &str = "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass($1)";

/// The name of one of `t`'s partitions: `<table>_<suffix>`, in `t`'s schema.
pub fn partition_name(t: &TableName, suffix: &str) -> String {
    match t.schema() {
        Some(s) => format!("{s}.{}_{suffix}", t.table()),
        None => format!("{}_{suffix}", t.table()),
    }
}

/// The name of `day`'s partition of `t`: `<table>_pYYYYMMDD`.
pub fn day_name(t: &TableName, day: Day) -> String {
    partition_name(t, &format!("p{}", day.suffix()))
}

/// Which of `t`'s partitions `relname` (unqualified, as the catalog lists it) is; `None` for
/// a table that is not one of the names above (someone else's, attached by hand).
pub fn kind_of(t: &TableName, relname: &str) -> Option<PartitionKind> {
    let rest = relname.strip_prefix(t.table())?.strip_prefix('_')?;
    match rest {
        DEFAULT => Some(PartitionKind::Default),
        UNDATED => Some(PartitionKind::Undated),
        _ => Day::parse_suffix(rest.strip_prefix('p')?).map(PartitionKind::Day),
    }
}

/// The days of the day partitions among `names` (as [`DAYS`] lists them), oldest first.
pub fn days_of(t: &TableName, names: impl IntoIterator<Item = impl AsRef<str>>) -> Vec<Day> {
    let mut days: Vec<Day> = names
        .into_iter()
        .filter_map(|n| match kind_of(t, n.as_ref()) {
            Some(PartitionKind::Day(d)) => Some(d),
            _ => None,
        })
        .collect();
    days.sort();
    days
}

/// Takes the maintenance lock of `t`, which every replica's maintenance of the table (on
/// either PostgreSQL store) takes turns on. Its key is the table as the catalog names it,
/// `idem-partitions:<schema>.<table>`, however the store spells it (`Claims`, `claims`,
/// `public.claims` are one table, so one lock); the name as given while the table is missing.
pub fn lock_statement(t: &TableName) -> String {
    lock_with(t, "pg_advisory_xact_lock")
}

/// What opens every maintenance transaction, as one simple query: [`LOCK_TIMEOUT`] first, so
/// that it bounds the wait for the advisory lock too, then [`lock_statement`].
pub fn maintenance_lock(t: &TableName) -> String {
    format!("{LOCK_TIMEOUT}; {}", lock_statement(t))
}

/// Creates `day`'s partition of `t`, moving the day's claims out of the default partition
/// first; one simple query. Its rows affected, summed over its statements, are twice the
/// claims moved (the `DELETE` and the `INSERT` each count them once).
///
/// No claim may land in the default partition while its day's claims move out, or the new
/// partition would not cover them; PostgreSQL then checks the default partition holds none of
/// the day, under the same lock. The parent is locked first, as a claim locks it (the parent,
/// then the partition its key routes to): the other order deadlocks with a claim routed to the
/// default partition by a transaction that holds the parent already. ACCESS EXCLUSIVE is what
/// `CREATE TABLE … PARTITION OF` takes on the parent anyway; a weaker lock upgraded later would
/// deadlock with a transaction that read the table and then claims.
pub fn create_day(t: &TableName, day: Day) -> String {
    let (part, default) = (day_name(t, day), partition_name(t, DEFAULT));
    let (start, end) = (day.start(), day.end());
    format!(
        "LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
         LOCK TABLE {default} IN SHARE ROW EXCLUSIVE MODE; \
         CREATE TEMP TABLE idem_moving (LIKE {t}) ON COMMIT DROP; \
         WITH m AS (DELETE FROM {default} WHERE id_time >= {start} AND id_time < {end} \
         RETURNING *) INSERT INTO idem_moving SELECT * FROM m; \
         CREATE TABLE {part} PARTITION OF {t} FOR VALUES FROM ({start}) TO ({end}); \
         INSERT INTO {t} SELECT * FROM idem_moving"
    )
}

/// Locks `day`'s partition of `t` and sets aside its claims processed at `cutoff` or later
/// (an old ID processed late, still inside the retention); one simple query whose rows
/// affected are the claims set aside, which [`drop_day`] needs. Locked before the look so that
/// no late claim lands in it between the look and the drop; the parent first, in the mode
/// `DETACH` and `DROP` take on it, as in [`create_day`].
pub fn look_before_drop(t: &TableName, day: Day, cutoff: i64) -> String {
    let part = day_name(t, day);
    format!(
        "LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
         LOCK TABLE {part} IN SHARE ROW EXCLUSIVE MODE; \
         CREATE TEMP TABLE idem_moving ON COMMIT DROP AS \
         SELECT * FROM {part} WHERE processed_at >= {cutoff}"
    )
}

/// Drops `day`'s partition of `t`, after [`look_before_drop`] set `young` claims aside in the
/// same transaction: they move to the default partition first. Detached, the day's range is
/// no longer covered, so the parent routes them there, where their key still finds them.
pub fn drop_day(t: &TableName, day: Day, young: u64) -> String {
    let part = day_name(t, day);
    if young == 0 {
        format!("DROP TABLE {part}")
    } else {
        format!(
            "ALTER TABLE {t} DETACH PARTITION {part}; \
             INSERT INTO {t} SELECT * FROM idem_moving; DROP TABLE {part}"
        )
    }
}

/// The partitioned schema's claims-table statements (in `migrate`'s transaction, under its
/// lock), in the bounded layout ([`round`]). The comment ends with `p`'s [`PartitionRecord`].
pub fn create_statements(t: &TableName, p: &Partitioning) -> Vec<String> {
    schema_statements(t, p, false)
}

/// What versions before the bounded layout created: the same table with PostgreSQL's
/// `DEFAULT` partition as `<table>_default`. Such a table keeps working ([`is_legacy`]: its
/// days are created and dropped by [`create_day`] and [`drop_day`], each under a short
/// exclusive lock) until [`bound_legacy`] converts it. For tests and the prune bench, which build one.
pub fn legacy_create_statements(t: &TableName, p: &Partitioning) -> Vec<String> {
    schema_statements(t, p, true)
}

fn schema_statements(t: &TableName, p: &Partitioning, legacy: bool) -> Vec<String> {
    let name = t.table();
    let (undated, default) = (partition_name(t, UNDATED), partition_name(t, DEFAULT));
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     text   NOT NULL,
                message_id   bytea  NOT NULL,
                fingerprint  bytea  NOT NULL,
                processed_at bigint NOT NULL,
                id_time      bigint NOT NULL,
                PRIMARY KEY (consumer, message_id, id_time)
            ) PARTITION BY RANGE (id_time)"
        ),
        // Key 0 (partition::UNDATED): IDs with no readable time.
        format!(
            "CREATE TABLE IF NOT EXISTS {undated} PARTITION OF {t} FOR VALUES FROM (MINVALUE) TO (1)"
        ),
        // IDs older than every day's partition: below today's UTC midnight at creation;
        // maintenance moves the bound as days are created below it or dropped
        // ([`round`]). A range, not PostgreSQL's DEFAULT partition: with one, `DETACH …
        // CONCURRENTLY` is refused and every drop locks the claims out.
        if legacy {
            format!("CREATE TABLE IF NOT EXISTS {default} PARTITION OF {t} DEFAULT")
        } else {
            format!(
                "CREATE TABLE IF NOT EXISTS {default} PARTITION OF {t} FOR VALUES FROM (1) TO \
                 ((floor(extract(epoch from now()) / 86400) * 86400000000)::bigint)"
            )
        },
        format!("CREATE INDEX IF NOT EXISTS {name}_processed_at ON {t} USING brin (processed_at)"),
        format!(
            "COMMENT ON TABLE {t} IS 'idem claims, partitioned by the time inside the message ID \
             (id_time, microseconds since the Unix epoch; 0 when the ID has none): one row per \
             (consumer, message_id) processed; processed_at in microseconds since the Unix \
             epoch. {}'",
            p.record()
        ),
    ]
}

/// One round of maintenance, decided: what [`plan`] says to do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Plan {
    /// Days whose partitions to create, oldest first: today through the days ahead, those
    /// that do not exist.
    pub create: Vec<Day>,
    /// Days whose partitions to drop, oldest first: those wholly older than the retention.
    pub drop: Vec<Day>,
    /// Claims processed at this time (microseconds) or later are younger than the retention:
    /// moved out of a day's partition before it is dropped ([`look_before_drop`]).
    pub cutoff: i64,
}

/// What one round of maintenance does at `now` (the database's clock) on a table whose day
/// partitions are `existing`, partitioned as `p` says: create today's partition and those
/// [ahead](Partitioning::created_ahead) that are missing, and drop the days wholly past the
/// table's retention. A store runs the plan day by day, each step checking again under the
/// lock that its day still needs it (another replica may have been first).
pub fn plan(existing: &[Day], now: Timestamp, p: &Partitioning) -> Plan {
    let create = p
        .days_to_create(now)
        .filter(|d| !existing.contains(d))
        .collect();
    let mut drop: Vec<Day> = existing
        .iter()
        .copied()
        .filter(|d| p.droppable(*d, now))
        .collect();
    drop.sort();
    drop.dedup();
    Plan {
        create,
        drop,
        cutoff: now
            .as_micros()
            .saturating_sub(crate::micros(p.table_retention().prune_age())),
    }
}

/// Checks a table's comment (as [`DAYS`] reads it) against the partitioning a store reads
/// IDs with: refused when the table records another extractor; a table without a record
/// passes (`migrate` writes it).
pub fn check_record(t: &TableName, comment: Option<&str>, p: &Partitioning) -> Result<(), Error> {
    match PartitionRecord::from_comment(t, comment.unwrap_or(""))? {
        Some(record) => record.check(t, p),
        None => Ok(()),
    }
}

/// `migrate`'s verdict on the claims table's `shape` ([`SHAPE`]: kind and comment; `None` when
/// it does not exist yet) for a store partitioned as `partitioning` says: a partitioned store
/// on a plain table or the reverse is refused (the statements of one do not fit the other,
/// and converting a table of claims is an operator's decision), and so is a partitioned store
/// whose extractor is not the one the table records.
pub fn shape_fits(
    t: &TableName,
    shape: Option<(&str, Option<&str>)>,
    partitioning: Option<&Partitioning>,
) -> Result<(), Error> {
    let message = match (shape, partitioning) {
        (Some(("r", _)), Some(_)) => format!(
            "the claims table {t} exists and is not partitioned; partitioning is chosen when the \
             table is created: migrate into a new table (with_table) or drop .partitioned(..)"
        ),
        (Some(("p", _)), None) => format!(
            "the claims table {t} is partitioned by the ID's time; configure the store with \
             .partitioned(..) to use it"
        ),
        (Some(("p", Some(comment))), Some(p)) => return check_record(t, Some(comment), p),
        _ => return Ok(()),
    };
    Err(Error::new(ErrorKind::Misconfigured, message))
}

/// A store not configured `.partitioned(..)` pruning a claims table of this `shape`
/// ([`SHAPE`]): refused when the table is partitioned, since its days must be dropped past
/// the table's retention, which such a store does not know, and its row-wise statement
/// deletes nothing from a parent (`ONLY`).
pub fn refuse_unpartitioned_prune(
    t: &TableName,
    shape: Option<(&str, Option<&str>)>,
) -> Result<(), Error> {
    match shape {
        Some(("p", comment)) => Err(PartitionRecord::refuse_unpartitioned_prune(t, comment)),
        _ => Ok(()),
    }
}

/// The record a claims table of this `shape` ([`SHAPE`]) carries, for a tool that configures
/// a store as the table is (`with_table_partitioning`): `None` for a plain or missing table,
/// or a partitioned one made before tables recorded their partitioning.
pub fn recorded(
    t: &TableName,
    shape: Option<(&str, Option<&str>)>,
) -> Result<Option<PartitionRecord>, Error> {
    match shape {
        Some(("p", Some(comment))) => PartitionRecord::from_comment(t, comment),
        _ => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// The bounded layout: no DEFAULT partition, so that days leave by `DETACH … CONCURRENTLY`.
// ---------------------------------------------------------------------------------------

/// Every relation of the claims table `$1`'s family in its schema — its partitions, and tables
/// that kept a partition's name after a detach — as [`Relation`]s: name, attached, left
/// pending by an interrupted `DETACH … CONCURRENTLY`, its bound as PostgreSQL prints it
/// (`FOR VALUES FROM ('1') TO ('…')`, `DEFAULT`; empty when detached), the planner's row
/// estimate. Needs PostgreSQL 14 (`pg_inherits.inhdetachpending`).
pub const RELATIONS: &str = "SELECT c.relname::text, i.inhrelid IS NOT NULL, \
     coalesce(i.inhdetachpending, false), coalesce(pg_get_expr(c.relpartbound, c.oid), ''), \
     c.reltuples::bigint \
     FROM pg_class p JOIN pg_class c ON c.relnamespace = p.relnamespace \
     LEFT JOIN pg_inherits i ON i.inhrelid = c.oid AND i.inhparent = p.oid \
     WHERE p.oid = to_regclass($1) AND c.relkind = 'r' \
     AND starts_with(c.relname::text, p.relname::text || '_') ORDER BY c.relname";

/// One row of [`RELATIONS`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Relation {
    /// The table's name, unqualified, as the catalog lists it.
    pub name: String,
    /// Whether it is a partition of the claims table (pending or not).
    pub attached: bool,
    /// Whether an interrupted `DETACH … CONCURRENTLY` left it half detached.
    pub pending: bool,
    /// Its bound as `pg_get_expr` prints it; empty when detached.
    pub bound: String,
    /// The planner's row estimate (`-1` when never analysed).
    pub estimate: i64,
}

impl Relation {
    /// A row of [`RELATIONS`], as a store reads it.
    pub fn new(name: String, attached: bool, pending: bool, bound: String, estimate: i64) -> Self {
        Self {
            name,
            attached,
            pending,
            bound,
            estimate,
        }
    }

    fn in_place(&self) -> bool {
        self.attached && !self.pending
    }
}

/// Whether `t` (its [`RELATIONS`]) was made before the bounded layout: its `<table>_default`
/// is PostgreSQL's DEFAULT partition. Such a table is maintained as before ([`create_day`],
/// [`look_before_drop`], [`drop_day`]: each drop locks the claims out for a moment) until
/// [`bound_legacy`] converts it.
pub fn is_legacy(t: &TableName, rels: &[Relation]) -> bool {
    rels.iter().any(|r| {
        kind_of(t, &r.name) == Some(PartitionKind::Default) && r.attached && r.bound == "DEFAULT"
    })
}

/// The upper bound of a range partition's bound as `pg_get_expr` prints it
/// (`FOR VALUES FROM ('1') TO ('1764547200000000')`).
fn upper_of(bound: &str) -> Option<i64> {
    let (_, to) = bound.rsplit_once(" TO (")?;
    to.strip_suffix(')')?.trim_matches('\'').parse().ok()
}

/// One step of a bounded [`Round`], in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// One statement on its own, outside any transaction block (`DETACH … CONCURRENTLY`
    /// refuses to run inside one), on the round's session ([`session_start`]).
    Alone(String),
    /// One transaction: `BEGIN`, this simple query (several statements), `COMMIT`; its rows
    /// affected, summed over its statements, are claims moved between partitions.
    Tx(String),
}

/// What opens a bounded round on a connection of its own, as one simple query: the session's
/// [`LOCK_TIMEOUT`] (every wait of the round is bounded; a detach cut short is left pending and
/// finished by the next round, [`Round`]) and the maintenance lock, held by the session since
/// the round's detaches run outside a transaction. [`session_end`] closes it, error or not.
pub fn session_start(t: &TableName) -> String {
    format!(
        "SET lock_timeout = '2s'; {}",
        lock_with(t, "pg_advisory_lock")
    )
}

/// What closes a bounded round's session, error or not: the maintenance lock released and the
/// lock timeout reset, so that the connection goes back to its pool as it came. A store that
/// cannot run it closes the connection (the server then releases the lock).
pub fn session_end(t: &TableName) -> String {
    format!("{}; RESET lock_timeout", lock_with(t, "pg_advisory_unlock"))
}

/// One bounded round of maintenance, decided: the steps a store runs in order on the round's
/// session, and what the report says once they all ran.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// Days whose partitions the steps create.
    pub created: Vec<Day>,
    /// Days whose partitions the steps drop, with the planner's estimate of their claims.
    pub dropped: Vec<(Day, u64)>,
}

impl Round {
    /// Whether the round has nothing to do.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// What one round does to a table in the bounded layout, at `now` (the database's clock), from
/// its [`RELATIONS`]: create the days of `want` that are missing, and when `drop_due`, take the
/// days wholly past the retention out — with no lock a claim waits for.
///
/// The table has no DEFAULT partition: `<table>_default` is a range partition holding every
/// ID older than the first day's partition (`FROM (1) TO (<first day>)`), the undated one
/// holds key 0, and a day partition holds each day from there to [ahead](Partitioning::ahead).
/// An ID of a day with no partition (a producer's clock further ahead than the days created,
/// or a day being moved) cannot be claimed: PostgreSQL refuses the row, and the store reports
/// [`ErrorKind::Unavailable`] (the consumer waits in place; the message is never dropped).
///
/// The steps, each bounded by the session's lock timeout:
/// 1. `DETACH … FINALIZE` of a partition an interrupted round left pending;
/// 2. each missing day at or above the default partition's bound: `CREATE TABLE … (LIKE …)`
///    then `ATTACH PARTITION` (SHARE UPDATE EXCLUSIVE on the parent: claims go on);
/// 3. each day past the retention: `DETACH PARTITION … CONCURRENTLY` (claims go on; it waits
///    for the transactions that could see the day);
/// 4. when the default partition's range must change (days detached, or days created below
///    it for a backfill): it is detached concurrently too, then one transaction moves the
///    detached days' claims younger than the retention into it (an old ID processed late),
///    drops the days, carves backfilled days out of it, and attaches it again with the new
///    bound. Meanwhile only IDs older than the first day (rare: a message older than the
///    retention) find no partition, and wait as above.
///
/// Every state a round can be cut in is one the next round finishes: a partition left
/// pending is finalized, a detached day is merged and dropped, a detached default
/// partition is attached again.
pub fn round(
    t: &TableName,
    rels: &[Relation],
    now: Timestamp,
    p: &Partitioning,
    want: &[Day],
    drop_due: bool,
) -> Result<Round, Error> {
    let cutoff = now
        .as_micros()
        .saturating_sub(crate::micros(p.table_retention().prune_age()));
    let default_name = partition_name(t, DEFAULT);
    let qualified = |name: &str| match t.schema() {
        Some(s) => format!("{s}.{name}"),
        None => name.to_owned(),
    };
    let mut steps = Vec::new();
    // 1. Finish what an interrupted round left pending: afterwards it is detached.
    for r in rels.iter().filter(|r| r.pending) {
        steps.push(Step::Alone(format!(
            "ALTER TABLE {t} DETACH PARTITION {} FINALIZE",
            qualified(&r.name)
        )));
    }
    let default = rels
        .iter()
        .find(|r| kind_of(t, &r.name) == Some(PartitionKind::Default))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "the claims table {t} has no partition {default_name}: run migrate, which \
                     creates it"
                ),
            )
        })?;
    let mut attached = std::collections::BTreeMap::new();
    let mut detached = std::collections::BTreeMap::new();
    for r in rels {
        if let Some(PartitionKind::Day(d)) = kind_of(t, &r.name) {
            let estimate = u64::try_from(r.estimate).unwrap_or(0);
            if r.in_place() {
                attached.insert(d, estimate);
            } else {
                detached.insert(d, estimate);
            }
        }
    }
    let old_upper = if default.in_place() {
        Some(upper_of(&default.bound).ok_or_else(|| {
            Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "the claims table {t}'s partition {default_name} has a bound maintenance \
                     does not read: {:?}",
                    default.bound
                ),
            )
        })?)
    } else {
        None
    };
    let due: Vec<Day> = if drop_due {
        attached
            .keys()
            .copied()
            .filter(|d| p.droppable(*d, now))
            .collect()
    } else {
        Vec::new()
    };
    let remaining: Vec<Day> = attached
        .keys()
        .copied()
        .filter(|d| !due.contains(d))
        .collect();
    let missing: Vec<Day> = want
        .iter()
        .copied()
        .filter(|d| !attached.contains_key(d) && !detached.contains_key(d))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    // Days below the default partition's bound are carved out of it, with every day from
    // there up to the bound (it holds one range). Not in a round that drops days: their
    // claims go into the default partition, below the first day kept.
    let (mut carve, mut above) = (Vec::new(), Vec::new());
    for d in missing {
        match old_upper {
            Some(u) if d.start() < u => {
                if due.is_empty() {
                    carve.push(d);
                }
            }
            _ => above.push(d),
        }
    }
    if let (Some(first), Some(u)) = (carve.first().copied(), old_upper) {
        carve = (first.number()..)
            .map(Day::from_number)
            .take_while(|d| d.start() < u)
            .collect();
    }
    let first_day = remaining.iter().chain(&carve).chain(&above).min().copied();
    let new_upper = match (first_day, old_upper) {
        (Some(d), _) => d.start(),
        (None, Some(u)) => u,
        (None, None) => Day::of(now).start(),
    };
    let (merge, reattach): (Vec<Day>, Vec<Day>) = due
        .iter()
        .copied()
        .chain(detached.keys().copied())
        .partition(|d| d.start() < new_upper);
    // 2. Days created at or above the bound: no claim waits for them.
    for &d in &above {
        steps.push(Step::Tx(create_bounded_day(t, d)));
    }
    // 3. Days past the retention leave without locking the claims out.
    for &d in &due {
        steps.push(Step::Alone(format!(
            "ALTER TABLE {t} DETACH PARTITION {} CONCURRENTLY",
            day_name(t, d)
        )));
    }
    // 4. The default partition's range.
    let reshape = !default.in_place()
        || old_upper != Some(new_upper)
        || !merge.is_empty()
        || !carve.is_empty();
    if reshape {
        if default.in_place() {
            steps.push(Step::Alone(format!(
                "ALTER TABLE {t} DETACH PARTITION {default_name} CONCURRENTLY"
            )));
        }
        steps.push(Step::Tx(reshape_default(
            t, &carve, &merge, new_upper, cutoff,
        )));
    }
    for &d in &reattach {
        steps.push(Step::Tx(format!(
            "{LOCK_TIMEOUT}; ALTER TABLE {t} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})",
            day_name(t, d),
            d.start(),
            d.end()
        )));
    }
    let mut dropped: Vec<(Day, u64)> = merge
        .iter()
        .map(|d| {
            (
                *d,
                attached.get(d).or(detached.get(d)).copied().unwrap_or(0),
            )
        })
        .collect();
    dropped.sort();
    let mut created: Vec<Day> = carve.into_iter().chain(above).collect();
    created.sort();
    Ok(Round {
        steps,
        created,
        dropped,
    })
}

/// Creates `day`'s partition of `t` beside the claims: an empty table first, then attached,
/// which takes SHARE UPDATE EXCLUSIVE on the parent (`CREATE TABLE … PARTITION OF` would
/// take ACCESS EXCLUSIVE and lock the claims out). Attaching builds its indexes.
pub fn create_bounded_day(t: &TableName, day: Day) -> String {
    let part = day_name(t, day);
    format!(
        "{LOCK_TIMEOUT}; CREATE TABLE {part} (LIKE {t} INCLUDING DEFAULTS); \
         ALTER TABLE {t} ATTACH PARTITION {part} FOR VALUES FROM ({}) TO ({})",
        day.start(),
        day.end()
    )
}

/// The transaction that gives the detached default partition of `t` its new range
/// `[1, upper)`: the detach's own CHECK constraint off; each `carve` day created and filled
/// with its claims out of it; each detached `merge` day's claims processed at `cutoff` or
/// later (younger than the retention) moved into it and the day dropped; then attached again.
/// Its rows affected, summed, are the claims moved.
pub fn reshape_default(
    t: &TableName,
    carve: &[Day],
    merge: &[Day],
    upper: i64,
    cutoff: i64,
) -> String {
    let default = partition_name(t, DEFAULT);
    let mut sql = format!(
        "{LOCK_TIMEOUT}; \
         DO $idem$ DECLARE c name; BEGIN FOR c IN SELECT conname FROM pg_constraint \
         WHERE conrelid = '{default}'::regclass AND contype = 'c' LOOP \
         EXECUTE format('ALTER TABLE {default} DROP CONSTRAINT %I', c); END LOOP; END $idem$"
    );
    for &d in carve {
        let part = day_name(t, d);
        let (start, end) = (d.start(), d.end());
        sql.push_str(&format!(
            "; CREATE TABLE {part} (LIKE {t} INCLUDING DEFAULTS); \
             WITH m AS (DELETE FROM {default} WHERE id_time >= {start} AND id_time < {end} \
             RETURNING *) INSERT INTO {part} SELECT * FROM m; \
             ALTER TABLE {t} ATTACH PARTITION {part} FOR VALUES FROM ({start}) TO ({end})"
        ));
    }
    for &d in merge {
        let part = day_name(t, d);
        sql.push_str(&format!(
            "; INSERT INTO {default} SELECT * FROM {part} WHERE processed_at >= {cutoff}; \
             DROP TABLE {part}"
        ));
    }
    sql.push_str(&format!(
        "; ALTER TABLE {t} ATTACH PARTITION {default} FOR VALUES FROM (1) TO ({upper})"
    ));
    sql
}

/// Converts a table made before the bounded layout ([`is_legacy`]) in one transaction: the
/// DEFAULT partition detached, a day partition created for each day its claims need above
/// `upper` (the first day partition's start: a producer's clock that was ahead), its claims
/// below that kept in it, and it attached again as the range `[1, upper)`. It holds ACCESS
/// EXCLUSIVE on the claims table while it moves the default partition's claims above `upper`
/// — usually none — so run it once, when a pause of the consumers is acceptable (`migrate`
/// does not; see the README). `days` are the days of those claims, read first with
/// [`legacy_days_above`].
pub fn bound_legacy(t: &TableName, days: &[Day], upper: i64) -> String {
    let default = partition_name(t, DEFAULT);
    let mut sql = format!(
        "{LOCK_TIMEOUT}; LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
         ALTER TABLE {t} DETACH PARTITION {default}; \
         CREATE TEMP TABLE idem_moving ON COMMIT DROP AS \
         SELECT * FROM {default} WHERE id_time >= {upper}; \
         DELETE FROM {default} WHERE id_time >= {upper}"
    );
    for &d in days {
        sql.push_str(&format!(
            "; CREATE TABLE {} PARTITION OF {t} FOR VALUES FROM ({}) TO ({})",
            day_name(t, d),
            d.start(),
            d.end()
        ));
    }
    sql.push_str(&format!(
        "; ALTER TABLE {t} ATTACH PARTITION {default} FOR VALUES FROM (1) TO ({upper}); \
         INSERT INTO {t} SELECT * FROM idem_moving"
    ));
    sql
}

/// The days (numbers since the epoch) of the claims `t`'s legacy DEFAULT partition holds at
/// or above `upper` (microseconds), for [`bound_legacy`]: days with no partition of their own
/// (a claim of a day with one is in it).
pub fn legacy_days_above(t: &TableName, upper: i64) -> String {
    format!(
        "SELECT DISTINCT div(id_time, 86400000000)::bigint FROM {} WHERE id_time >= {upper} \
         ORDER BY 1",
        partition_name(t, DEFAULT)
    )
}

/// The first day partition's start of `t` (its [`RELATIONS`]), the bound [`bound_legacy`]
/// gives the default partition; `None` without a day partition.
pub fn first_day_start(t: &TableName, rels: &[Relation]) -> Option<i64> {
    rels.iter()
        .filter(|r| r.in_place())
        .filter_map(|r| match kind_of(t, &r.name) {
            Some(PartitionKind::Day(d)) => Some(d.start()),
            _ => None,
        })
        .min()
}

/// The maintenance lock of `t` taken or released by `function` (an advisory lock function).
fn lock_with(t: &TableName, function: &str) -> String {
    format!(
        "SELECT {function}(hashtext('idem-partitions:' || COALESCE(\
         (SELECT n.nspname || '.' || c.relname FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('{t}')), \
         '{t}')))"
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::Retention;

    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn table(name: &str) -> TableName {
        TableName::new(name).expect("table")
    }

    fn partitioning() -> Partitioning {
        Partitioning::uuid_v7().retention(Retention::new(7 * DAY, 7 * DAY).expect("retention"))
    }

    /// 2025-12-01 at 01:00 UTC.
    fn now() -> Timestamp {
        Timestamp::from_micros(Day::from_number(20_423).start() + 3_600_000_000)
    }

    #[test]
    fn names_round_trip_through_kinds() {
        let t = table("app.claims");
        let day = Day::from_number(20_423);
        assert_eq!(day_name(&t, day), "app.claims_p20251201");
        assert_eq!(partition_name(&t, DEFAULT), "app.claims_default");
        assert_eq!(
            kind_of(&t, "claims_p20251201"),
            Some(PartitionKind::Day(day))
        );
        assert_eq!(kind_of(&t, "claims_default"), Some(PartitionKind::Default));
        assert_eq!(kind_of(&t, "claims_undated"), Some(PartitionKind::Undated));
        for other in [
            "claims_p2025120",
            "claims_x",
            "claimsp20251201",
            "other_default",
        ] {
            assert_eq!(kind_of(&t, other), None, "{other}");
        }
        let days = days_of(
            &t,
            ["claims_p20251202", "claims_default", "claims_p20251201"],
        );
        assert_eq!(days, vec![day, day.next()]);
    }

    #[test]
    fn a_fresh_table_plans_today_and_the_days_ahead_and_drops_nothing() {
        let plan = plan(&[], now(), &partitioning());
        let created: Vec<i64> = plan.create.iter().map(|d| d.number()).collect();
        assert_eq!(created, vec![20_423, 20_424, 20_425]);
        assert!(plan.drop.is_empty());
    }

    #[test]
    fn existing_days_are_not_created_again_and_whole_days_past_retention_are_dropped() {
        let p = partitioning();
        let days = |range: std::ops::RangeInclusive<i64>| -> Vec<Day> {
            range.map(Day::from_number).collect()
        };
        // Twenty days back to one ahead exist.
        let existing = days(20_403..=20_424);
        let plan = plan(&existing, now(), &p);
        assert_eq!(plan.create, days(20_425..=20_425));
        // Retention 7 d + 1 h clock margin before 01:00 on day 20 423 is 00:00 on day 20 416:
        // every day before it has wholly passed; day 20 416 itself is kept.
        assert_eq!(plan.drop, days(20_403..=20_415));
        assert_eq!(plan.cutoff, Day::from_number(20_416).start());
        for d in &plan.drop {
            assert!(p.droppable(*d, now()), "{d}");
        }
        assert!(!p.droppable(Day::from_number(20_416), now()));
    }

    #[test]
    fn scripts_lock_the_parent_before_the_partition() {
        let t = table("claims");
        let day = Day::from_number(20_423);
        let create = create_day(&t, day);
        let parent = create
            .find("LOCK TABLE ONLY claims IN ACCESS EXCLUSIVE")
            .expect("parent");
        let default = create.find("LOCK TABLE claims_default").expect("default");
        assert!(parent < default, "{create}");
        assert!(create.contains(&format!("FROM ({}) TO ({})", day.start(), day.end())));
        let look = look_before_drop(&t, day, 42);
        assert!(look.ends_with("WHERE processed_at >= 42"), "{look}");
        assert_eq!(drop_day(&t, day, 0), "DROP TABLE claims_p20251201");
        assert!(drop_day(&t, day, 3).starts_with("ALTER TABLE claims DETACH PARTITION"));
        assert!(maintenance_lock(&t).starts_with(LOCK_TIMEOUT));
    }

    fn rel(name: &str, bound: &str) -> Relation {
        Relation::new(name.into(), true, false, bound.into(), 100)
    }

    fn bounded(days: std::ops::RangeInclusive<i64>, upper: i64) -> Vec<Relation> {
        let mut rels = vec![
            rel(
                "claims_default",
                &format!("FOR VALUES FROM ('1') TO ('{upper}')"),
            ),
            rel("claims_undated", "FOR VALUES FROM (MINVALUE) TO ('1')"),
        ];
        for n in days {
            let d = Day::from_number(n);
            rels.push(rel(
                &format!("claims_p{}", d.suffix()),
                &format!("FOR VALUES FROM ('{}') TO ('{}')", d.start(), d.end()),
            ));
        }
        rels
    }

    #[test]
    fn a_bounded_round_detaches_due_days_concurrently_and_rebounds_the_default() {
        let (t, p) = (table("claims"), partitioning());
        let rels = bounded(20_403..=20_425, Day::from_number(20_403).start());
        assert!(!is_legacy(&t, &rels));
        let want: Vec<Day> = p.days_to_create(now()).collect();
        let r = round(&t, &rels, now(), &p, &want, true).expect("round");
        assert!(r.created.is_empty());
        let dropped: Vec<i64> = r.dropped.iter().map(|(d, _)| d.number()).collect();
        assert_eq!(dropped, (20_403..=20_415).collect::<Vec<_>>());
        // One concurrent detach per day, then the default partition's, then one transaction.
        let alone = |s: &Step| matches!(s, Step::Alone(sql) if sql.ends_with("CONCURRENTLY"));
        assert_eq!(r.steps.iter().filter(|s| alone(s)).count(), 14);
        let Some(Step::Tx(last)) = r.steps.last() else {
            panic!("{:?}", r.steps)
        };
        let upper = Day::from_number(20_416).start();
        assert!(
            last.ends_with(&format!("claims_default FOR VALUES FROM (1) TO ({upper})")),
            "{last}"
        );
        let first = Day::from_number(20_403).suffix();
        assert!(last.contains(&format!(
            "INSERT INTO claims_default SELECT * FROM claims_p{first}"
        )));
        assert!(!last.contains("ACCESS EXCLUSIVE"), "{last}");
        // Nothing to do the next time.
        let after = bounded(20_416..=20_425, upper);
        assert!(
            round(&t, &after, now(), &p, &want, true)
                .expect("round")
                .is_empty()
        );
    }

    #[test]
    fn a_bounded_round_finishes_what_an_interrupted_one_left() {
        let (t, p) = (table("claims"), partitioning());
        let upper = Day::from_number(20_416).start();
        let mut rels = bounded(20_415..=20_425, Day::from_number(20_415).start());
        let half = format!("claims_p{}", Day::from_number(20_415).suffix());
        rels.iter_mut()
            .find(|r| r.name == half)
            .map(|r| r.pending = true)
            .expect("day");
        let r = round(&t, &rels, now(), &p, &[], true).expect("round");
        assert_eq!(
            r.steps[0],
            Step::Alone(format!(
                "ALTER TABLE claims DETACH PARTITION {half} FINALIZE"
            ))
        );
        assert_eq!(r.dropped.len(), 1, "{r:?}");
        // The default partition left detached: attached again, nothing else.
        let mut rels = bounded(20_416..=20_425, upper);
        rels[0].attached = false;
        rels[0].bound.clear();
        let r = round(&t, &rels, now(), &p, &[], true).expect("round");
        assert_eq!(r.steps.len(), 1, "{r:?}");
        assert!(matches!(&r.steps[0], Step::Tx(sql) if sql.ends_with(&format!("TO ({upper})"))));
    }

    #[test]
    fn a_backfill_carves_every_day_up_to_the_default_partitions_bound() {
        let (t, p) = (table("claims"), partitioning());
        let upper = Day::from_number(20_423).start();
        let rels = bounded(20_423..=20_425, upper);
        let r = round(&t, &rels, now(), &p, &[Day::from_number(20_420)], false).expect("round");
        let created: Vec<i64> = r.created.iter().map(|d| d.number()).collect();
        assert_eq!(created, vec![20_420, 20_421, 20_422]);
        let Some(Step::Tx(sql)) = r.steps.last() else {
            panic!("{:?}", r.steps)
        };
        assert!(
            sql.contains("DELETE FROM claims_default WHERE id_time >= "),
            "{sql}"
        );
        let new_upper = Day::from_number(20_420).start();
        assert!(sql.ends_with(&format!("TO ({new_upper})")), "{sql}");
        // A day ahead of the days created needs no carving: created beside the claims.
        let r = round(&t, &rels, now(), &p, &[Day::from_number(20_440)], false).expect("round");
        assert_eq!(r.steps.len(), 1);
        assert!(matches!(&r.steps[0], Step::Tx(sql) if sql.contains("ATTACH PARTITION claims_p")));
    }

    #[test]
    fn a_legacy_table_is_told_by_its_default_partition() {
        let t = table("claims");
        let mut rels = bounded(20_423..=20_425, 1);
        rels[0].bound = "DEFAULT".into();
        assert!(is_legacy(&t, &rels));
        assert_eq!(
            first_day_start(&t, &rels),
            Some(Day::from_number(20_423).start())
        );
        let sql = bound_legacy(&t, &[Day::from_number(20_440)], 7);
        assert!(sql.contains("DETACH PARTITION claims_default;"), "{sql}");
        assert!(sql.contains("ATTACH PARTITION claims_default FOR VALUES FROM (1) TO (7)"));
    }

    #[test]
    fn shapes_are_checked_against_the_store() {
        let (t, p) = (table("claims"), partitioning());
        let record = format!("idem claims. {}", p.record());
        assert!(shape_fits(&t, None, Some(&p)).is_ok());
        assert!(shape_fits(&t, Some(("r", None)), None).is_ok());
        assert!(shape_fits(&t, Some(("p", Some(&record))), Some(&p)).is_ok());
        for (shape, partitioning) in [
            (Some(("r", None)), Some(&p)),
            (Some(("p", Some(record.as_str()))), None),
        ] {
            let err = shape_fits(&t, shape, partitioning).expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::Misconfigured);
        }
        let ulid = Partitioning::ulid();
        let err = shape_fits(&t, Some(("p", Some(&record))), Some(&ulid)).expect_err("extractor");
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
        assert!(refuse_unpartitioned_prune(&t, Some(("r", None))).is_ok());
        let err = refuse_unpartitioned_prune(&t, Some(("p", Some(&record)))).expect_err("p");
        assert!(err.to_string().contains("idem prune"), "{err}");
        assert_eq!(
            recorded(&t, Some(("p", Some(&record)))).ok(),
            Some(Some(p.record()))
        );
        assert_eq!(recorded(&t, Some(("r", Some(&record)))).ok(), Some(None));
    }
}
