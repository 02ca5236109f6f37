//! One stream entry handed to the runner, and how it is settled: `XACK`, or `XADD` to the
//! dead-letter stream followed by `XACK` in one Lua script.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use idem_consumer::{DeadLetter, Delivery};
use idem_core::Error;
use redis::aio::ConnectionManager;

use crate::error::unavailable;
use crate::reply::Field;

/// What every delivery of one source shares: the non-blocking connection and the names.
pub(crate) struct Shared {
    /// For acks, dead letters and reclaims; never used for a blocking read, which would hold
    /// every ack behind it.
    pub(crate) conn: ConnectionManager,
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) dead_letter_stream: String,
    /// Entry IDs handed to the runner and not yet settled, so that a slow handler's own entry,
    /// reclaimed by this very consumer after `min_idle`, is not handed out a second time.
    pub(crate) in_flight: Mutex<HashSet<String>>,
}

impl Shared {
    pub(crate) fn in_flight(&self) -> MutexGuard<'_, HashSet<String>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn ack(&self, id: &str) -> Result<(), Error> {
        let acked: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(id)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| unavailable("XACK", e))?;
        if acked == 0 {
            // Another member already acknowledged it (it reclaimed the entry and finished
            // first): nothing is lost, the claim made one of the two a duplicate.
            tracing::debug!(stream = %self.stream, id, "entry was no longer pending when acked");
        }
        Ok(())
    }

    /// Copies the entry (every original field, then the reason fields; on an `invalid-id`
    /// dead letter a field other than the payload (index `payload`) over 1 KiB cut short, see
    /// [`DeadLetter::forward`]) to the dead-letter
    /// stream, then acknowledges it, in one script: Redis runs it without interleaving, and a
    /// failed `XADD` (say, the dead-letter key holds another type) stops it before the `XACK`.
    /// `MULTI`/`EXEC` would not: it runs the `XACK` even when the `XADD` in front of it fails.
    pub(crate) async fn dead_letter(
        &self,
        id: &str,
        fields: &[Field],
        payload: Option<usize>,
        reason: &DeadLetter,
    ) -> Result<(), Error> {
        let headers = reason.headers();
        let mut call = DEAD_LETTER_SCRIPT.prepare_invoke();
        call.key(&self.stream)
            .key(&self.dead_letter_stream)
            .arg(&self.group)
            .arg(id);
        // A replayed dead letter carries old reason fields; the new ones replace them rather
        // than appear twice. An ID too long for the store is cut short (`DeadLetter::forward`).
        let mut cut = Vec::new();
        for (i, (k, v)) in fields.iter().enumerate() {
            if headers.iter().any(|(h, _)| h.as_bytes() == k.as_slice())
                || k.as_slice() == DeadLetter::TRUNCATED_HEADER.as_bytes()
            {
                continue;
            }
            if Some(i) != payload && reason.cuts(v.len()) {
                cut.push((String::from_utf8_lossy(k).into_owned(), v.len()));
                call.arg(k).arg(reason.forward(v).as_ref());
            } else {
                call.arg(k).arg(v);
            }
        }
        for (k, v) in headers
            .iter()
            .chain(DeadLetter::truncation_note(&cut).iter())
        {
            call.arg(*k).arg(v);
        }
        call.arg(ORIGINAL_STREAM_FIELD)
            .arg(&self.stream)
            .arg(ORIGINAL_ID_FIELD)
            .arg(id);
        let dead_letter_id: String = call
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| unavailable("dead-letter XADD + XACK", e))?;
        tracing::debug!(stream = %self.stream, id, dead_letter_stream = %self.dead_letter_stream, %dead_letter_id, %reason, "entry dead-lettered");
        Ok(())
    }
}

/// KEYS: stream, dead-letter stream. ARGV: group, entry ID, then field/value pairs.
static DEAD_LETTER_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local added = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return added
",
    )
});

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .finish_non_exhaustive()
    }
}

/// Dead-letter field naming the stream the entry came from.
pub const ORIGINAL_STREAM_FIELD: &str = "idem-original-stream";
/// Dead-letter field holding the entry's ID in the stream it came from.
pub const ORIGINAL_ID_FIELD: &str = "idem-original-id";

/// One entry of the stream, read through the consumer group.
///
/// Every field of the entry is a [`header`](Delivery::header); the payload is the configured
/// payload field. Dropping it unsettled leaves the entry pending: it is reclaimed after
/// `min_idle`.
pub struct RedisStreamDelivery {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: String,
    pub(crate) fields: Vec<Field>,
    /// Index of the payload field in `fields`; entries without one never become deliveries.
    pub(crate) payload: usize,
    pub(crate) previous: u32,
}

impl RedisStreamDelivery {
    /// The entry ID in the stream (`1718000000000-0`).
    pub fn entry_id(&self) -> &str {
        &self.id
    }

    /// Every field of the entry, in the order the producer wrote them.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}

impl fmt::Debug for RedisStreamDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamDelivery")
            .field("stream", &self.shared.stream)
            .field("id", &self.id)
            .field("fields", &self.fields.len())
            .field("previous_deliveries", &self.previous)
            .finish()
    }
}

impl Drop for RedisStreamDelivery {
    fn drop(&mut self) {
        self.shared.in_flight().remove(&self.id);
    }
}

impl Delivery for RedisStreamDelivery {
    fn payload(&self) -> &[u8] {
        self.fields
            .get(self.payload)
            .map(|(_, v)| v.as_slice())
            .unwrap_or_default()
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.fields
            .iter()
            .find(|(k, _)| k.as_slice() == name.as_bytes())
            .map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }

    fn previous_deliveries(&self) -> u32 {
        self.previous
    }

    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {} id {}", self.shared.stream, self.id)
    }

    async fn ack(self) -> Result<(), Error> {
        self.shared.ack(&self.id).await
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        self.shared
            .dead_letter(&self.id, &self.fields, Some(self.payload), reason)
            .await
    }
}
