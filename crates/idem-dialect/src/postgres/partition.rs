//! Claims partitioned by the time inside the message ID itself (PostgreSQL stores, opt-in).
//!
//! Deleting old claims row by row from a table of billions bloats it and competes with the
//! consumer; dropping a whole partition costs nothing. But a partitioned table's unique
//! constraint must contain the partition key, so partitioning by `processed_at` would let a
//! redelivery, processed on another day, land in another partition and be processed again.
//! Partitioning by a time *derived from the message ID* does not: UUIDv7 and ULID IDs carry the
//! producer's timestamp, every redelivery of one ID carries the same one, and so every
//! redelivery is routed to the partition holding the first claim. The key is the ID's own, so
//! the rule never depends on when a message is processed.
//!
//! What this module owns (no database here): reading the time out of an ID ([`IdTime`],
//! [`uuid_v7`], [`ulid`], your own under a name), the partition key a claim carries
//! ([`Partitioning::key_of`]), the daily ranges a store creates and drops ([`Day`]), and what a
//! table records about its partitioning ([`PartitionRecord`]: the extractor's name, so a store
//! reading IDs otherwise is refused; the retention, so `idem prune` can maintain the table).
//! The DDL, the catalog reads and the maintenance plan are [`super::maintenance`]'s; both
//! PostgreSQL stores execute them with their own driver:
//!
//! * one range partition per UTC day of ID time, created [`ahead`](Partitioning::ahead) of
//!   the database's clock; an ID older than the first day's partition goes to the table's
//!   **default** partition — in the bounded layout (every table `migrate` creates) a range
//!   partition `[1, first day)`, not PostgreSQL's DEFAULT one, so that days can leave by
//!   `DETACH … CONCURRENTLY` without locking the claims out (`maintenance::round`); an ID of
//!   a day with no partition (a producer's clock further ahead than the days created) is
//!   refused by PostgreSQL and reported [`ErrorKind::Unavailable`]: it waits, it is never
//!   dropped. (A table made before the bounded layout keeps PostgreSQL's DEFAULT partition
//!   for every ID outside the days, moved into its day's partition when that is created.)
//! * IDs whose time cannot be read (not a UUIDv7 or ULID) get key [`UNDATED`] and live in the
//!   **undated** partition;
//! * retention takes a day's partition out once its whole day is older than the retention; a
//!   claim in it younger than the retention (an old ID processed late) is first moved to the
//!   default partition. The default and undated partitions are pruned row by row.
//!
//! So nothing is ever deduplicated wrongly: a claim is dropped only when it is older than the
//! retention, and the key that finds it is the ID's.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Error, ErrorKind, MessageId, Retention, Timestamp};

/// The partition key of a claim whose ID carries no readable time.
pub const UNDATED: i64 = 0;

const DAY_MICROS: i64 = 86_400 * 1_000_000;

/// Reads the producer's timestamp out of a message ID; `None` when the ID carries none.
/// Must be deterministic: the same ID always yields the same time.
pub trait IdTime: Send + Sync + 'static {
    /// The time the ID was made, if it says.
    fn id_time(&self, id: &MessageId) -> Option<Timestamp>;
}

impl<F> IdTime for F
where
    F: Fn(&MessageId) -> Option<Timestamp> + Send + Sync + 'static,
{
    fn id_time(&self, id: &MessageId) -> Option<Timestamp> {
        self(id)
    }
}

/// UUIDv7 (RFC 9562) in its canonical text form (`0190f3c4-7b2e-7c8a-9f1e-…`, either case) or
/// as its 16 raw bytes: the first 48 bits are Unix milliseconds. Any other UUID version, or
/// anything that is not a UUID, has no time.
pub fn uuid_v7(id: &MessageId) -> Option<Timestamp> {
    let raw: [u8; 16] = match id.as_bytes() {
        b if b.len() == 16 => b.try_into().ok()?,
        b if b.len() == 36 => parse_uuid_text(b)?,
        _ => return None,
    };
    if raw[6] >> 4 != 7 || raw[8] >> 6 != 0b10 {
        return None; // not version 7, or not the RFC variant
    }
    let mut ms = [0u8; 8];
    ms[2..].copy_from_slice(&raw[..6]);
    millis(u64::from_be_bytes(ms))
}

fn parse_uuid_text(text: &[u8]) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let mut nibbles = 0;
    for (i, &c) in text.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let v = (c as char).to_digit(16)? as u8;
        out[nibbles / 2] |= if nibbles % 2 == 0 { v << 4 } else { v };
        nibbles += 1;
    }
    Some(out)
}

/// ULID (26 characters of Crockford base32, either case): the first 10 characters are 48 bits
/// of Unix milliseconds. Anything else has no time.
pub fn ulid(id: &MessageId) -> Option<Timestamp> {
    let text = id.as_bytes();
    if text.len() != 26 {
        return None;
    }
    let mut value: u128 = 0;
    for &c in text {
        value = (value << 5) | u128::from(crockford(c)?);
    }
    // 26 × 5 = 130 bits for 128: the first character may only be 0–7.
    if crockford(text[0])? > 7 {
        return None;
    }
    millis(u64::try_from(value >> 80).ok()?)
}

fn crockford(c: u8) -> Option<u8> {
    let c = c.to_ascii_uppercase();
    Some(match c {
        b'0'..=b'9' => c - b'0',
        b'A'..=b'H' => c - b'A' + 10,
        b'J' | b'K' => c - b'J' + 18,
        b'M' | b'N' => c - b'M' + 20,
        b'P'..=b'T' => c - b'P' + 22,
        b'V'..=b'Z' => c - b'V' + 27,
        _ => return None,
    })
}

/// A 48-bit millisecond clock reading as a timestamp; zero (and below) counts as no time, so
/// that a real ID can never take the [`UNDATED`] key.
fn millis(ms: u64) -> Option<Timestamp> {
    let micros = i64::try_from(ms).ok()?.checked_mul(1000)?;
    (micros >= DAY_MICROS).then(|| Timestamp::from_micros(micros))
}

/// One UTC day of ID time: the range of one partition, `[start, end)` in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Day(i64);

impl Day {
    /// The day `t` falls in.
    pub fn of(t: Timestamp) -> Self {
        Self(t.as_micros().div_euclid(DAY_MICROS))
    }

    /// Days since the Unix epoch.
    pub fn number(self) -> i64 {
        self.0
    }

    /// The day from a days-since-epoch number.
    pub fn from_number(n: i64) -> Self {
        Self(n)
    }

    /// The day after.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// First microsecond of the day.
    pub fn start(self) -> i64 {
        self.0 * DAY_MICROS
    }

    /// First microsecond of the next day.
    pub fn end(self) -> i64 {
        (self.0 + 1) * DAY_MICROS
    }

    /// `YYYYMMDD`, the suffix of the partition's name.
    pub fn suffix(self) -> String {
        let (y, m, d) = civil(self.0);
        format!("{y:04}{m:02}{d:02}")
    }

    /// Reads a suffix back (`None` if it is not one [`Day::suffix`] makes).
    pub fn parse_suffix(s: &str) -> Option<Self> {
        if s.len() != 8 || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (y, m, d) = (
            s[..4].parse().ok()?,
            s[4..6].parse().ok()?,
            s[6..].parse().ok()?,
        );
        let day = Self(days_from_civil(y, m, d));
        (day.suffix() == s).then_some(day)
    }
}

impl fmt::Display for Day {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (y, m, d) = civil(self.0);
        write!(f, "{y:04}-{m:02}-{d:02}")
    }
}

// Proleptic Gregorian calendar conversions (days since 1970-01-01), the well-known
// era-of-400-years arithmetic.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// How a PostgreSQL store partitions its claims table: the ID's time, read by an
/// [`IdTime`] known by a name; daily partitions created [`ahead`](Self::ahead) of the
/// database's clock; and the table's [`Retention`], which decides when a day's partition is
/// dropped.
///
/// The retention is the table's, not one consumer's: every consumer sharing the table must be
/// content with it (give the longest any of them needs). The extractor is the table's too:
/// `migrate` records its name with the table ([`PartitionRecord`]), and a store configured with
/// another is refused, since the same ID would be looked for in another partition.
#[derive(Clone)]
pub struct Partitioning {
    extractor: Arc<str>,
    /// `None` for a partitioning read back from a table's record with a custom extractor's
    /// name: it maintains the table, but cannot compute a claim's key.
    id_time: Option<Arc<dyn IdTime>>,
    ahead: Duration,
    retention: Retention,
}

impl fmt::Debug for Partitioning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Partitioning")
            .field("extractor", &self.extractor)
            .field("ahead", &self.ahead)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// The name [`Partitioning::uuid_v7`] records.
pub const UUID_V7: &str = "uuid_v7";

/// The name [`Partitioning::ulid`] records.
pub const ULID: &str = "ulid";

impl Partitioning {
    /// Partitions by the time [`uuid_v7`] reads (the common case); recorded as [`UUID_V7`].
    pub fn uuid_v7() -> Self {
        Self::named(UUID_V7, Some(Arc::new(uuid_v7)))
    }

    /// Partitions by the time [`ulid`] reads; recorded as [`ULID`].
    pub fn ulid() -> Self {
        Self::named(ULID, Some(Arc::new(ulid)))
    }

    /// Partitions by the time `id_time` reads, recorded with the table as `name`: a
    /// UUIDv7-or-ULID mix is `Partitioning::by("uuid_v7-or-ulid", |id| uuid_v7(id).or_else(||
    /// ulid(id)))`. The name stands for what the extractor computes: keep it while it reads
    /// every ID as before, and change it (with a new table) when it would not — a store whose
    /// name differs from the table's record is refused. 1 to 64 ASCII letters, digits, `_`,
    /// `-` or `.`; the built-in names ([`UUID_V7`], [`ULID`]) are reserved for the built-ins.
    pub fn by(name: &str, id_time: impl IdTime) -> Result<Self, Error> {
        check_extractor_name(name)?;
        if name == UUID_V7 || name == ULID {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "extractor name {name:?} is the built-in one's: use Partitioning::{name}(), \
                     or name your own extractor otherwise"
                ),
            ));
        }
        Ok(Self::named(name, Some(Arc::new(id_time))))
    }

    fn named(name: &str, id_time: Option<Arc<dyn IdTime>>) -> Self {
        Self {
            extractor: name.into(),
            id_time,
            ahead: Duration::from_secs(2 * 86_400),
            retention: Retention::default(),
        }
    }

    /// The extractor's name, as the table records it.
    pub fn extractor(&self) -> &str {
        &self.extractor
    }

    /// How far ahead of the database's clock partitions exist (default two days): the skew a
    /// producer's clock may have before its IDs find no partition (claims of them are
    /// [`ErrorKind::Unavailable`] until their day is created; on a legacy table they land in
    /// the DEFAULT partition). At least one day.
    pub fn ahead(mut self, ahead: Duration) -> Self {
        self.ahead = ahead.max(Duration::from_secs(86_400));
        self
    }

    /// The table's retention (default [`Retention::default`]: seven days against a seven-day
    /// redelivery window).
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// How far ahead of the database's clock partitions are created.
    pub fn created_ahead(&self) -> Duration {
        self.ahead
    }

    /// The configured retention.
    pub fn table_retention(&self) -> Retention {
        self.retention
    }

    /// How long the table keeps every claim at least: the retention's
    /// [prune age](Retention::prune_age). A day's partition is dropped once the whole day is
    /// older than this, and a claim in it processed later than that is moved out first.
    pub fn kept_for(&self) -> Duration {
        self.retention.prune_age()
    }

    /// The partition key of a claim on `id`: its time in microseconds, or [`UNDATED`].
    /// [`ErrorKind::Misconfigured`] from a partitioning read back from a table's record
    /// ([`PartitionRecord::partitioning`]) whose extractor is not a built-in one: its code is
    /// the application's, so such a partitioning maintains the table but claims nothing.
    pub fn key_of(&self, id: &MessageId) -> Result<i64, Error> {
        let id_time = self.id_time.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "this store's partitioning was read from the claims table's record, which \
                     names the extractor {:?} but cannot carry its code: it maintains the table \
                     but cannot claim; configure .partitioned(Partitioning::by({:?}, \
                     <the extractor>)) to claim",
                    self.extractor, self.extractor
                ),
            )
        })?;
        Ok(id_time.id_time(id).map_or(UNDATED, Timestamp::as_micros))
    }

    /// What `migrate` records with the table.
    pub fn record(&self) -> PartitionRecord {
        PartitionRecord {
            extractor: self.extractor.to_string(),
            kept_for: self.kept_for(),
            ahead: self.ahead,
        }
    }

    /// The days whose partitions should exist at `now`: today through `ahead`.
    pub fn days_to_create(&self, now: Timestamp) -> impl Iterator<Item = Day> {
        let first = Day::of(now);
        let last = Day::of(now.saturating_add(self.ahead));
        (first.number()..=last.number()).map(Day::from_number)
    }

    /// Whether `day`'s partition may be dropped at `now`: its whole range is older than the
    /// retention's prune age (younger claims in it are moved out first).
    pub fn droppable(&self, day: Day, now: Timestamp) -> bool {
        day.end() <= now.saturating_sub(self.retention.prune_age()).as_micros()
    }
}

/// Where a record starts in a partitioned table's comment.
const RECORD_TAG: &str = "idem-partitioning:";

/// What a partitioned claims table records about how it is partitioned, at the end of its
/// comment (`COMMENT ON TABLE`, rewritten by every `migrate`):
/// `idem-partitioning: extractor=uuid_v7 kept-for=7d1h ahead=2d`.
///
/// The extractor's name lets a store refuse a table made with another extractor, where it
/// would look for an ID's claim in another partition than the one holding it (a rolling deploy
/// that changed it). The retention and the days ahead let a tool that did not create the table
/// (`idem prune`) maintain it as its own consumers do. The comment travels with the table
/// (renames, dumps) and is written in the same transaction as the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionRecord {
    /// The extractor's name ([`Partitioning::extractor`]).
    pub extractor: String,
    /// How long every claim is kept ([`Partitioning::kept_for`]).
    pub kept_for: Duration,
    /// How far ahead partitions are created ([`Partitioning::created_ahead`]).
    pub ahead: Duration,
}

impl PartitionRecord {
    /// Reads the record at the end of `table`'s `comment`: `None` when there is none (a table
    /// made before tables recorded their partitioning); [`ErrorKind::Misconfigured`] when one
    /// is there but unreadable (edited by hand).
    pub fn from_comment(table: impl fmt::Display, comment: &str) -> Result<Option<Self>, Error> {
        let Some(at) = comment.find(RECORD_TAG) else {
            return Ok(None);
        };
        let text = &comment[at..];
        let unreadable = |why: &str| {
            Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "the claims table {table} records its partitioning unreadably ({why}): \
                     {text:?}; migrate it with its store to write the record again"
                ),
            )
        };
        let (mut extractor, mut kept_for, mut ahead) = (None, None, None);
        for field in text[RECORD_TAG.len()..].split_whitespace() {
            let Some((key, value)) = field.split_once('=') else {
                return Err(unreadable("a field without ="));
            };
            let duration =
                || idem_core::parse_duration(value).map_err(|e| unreadable(&e.to_string()));
            match key {
                "extractor" => {
                    check_extractor_name(value).map_err(|e| unreadable(&e.to_string()))?;
                    extractor = Some(value.to_owned());
                }
                "kept-for" => kept_for = Some(duration()?),
                "ahead" => ahead = Some(duration()?),
                _ => {} // a field of a later version
            }
        }
        match (extractor, kept_for, ahead) {
            (Some(extractor), Some(kept_for), Some(ahead)) => Ok(Some(Self {
                extractor,
                kept_for,
                ahead,
            })),
            _ => Err(unreadable("extractor, kept-for and ahead are all needed")),
        }
    }

    /// Refuses `configured` for `table` when it reads IDs' times with another extractor than
    /// the table was created with: a claim made under the recorded one would be looked for in
    /// another partition, and its message processed twice.
    pub fn check(&self, table: impl fmt::Display, configured: &Partitioning) -> Result<(), Error> {
        if configured.extractor() == self.extractor {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Misconfigured,
            format!(
                "the claims table {table} is partitioned by IDs' time as extractor {:?} reads \
                 it, and this store reads it with {:?}: claims made before would be looked for \
                 in other partitions and their messages processed twice; configure the \
                 extractor the table records, or migrate a new table for the new one",
                self.extractor,
                configured.extractor()
            ),
        ))
    }

    /// The refusal of a store not configured partitioned asked to prune `table`, which is
    /// partitioned and carries `comment`: pruning it means dropping whole days past the table's
    /// retention, which such a store does not know. Says what to do: configure the store as the
    /// table records, or record it first. One message for every PostgreSQL store.
    pub fn refuse_unpartitioned_prune(table: impl fmt::Display, comment: Option<&str>) -> Error {
        let how = match Self::from_comment(&table, comment.unwrap_or("")) {
            Ok(Some(r)) => format!(
                "configure the store with .partitioned(..) as the table records ({r}), or run \
                 `idem prune`, which reads that record"
            ),
            _ => "configure the store with .partitioned(..) as the table was created, and \
                  migrate it once so that the table records its partitioning for `idem prune`"
                .to_owned(),
        };
        Error::new(
            ErrorKind::Misconfigured,
            format!(
                "the claims table {table} is partitioned by the ID's time, but this store is \
                 not configured for it: pruning it means dropping whole days past the table's \
                 retention, not deleting rows; {how}"
            ),
        )
    }

    /// The partitioning the record describes, for a tool that maintains the table it did not
    /// create: the built-in extractors by name; for any other name one that maintains the table
    /// (creates days ahead, drops them past the recorded retention) but claims nothing (its
    /// [`key_of`](Partitioning::key_of) refuses, the extractor's code being the application's).
    pub fn partitioning(&self) -> Partitioning {
        let id_time: Option<Arc<dyn IdTime>> = match self.extractor.as_str() {
            UUID_V7 => Some(Arc::new(uuid_v7)),
            ULID => Some(Arc::new(ulid)),
            _ => None,
        };
        // prune_age() of (kept_for, no window, no margin) is kept_for itself.
        let retention = Retention::new(self.kept_for, Duration::ZERO)
            .map(|r| r.with_clock_margin(Duration::ZERO))
            .unwrap_or_default();
        Partitioning::named(&self.extractor, id_time)
            .ahead(self.ahead)
            .retention(retention)
    }
}

impl fmt::Display for PartitionRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{RECORD_TAG} extractor={} kept-for={} ahead={}",
            self.extractor,
            idem_core::format_duration(self.kept_for),
            idem_core::format_duration(self.ahead)
        )
    }
}

/// An extractor's name: it is written into SQL text (the table's comment), so only a few
/// plain characters.
fn check_extractor_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!("invalid extractor name {name:?}: 1 to 64 ASCII letters, digits, _, - or ."),
    ))
}

/// What one round of partition maintenance did (`maintain_partitions` on a PostgreSQL store).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionReport {
    /// Days whose partitions were created (claims of theirs waiting in the default partition
    /// moved in).
    pub created: Vec<Day>,
    /// Days whose partitions were dropped, with the claims they held by the planner's
    /// estimate (`pg_class.reltuples`; counting them exactly would read them all).
    pub dropped: Vec<(Day, u64)>,
    /// Claims moved between partitions: out of the default partition into a new day's, and
    /// out of a dropped day's (younger than the retention) into the default one.
    pub moved: u64,
}

/// Which part of a partitioned claims table a partition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartitionKind {
    /// One UTC day of ID time; dropped whole past the retention.
    Day(Day),
    /// IDs older than every day's partition (bounded layout: the range `[1, first day)`; a
    /// legacy table's DEFAULT partition: every ID outside the days); pruned row by row.
    Default,
    /// IDs with no readable time; pruned row by row.
    Undated,
}

/// One partition, as `idem stats` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionInfo {
    /// The partition table's name.
    pub name: String,
    /// What it holds.
    pub kind: PartitionKind,
    /// Claims in it, by the planner's estimate (`pg_class.reltuples`, `-1` read as 0).
    pub claims_estimate: u64,
    /// Its size on disk, indexes included.
    pub bytes: u64,
}

impl PartitionInfo {
    /// A partition row as a store reads it from the catalog.
    pub fn new(name: String, kind: PartitionKind, claims_estimate: u64, bytes: u64) -> Self {
        Self {
            name,
            kind,
            claims_estimate,
            bytes,
        }
    }
}

/// Refuses a partitioning a table cannot take: for PostgreSQL, the derived partition names
/// (`<table>_pYYYYMMDD`, `<table>_default`, `<table>_undated`) must fit its 63-byte limit.
pub fn check_table_name(table: &str) -> Result<(), Error> {
    if table.len() + "_pYYYYMMDD".len() > 63 {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("table name {table:?} is too long to partition: at most 53 bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> MessageId {
        MessageId::new(s).expect("id")
    }

    #[test]
    fn uuid_v7_text_and_bytes_carry_their_milliseconds() {
        // 0x0190f3c47b2e ms since the epoch
        let t = uuid_v7(&id("0190f3c4-7b2e-7c8a-9f1e-0123456789ab")).expect("v7");
        assert_eq!(t.as_micros(), 0x0190_f3c4_7b2e * 1000);
        assert_eq!(Day::of(t).to_string(), "2024-07-27");
        let upper = uuid_v7(&id("0190F3C4-7B2E-7C8A-9F1E-0123456789AB")).expect("v7");
        assert_eq!(upper, t);
        let raw: Vec<u8> = vec![
            0x01, 0x90, 0xf3, 0xc4, 0x7b, 0x2e, 0x7c, 0x8a, 0x9f, 0x1e, 1, 2, 3, 4, 5, 6,
        ];
        assert_eq!(uuid_v7(&MessageId::new(raw).expect("id")), Some(t));
    }

    #[test]
    fn other_uuids_and_non_uuids_have_no_time() {
        for s in [
            "0190f3c4-7b2e-4c8a-9f1e-0123456789ab", // v4
            "0190f3c4-7b2e-7c8a-cf1e-0123456789ab", // wrong variant
            "0190f3c4x7b2e-7c8a-9f1e-0123456789ab",
            "0190f3c4-7b2e-7c8a-9f1e-0123456789ag",
            "payment-42",
            "00000000-0000-7000-8000-000000000000", // the epoch: would collide with UNDATED
        ] {
            assert_eq!(uuid_v7(&id(s)), None, "{s}");
        }
    }

    #[test]
    fn ulid_carries_its_milliseconds() {
        // 01ARZ3NDEK: 1469922850259 ms (the ULID spec's example ID)
        let t = ulid(&id("01ARZ3NDEKTSV4RRFFQ69G5FAV")).expect("ulid");
        assert_eq!(t.as_micros(), 1_469_922_850_259_000);
        assert_eq!(ulid(&id("01arz3ndektsv4rrffq69g5fav")), Some(t));
        for s in [
            "01ARZ3NDEKTSV4RRFFQ69G5FA",
            "81ARZ3NDEKTSV4RRFFQ69G5FAV",
            "01ARZ3NDEKTSV4RRFFQ69G5FAU",
        ] {
            assert_eq!(ulid(&id(s)), None, "{s}");
        }
    }

    #[test]
    fn days_round_trip_through_their_names() {
        for n in [-1, 0, 59, 365, 11_016, 19_908, 20_423, 2_932_896] {
            let d = Day::from_number(n);
            assert_eq!(Day::parse_suffix(&d.suffix()), Some(d), "{d}");
            assert_eq!(d.end() - d.start(), DAY_MICROS);
        }
        assert_eq!(Day::from_number(0).to_string(), "1970-01-01");
        assert_eq!(Day::from_number(20_423).suffix(), "20251201");
        assert_eq!(Day::parse_suffix("20250230"), None);
        assert_eq!(Day::parse_suffix("2025120"), None);
    }

    #[test]
    fn keys_create_ahead_and_drop_whole_days_past_retention() {
        let p = Partitioning::uuid_v7();
        assert_eq!(p.key_of(&id("not-a-uuid")).ok(), Some(UNDATED));
        let now = Timestamp::from_micros(Day::from_number(20_423).start() + 3_600_000_000);
        let days: Vec<_> = p.days_to_create(now).map(Day::number).collect();
        assert_eq!(days, vec![20_423, 20_424, 20_425]);
        // Retention::default() prunes after 7 days + 1 h.
        let prune_age = Retention::default().prune_age();
        let cutoff = now.saturating_sub(prune_age).as_micros();
        let boundary = Day::of(Timestamp::from_micros(cutoff));
        assert!(p.droppable(Day::from_number(boundary.number() - 1), now));
        assert!(
            !p.droppable(boundary, now),
            "the day holding the cutoff is kept"
        );
    }

    #[test]
    fn the_record_round_trips_through_a_comment() {
        let p = Partitioning::uuid_v7().ahead(Duration::from_secs(3 * 86_400));
        let comment = format!("idem claims, partitioned. {}", p.record());
        assert!(
            comment.ends_with("idem-partitioning: extractor=uuid_v7 kept-for=7d1h ahead=3d"),
            "{comment}"
        );
        let record = PartitionRecord::from_comment("t", &comment)
            .expect("readable")
            .expect("present");
        assert_eq!(record, p.record());
        let back = record.partitioning();
        assert_eq!(back.extractor(), UUID_V7);
        assert_eq!(back.kept_for(), p.kept_for());
        assert_eq!(back.created_ahead(), p.created_ahead());
        assert_eq!(
            back.key_of(&id("x")).ok(),
            Some(UNDATED),
            "a built-in claims"
        );
        assert_eq!(
            PartitionRecord::from_comment("t", "idem claims").ok(),
            Some(None)
        );
        let err = PartitionRecord::from_comment("t", "idem-partitioning: extractor=x")
            .expect_err("incomplete");
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
    }

    #[test]
    fn custom_extractors_are_named_and_checked_by_name() {
        let mine = Partitioning::by("order-ids.v1", |_: &MessageId| None).expect("named");
        assert_eq!(mine.extractor(), "order-ids.v1");
        for bad in ["", "a b", "x'y", UUID_V7, ULID, &"n".repeat(65)] {
            let err = Partitioning::by(bad, |_: &MessageId| None).expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        }
        let record = mine.record();
        assert!(record.check("t", &mine).is_ok());
        let err = record
            .check("t", &Partitioning::uuid_v7())
            .expect_err("another");
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
        assert!(err.to_string().contains("order-ids.v1"), "{err}");
        // Read back without its code: it maintains the table but claims nothing.
        let maintains = record.partitioning();
        assert!(record.check("t", &maintains).is_ok());
        let err = maintains.key_of(&id("x")).expect_err("no extractor");
        assert_eq!(err.kind(), ErrorKind::Misconfigured);
    }

    #[test]
    fn long_table_names_are_refused() {
        assert!(check_table_name(&"t".repeat(53)).is_ok());
        assert_eq!(
            check_table_name(&"t".repeat(54)).map_err(|e| e.kind()),
            Err(ErrorKind::InvalidConfig)
        );
    }
}
