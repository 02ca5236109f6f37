//! What every store's outbox shares beyond its SQL: how headers are stored, the names and
//! bounds a store checks before it writes, and the rule deciding which selected rows a lease
//! takes ([`admit`]). Pure, so both PostgreSQL stores and every engine apply the same.
//!
//! # The outbox table
//!
//! One row per outgoing message: `seq` (the table's auto-increment key: the order rows were
//! inserted in, which is the order their transactions took their place in the table, not
//! strictly their commit order), `message_id` (unique: a handler's re-run inserts nothing),
//! `destination`, `ordering_key` (NULL without one), `payload` (bytes), `headers` (text, see
//! [`encode_headers`]), `created_at`, `attempts`, `last_error`, `available_at` (when it may be
//! leased again after a failed publish), `leased_by` / `leased_until` (the relay holding it),
//! `sent_at` (NULL until published). Times are microseconds since the Unix epoch, as the
//! claims' `processed_at`: the server's clock, SQLite's host's. Dead letters go to
//! `<outbox>_dead_letters`: the same columns plus `reason` and `dead_lettered_at`.
//!
//! # Which rows a lease takes
//!
//! Unsent rows whose `available_at` has come, not leased to another relay with a live lease
//! (a relay's own leased rows come back to it, renewed), oldest `seq` first. A row with an
//! ordering key also needs every earlier unsent row of its (destination, key) to be taken by
//! the same lease: a key's rows are published by one relay at a time, in order, and a row
//! released for a retry holds its key's later rows back until it is published (or
//! dead-lettered). The statement filters what it can see; [`admit`] then checks the count of
//! earlier rows against the rows taken, which catches what the statement cannot see: an
//! earlier row another relay's uncommitted lease holds locked (skipped, so absent from the
//! selection). On MySQL and SQLite the lease is that select, [`admit`], then an update of the
//! admitted rows. On PostgreSQL it is one statement that makes the same check in SQL before
//! it updates, so it leases only the rows it returns (a row the rule turns away stays
//! unleased); [`admit`] then admits every one of them and only sets aside undecodable rows.

use std::collections::HashMap;

use idem_core::outbox::{MAX_DESTINATION_LEN, OutboxRow, Outgoing};
use idem_core::{Error, ErrorKind, MessageId, TableName, Timestamp};

use crate::statements::{OutboxParam, OutboxStatement};

/// The longest message ID any engine's outbox column holds (SQLite's bound).
const MAX_STORED_ID_LEN: usize = crate::sqlite::MAX_MESSAGE_ID_LEN;

/// The longest relay name, in bytes (the `leased_by` column).
pub const MAX_RELAY_LEN: usize = 255;

/// The longest `last_error` or dead-letter `reason` kept, in bytes; longer ones are cut at a
/// character boundary (a broker's error can quote a whole payload).
pub const MAX_ERROR_LEN: usize = 4000;

/// The outbox columns a dead letter copies, in order.
pub(crate) const COLUMNS: &str = "seq, message_id, destination, ordering_key, payload, headers, \
    created_at, attempts, last_error, available_at, leased_by, leased_until, sent_at";

/// What a lease statement selects, in [`Candidate`]'s order but the count of earlier rows.
pub(crate) const SELECTED: &str = "o.seq, o.message_id, o.destination, o.ordering_key, \
    o.payload, o.headers, o.attempts, o.created_at";

/// The dead-letter table of outbox `t`: `<t>_dead_letters` (a [`TableName`]'s 48 bytes plus
/// the suffix stay within every engine's identifier limit).
pub fn dead_letter_table(t: &TableName) -> String {
    format!("{t}_dead_letters")
}

/// Encodes headers as the `headers` column holds them: a JSON array of `[name, value]`
/// string pairs, in order (`[]` without headers). JSON because every engine and any operator
/// can read it, and it carries any header value (control characters are escaped).
pub fn encode_headers(headers: &[(String, String)]) -> String {
    // Serialising strings cannot fail.
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

/// Decodes a `headers` column.
///
/// # Errors
/// [`ErrorKind::Store`] when it is not a JSON array of `[name, value]` string pairs.
pub fn decode_headers(text: &str) -> Result<Vec<(String, String)>, Error> {
    serde_json::from_str(text).map_err(|e| {
        Error::new(
            ErrorKind::Store,
            format!("outbox headers are not a JSON array of [name, value] pairs: {e}"),
        )
    })
}

/// Sequence numbers per list statement (`IN (…)`): well under every engine's parameter limit.
pub const SEQ_CHUNK: usize = 500;

/// How often a lease is tried when the database reports a deadlock or a lock timeout (InnoDB
/// can pick a lease as a deadlock victim against a concurrent enqueue's gap lock).
pub const LEASE_ATTEMPTS: usize = 3;

/// Runs `once` — one lease transaction — again while it fails with
/// [`ErrorKind::Transient`], up to [`LEASE_ATTEMPTS`] tries in all: what every store's
/// `RelayStore::lease` does around its own driver.
pub async fn lease_with_retries<T, F, Fut>(relay: &str, mut once: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let mut attempt = 1;
    loop {
        match once().await {
            Err(e) if e.kind() == ErrorKind::Transient && attempt < LEASE_ATTEMPTS => {
                tracing::debug!(relay, attempt, error = %e, "outbox lease retried");
                attempt += 1;
            }
            done => return done,
        }
    }
}

/// Says, at `debug`, that `mark_sent` marked fewer rows than `relay` asked: the rest are no
/// longer leased to it (taken over after its lease lapsed) or were marked already. Not an
/// error: the row's new holder publishes it again under the same ID.
pub fn note_unmarked(relay: &str, asked: usize, marked: u64) {
    if marked < asked as u64 {
        tracing::debug!(
            relay,
            asked,
            marked,
            "outbox rows not marked sent: no longer leased to this relay (taken over after \
             the lease lapsed) or marked already"
        );
    }
}

/// Refuses a relay name the `leased_by` column cannot hold or a log would mangle: empty,
/// longer than [`MAX_RELAY_LEN`] bytes, or holding a control character.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`], with the reason.
pub fn check_relay(relay: &str) -> Result<(), Error> {
    let why = if relay.is_empty() {
        "is empty"
    } else if relay.len() > MAX_RELAY_LEN {
        "is longer than 255 bytes"
    } else if relay.chars().any(char::is_control) {
        "holds a control character"
    } else {
        return Ok(());
    };
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!("the relay name {relay:?} {why}"),
    ))
}

/// `text` cut to at most [`MAX_ERROR_LEN`] bytes, at a character boundary.
pub fn bounded(text: &str) -> &str {
    if text.len() <= MAX_ERROR_LEN {
        return text;
    }
    let mut end = MAX_ERROR_LEN;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Refuses an outbox table that is the claims or the requests table.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`].
pub fn check_tables(
    claims: &TableName,
    requests: &TableName,
    outbox: &TableName,
) -> Result<(), Error> {
    for (other, what) in [(claims, "claims"), (requests, "requests")] {
        if other == outbox {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("the outbox table and the {what} table are both {outbox}; name them apart"),
            ));
        }
    }
    Ok(())
}

/// A value a store binds, whatever its driver: each store maps these onto its own parameter
/// type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// Bytes.
    Bytes(&'a [u8]),
    /// Text.
    Text(&'a str),
    /// Text or NULL.
    OptText(Option<&'a str>),
    /// An integer.
    Int(i64),
    /// An integer or NULL.
    OptInt(Option<i64>),
}

/// Everything an outbox statement may bind; [`bind`](Self::bind) picks what a statement
/// takes, in its order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Values<'a> {
    /// The message ID.
    pub id: &'a [u8],
    /// The destination.
    pub destination: &'a str,
    /// The ordering key.
    pub key: Option<&'a str>,
    /// The payload.
    pub payload: &'a [u8],
    /// The encoded headers.
    pub headers: &'a str,
    /// The relay's name.
    pub relay: &'a str,
    /// A row count.
    pub limit: i64,
    /// A lease, in microseconds.
    pub lease: i64,
    /// A retry delay, in microseconds.
    pub retry_in: i64,
    /// A failed publish's error, bounded.
    pub error: &'a str,
    /// A dead letter's reason, bounded.
    pub reason: &'a str,
    /// One sequence number.
    pub seq: i64,
    /// A list of sequence numbers.
    pub seqs: &'a [i64],
    /// This host's clock, where the engine binds one (SQLite); `None` on a server.
    pub now: Option<i64>,
}

impl<'a> Values<'a> {
    /// What `statement` binds, in order.
    pub fn bind(&self, statement: &OutboxStatement) -> Vec<Value<'a>> {
        self.bind_params(&statement.binds)
    }

    /// What `params` bind, in order.
    pub(crate) fn bind_params(&self, params: &[OutboxParam]) -> Vec<Value<'a>> {
        let mut out = Vec::with_capacity(params.len() + self.seqs.len());
        for p in params {
            match p {
                OutboxParam::MessageId => out.push(Value::Bytes(self.id)),
                OutboxParam::Destination => out.push(Value::Text(self.destination)),
                OutboxParam::OrderingKey => out.push(Value::OptText(self.key)),
                OutboxParam::Payload => out.push(Value::Bytes(self.payload)),
                OutboxParam::Headers => out.push(Value::Text(self.headers)),
                OutboxParam::Relay => out.push(Value::Text(self.relay)),
                OutboxParam::Limit => out.push(Value::Int(self.limit)),
                OutboxParam::Lease => out.push(Value::Int(self.lease)),
                OutboxParam::RetryIn => out.push(Value::Int(self.retry_in)),
                OutboxParam::Error => out.push(Value::Text(self.error)),
                OutboxParam::Reason => out.push(Value::Text(self.reason)),
                OutboxParam::Seq => out.push(Value::Int(self.seq)),
                OutboxParam::Seqs => out.extend(self.seqs.iter().map(|s| Value::Int(*s))),
                OutboxParam::Now => out.push(Value::OptInt(self.now)),
            }
        }
        out
    }
}

/// One row as a lease statement selects it, before it is checked.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// `seq`.
    pub seq: i64,
    /// `message_id`.
    pub message_id: Vec<u8>,
    /// `destination`.
    pub destination: String,
    /// `ordering_key`.
    pub ordering_key: Option<String>,
    /// `payload`.
    pub payload: Vec<u8>,
    /// `headers`.
    pub headers: String,
    /// `attempts`.
    pub attempts: i64,
    /// `created_at`.
    pub created_at: i64,
    /// Unsent rows of the same destination and key before it (0 without a key).
    pub earlier: i64,
}

/// What a lease does with the rows it selected.
#[derive(Debug, Default)]
pub struct Admitted {
    /// The rows it leases and hands to the relay, oldest first.
    pub rows: Vec<OutboxRow>,
    /// Rows it cannot rebuild as a message (written by hand, or damaged), with the reason:
    /// the store leases them too and moves them to the dead-letter table in the same
    /// transaction, so that they neither block their key nor come back on every lease.
    pub undecodable: Vec<(i64, String)>,
}

impl Admitted {
    /// Every row the lease takes: the handed-out rows and the undecodable ones.
    pub fn seqs(&self) -> Vec<i64> {
        let mut seqs: Vec<i64> = self.rows.iter().map(|r| r.seq).collect();
        seqs.extend(self.undecodable.iter().map(|(s, _)| *s));
        seqs
    }
}

/// Checks the selected `candidates` (in `seq` order) against the per-key rule (see the module
/// docs): a keyed row is admitted only when every earlier unsent row of its key was admitted
/// before it; once one is not, none of that key's later rows are.
pub fn admit(candidates: Vec<Candidate>) -> Admitted {
    let mut taken: HashMap<(String, String), Option<i64>> = HashMap::new();
    let mut out = Admitted::default();
    for c in candidates {
        if let Some(key) = &c.ordering_key {
            let slot = taken
                .entry((c.destination.clone(), key.clone()))
                .or_insert(Some(0));
            match slot {
                Some(n) if *n == c.earlier => *n += 1,
                // An earlier row is held elsewhere (or waits for a retry): this key is not
                // this lease's.
                _ => {
                    *slot = None;
                    continue;
                }
            }
        }
        let seq = c.seq;
        match rebuild(c) {
            Ok(row) => out.rows.push(row),
            Err(e) => out
                .undecodable
                .push((seq, format!("undecodable outbox row: {e}"))),
        }
    }
    out
}

fn rebuild(c: Candidate) -> Result<OutboxRow, Error> {
    // Any length a store's message_id column holds: the store checked it on enqueue.
    let id = MessageId::with_limit(c.message_id, MAX_STORED_ID_LEN)?;
    if c.destination.len() > MAX_DESTINATION_LEN {
        // Outgoing::from_parts says so too; named here for the reason's sake.
        return Err(Error::new(ErrorKind::Store, "destination too long"));
    }
    let headers = decode_headers(&c.headers)?;
    let message = Outgoing::from_parts(id, c.destination, c.payload, headers, c.ordering_key)?;
    Ok(OutboxRow {
        seq: c.seq,
        message,
        attempts: u32::try_from(c.attempts.max(0)).unwrap_or(u32::MAX),
        created: Timestamp::from_micros(c.created_at),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seq: i64, key: Option<&str>, earlier: i64) -> Candidate {
        Candidate {
            seq,
            message_id: format!("m-{seq}").into_bytes(),
            destination: "orders".into(),
            ordering_key: key.map(str::to_owned),
            payload: vec![0, 1, 2],
            headers: r#"[["kind","X"]]"#.into(),
            attempts: 0,
            created_at: 1,
            earlier,
        }
    }

    fn seqs(a: &Admitted) -> Vec<i64> {
        a.rows.iter().map(|r| r.seq).collect()
    }

    #[test]
    fn headers_round_trip_in_order_with_any_value() {
        let h = vec![
            (
                "b".to_owned(),
                "line\nbreak \"quoted\" \u{1F600}".to_owned(),
            ),
            ("a".to_owned(), String::new()),
        ];
        let text = encode_headers(&h);
        assert!(text.starts_with(r#"[["b","line\nbreak"#), "{text}");
        assert_eq!(decode_headers(&text).unwrap(), h);
        assert_eq!(encode_headers(&[]), "[]");
        assert_eq!(decode_headers("{}").unwrap_err().kind(), ErrorKind::Store);
    }

    #[test]
    fn a_key_is_taken_only_from_its_head_and_only_while_unbroken() {
        // Key a: head and next taken. Key b: its head (1 earlier row) is held elsewhere, so
        // neither it nor its next row is taken. Unkeyed rows are always free.
        let got = admit(vec![
            row(1, Some("a"), 0),
            row(2, Some("b"), 1),
            row(3, None, 0),
            row(4, Some("a"), 1),
            row(5, Some("b"), 2),
            row(6, Some("a"), 3),
        ]);
        assert_eq!(seqs(&got), vec![1, 3, 4]);
        assert_eq!(
            got.rows[0].message.headers(),
            &[("kind".into(), "X".into())]
        );
    }

    #[test]
    fn an_undecodable_row_is_set_aside_and_counts_for_its_key() {
        let mut bad = row(1, Some("a"), 0);
        bad.headers = "not json".into();
        let got = admit(vec![bad, row(2, Some("a"), 1)]);
        assert_eq!(seqs(&got), vec![2]);
        assert_eq!(got.undecodable.len(), 1);
        assert!(
            got.undecodable[0].1.contains("JSON"),
            "{:?}",
            got.undecodable
        );
        assert_eq!(got.seqs(), vec![2, 1]);
    }

    #[test]
    fn names_and_bounds() {
        assert!(check_relay("relay-1").is_ok());
        for bad in ["", "a\nb", &"r".repeat(256)] {
            assert_eq!(
                check_relay(bad).unwrap_err().kind(),
                ErrorKind::InvalidConfig
            );
        }
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = bounded(&long);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() >= MAX_ERROR_LEN - 1);
        let t = TableName::new("app.outbox").unwrap();
        assert_eq!(dead_letter_table(&t), "app.outbox_dead_letters");
        let c = TableName::default();
        assert!(check_tables(&c, &TableName::default_requests(), &t).is_ok());
        assert!(check_tables(&c, &TableName::default_requests(), &c).is_err());
    }
}
