//! The consumer-group reader: resumes its own pending entries, reclaims those of dead
//! members, then reads new ones.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::{DeadLetter, DeadLetterReason, IdSource, Source};
use idem_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::builder::RedisStreamSourceBuilder;
use crate::delivery::{RedisStreamDelivery, Shared};
use crate::error::unavailable;
use crate::reply::{self, Entry};
use crate::topology::ensure_group;

/// Slack on top of `BLOCK` before the client gives up on a blocking read.
const BLOCK_SLACK: Duration = Duration::from_secs(5);
/// Response timeout of the non-blocking connection (acks, dead letters, reclaims).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// A [`Source`] reading one Redis stream through a consumer group.
///
/// Each [`next`](Source::next):
/// 1. on the first call, re-reads this consumer's own pending entries (`XREADGROUP … 0`), so a
///    restarted process with the same consumer name resumes what it had not acknowledged;
/// 2. reclaims entries idle for `min_idle` from any member (`XAUTOCLAIM`): those of a crashed
///    consumer, or its own that a cancelled fetch left behind;
/// 3. reads new entries (`XREADGROUP … >`), blocking up to `block` when nothing was reclaimed;
///
/// and repeats until it has at least one entry. Everything it reads but does not return stays
/// pending, so dropping the future loses nothing.
///
/// Two connections are used: the blocking read holds its own, so acks are not stuck behind
/// it. Both reconnect by themselves; a failed command is reported as
/// [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) and the runner calls `next`
/// again after a backoff.
#[derive(Debug)]
pub struct RedisStreamSource {
    shared: Arc<Shared>,
    reader: ConnectionManager,
    /// The settings it was built with (idle time, block time, field names).
    config: RedisStreamSourceBuilder,
    /// `XAUTOCLAIM` scan position; wraps to `0-0` after a full pass.
    claim_cursor: String,
    /// Position in this consumer's own pending list while resuming it; `None` once done.
    own_pending: Option<String>,
}

impl RedisStreamSource {
    /// Opens the two connections and creates the group, with settings the builder checked.
    pub(crate) async fn start(
        client: redis::Client,
        config: RedisStreamSourceBuilder,
    ) -> Result<Self, Error> {
        let block_timeout = config.block.saturating_add(BLOCK_SLACK);
        let reader = manager(&client, block_timeout).await?;
        let conn = manager(&client, COMMAND_TIMEOUT).await?;
        let shared = Arc::new(Shared {
            conn,
            dead_letter_stream: config.dead_letter_stream_key(),
            stream: config.stream.clone(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            in_flight: Mutex::new(Default::default()),
        });
        let source = Self {
            shared,
            reader,
            config,
            claim_cursor: "0-0".to_owned(),
            own_pending: Some("0".to_owned()),
        };
        source.create_group().await?;
        Ok(source)
    }

    /// The stream this source reads.
    pub fn stream(&self) -> &str {
        &self.shared.stream
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.shared.group
    }

    /// This member's consumer name.
    pub fn consumer(&self) -> &str {
        &self.shared.consumer
    }

    /// Where dead letters go.
    pub fn dead_letter_stream(&self) -> &str {
        &self.shared.dead_letter_stream
    }

    /// Run at start and after `NOGROUP`: Redis without persistence forgets groups on restart.
    async fn create_group(&self) -> Result<(), Error> {
        ensure_group(
            &mut self.shared.conn.clone(),
            &self.shared.stream,
            &self.shared.group,
            self.config.start,
        )
        .await
    }

    async fn read(
        &mut self,
        id: &str,
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<Entry>, Error> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.shared.group)
            .arg(&self.shared.consumer)
            .arg("COUNT")
            .arg(count);
        if let Some(block) = block {
            // BLOCK 0 would wait forever.
            cmd.arg("BLOCK").arg(millis(block).max(1));
        }
        cmd.arg("STREAMS").arg(&self.shared.stream).arg(id);
        match cmd.query_async(&mut self.reader).await {
            Ok(v) => reply::read_group(v),
            Err(e) => Err(self.failed("XREADGROUP", e).await),
        }
    }

    /// The error for a failed group command. A missing group (Redis restarted without
    /// persistence, or the group was destroyed) is recreated first, so the runner's next
    /// attempt after its backoff succeeds.
    async fn failed(&self, what: &str, e: redis::RedisError) -> Error {
        if e.code() == Some("NOGROUP") {
            tracing::warn!(stream = %self.shared.stream, group = %self.shared.group, "consumer group vanished (redis restarted?); recreating it");
            if let Err(create) = self.create_group().await {
                return create;
            }
        }
        unavailable(what, e)
    }

    async fn auto_claim(&mut self, count: usize) -> Result<Vec<Entry>, Error> {
        let value = redis::cmd("XAUTOCLAIM")
            .arg(&self.shared.stream)
            .arg(&self.shared.group)
            .arg(&self.shared.consumer)
            .arg(millis(self.config.min_idle))
            .arg(&self.claim_cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.shared.conn.clone())
            .await;
        let value = match value {
            Ok(v) => v,
            Err(e) => return Err(self.failed("XAUTOCLAIM", e).await),
        };
        let claimed = reply::auto_claim(value)?;
        if !claimed.deleted.is_empty() {
            tracing::warn!(stream = %self.shared.stream, ids = ?claimed.deleted, "pending entries were deleted from the stream before being processed");
        }
        if !claimed.claimed.is_empty() {
            tracing::info!(stream = %self.shared.stream, consumer = %self.shared.consumer, count = claimed.claimed.len(), "reclaimed stale pending entries");
        }
        self.claim_cursor = claimed.cursor;
        Ok(claimed.claimed)
    }

    /// The times-delivered counters of redelivered entries (one round trip); `None` for an
    /// entry acknowledged meanwhile.
    async fn delivery_counts(&self, entries: &[Entry]) -> Result<Vec<Option<u64>>, Error> {
        let mut pipe = redis::pipe();
        for e in entries {
            pipe.cmd("XPENDING")
                .arg(&self.shared.stream)
                .arg(&self.shared.group)
                .arg(&e.id)
                .arg(&e.id)
                .arg(1);
        }
        let values: Vec<redis::Value> = pipe
            .query_async(&mut self.shared.conn.clone())
            .await
            .map_err(|e| unavailable("XPENDING", e))?;
        values.into_iter().map(reply::times_delivered).collect()
    }

    /// Turns entries into deliveries: skips those already in flight here, acknowledges
    /// deleted ones, dead-letters those without a payload field.
    async fn accept(
        &self,
        entries: Vec<Entry>,
        redelivered: bool,
        out: &mut Vec<RedisStreamDelivery>,
    ) -> Result<(), Error> {
        if entries.is_empty() {
            return Ok(());
        }
        let counts = if redelivered {
            self.delivery_counts(&entries).await?
        } else {
            // XREADGROUP `>` delivers for the first time.
            vec![Some(1); entries.len()]
        };
        for (entry, count) in entries.into_iter().zip(counts) {
            let Some(count) = count else { continue };
            if self.shared.in_flight().contains(&entry.id) {
                continue;
            }
            let Some(fields) = entry.fields else {
                // Still pending but gone from the stream: nothing left to process, and it
                // would otherwise stay in the pending list for ever.
                tracing::warn!(stream = %self.shared.stream, id = %entry.id, "pending entry was deleted from the stream; acknowledging it");
                self.shared.ack(&entry.id).await?;
                continue;
            };
            let payload_field = self.config.payload_field.as_bytes();
            let Some(payload) = fields
                .iter()
                .position(|(k, _)| k.as_slice() == payload_field)
            else {
                let dl = DeadLetter::new(
                    DeadLetterReason::Undecodable,
                    format!(
                        "stream entry has no {:?} field, so there is no payload to process",
                        self.config.payload_field
                    ),
                )
                .with_context(
                    &format!("{}/{}", self.shared.group, self.shared.consumer),
                    0,
                );
                self.shared
                    .dead_letter(&entry.id, &fields, None, &dl)
                    .await?;
                continue;
            };
            self.shared.in_flight().insert(entry.id.clone());
            out.push(RedisStreamDelivery {
                shared: self.shared.clone(),
                id: entry.id,
                fields,
                payload,
                previous: u32::try_from(count.saturating_sub(1)).unwrap_or(u32::MAX),
            });
        }
        Ok(())
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn manager(
    client: &redis::Client,
    response_timeout: Duration,
) -> Result<ConnectionManager, Error> {
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(response_timeout))
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_max_delay(Duration::from_secs(2));
    ConnectionManager::new_with_config(client.clone(), config)
        .await
        .map_err(|e| unavailable("connecting", e))
}

impl Source for RedisStreamSource {
    type Delivery = RedisStreamDelivery;

    fn broker(&self) -> &'static str {
        "redis"
    }

    fn default_id_source(&self) -> IdSource {
        IdSource::header(self.config.id_field.clone())
    }

    async fn next(&mut self, max: usize) -> Result<Vec<RedisStreamDelivery>, Error> {
        let max = max.max(1);
        let mut out = Vec::new();
        loop {
            if let Some(cursor) = self.own_pending.clone() {
                let entries = self.read(&cursor, max, None).await?;
                self.own_pending = entries.last().map(|e| e.id.clone());
                self.accept(entries, true, &mut out).await?;
                if self.own_pending.is_none() {
                    tracing::debug!(stream = %self.shared.stream, consumer = %self.shared.consumer, "own pending entries resumed");
                }
                if !out.is_empty() {
                    return Ok(out);
                }
                continue;
            }
            let claimed = self.auto_claim(max).await?;
            self.accept(claimed, true, &mut out).await?;
            if out.len() < max {
                // Block only when there is nothing to hand out yet.
                let block = out.is_empty().then_some(self.config.block);
                let fresh = self.read(">", max - out.len(), block).await?;
                self.accept(fresh, false, &mut out).await?;
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }
}
