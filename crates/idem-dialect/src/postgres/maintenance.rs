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
//! Three rules keep maintenance safe beside running consumers. It locks the parent table
//! before a partition, in the mode its DDL needs, as a claim locks the parent before the
//! partition its key routes to (the other order deadlocks with such a claim). Its waits are
//! bounded ([`LOCK_TIMEOUT`], the advisory lock included): a busy round fails and the next one
//! tries again, and `migrate` goes on without it. And the table records how it is partitioned
//! ([`PartitionRecord`], in its comment): a store reading IDs with another extractor is
//! refused, and a store not configured partitioned never prunes the table.
//!
//! One round, as a store runs it: read [`READ_CLOCK`](super::READ_CLOCK) and [`DAYS`] (the table's comment,
//! checked with [`check_record`], and its partitions' names, read with [`days_of`]); [`plan`]
//! the round; then for each day to create, in a transaction opened with
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
    format!(
        "SELECT pg_advisory_xact_lock(hashtext('idem-partitions:' || COALESCE(\
         (SELECT n.nspname || '.' || c.relname FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('{t}')), \
         '{t}')))"
    )
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
/// lock). The comment ends with `p`'s [`PartitionRecord`].
pub fn create_statements(t: &TableName, p: &Partitioning) -> Vec<String> {
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
        format!("CREATE TABLE IF NOT EXISTS {default} PARTITION OF {t} DEFAULT"),
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
