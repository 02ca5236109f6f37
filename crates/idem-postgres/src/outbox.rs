//! The transactional outbox ([`OutboxStore`], [`RelayStore`]) in the outbox table `idem-sql`'s
//! PostgreSQL store uses, with the same statements (`idem_dialect::postgres::outbox_statements`)
//! and the same per-key rule, so that one store's relay leases what the other's handlers
//! enqueued.
//!
//! Enqueue (one multi-row insert per batch of messages) is prepared once per connection and
//! row count, and runs in the handler's [`PgTx`]. The relay's
//! statements go out typed (`query_typed`, one round trip, not prepared): a list of `n`
//! sequence numbers is a text of its own, and caching one statement per list length on every
//! connection would grow the caches for nothing. A lease is a short transaction of its own
//! around the dialect's one lease statement (select `FOR UPDATE OF o SKIP LOCKED`, the per-key
//! rule, the lease), then commit.

use std::time::Duration;

use idem_core::outbox::{Backlog, OutboxRow, OutboxStore, Outgoing, RelayStore};
use idem_core::{Error, ErrorKind};
use idem_dialect::micros;
use idem_dialect::outbox::{
    Candidate, SEQ_CHUNK, Value, Values, admit, bounded, check_relay, encode_headers,
    lease_with_retries, note_unmarked,
};
use idem_dialect::{EnqueueStatement, OutboxStatement};
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::errors::{commit_error, store_error};
use crate::store::{MAX_MESSAGE_ID_LEN, PgStore};
use crate::tx::PgTx;

/// What `statement` binds from `values`, with each parameter's type.
struct Bound<'a> {
    values: Vec<Value<'a>>,
}

impl<'a> Bound<'a> {
    fn new(statement: &OutboxStatement, values: &Values<'a>) -> Self {
        Self {
            values: values.bind(statement),
        }
    }

    fn typed(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        self.values
            .iter()
            .map(|v| -> (&(dyn ToSql + Sync), Type) {
                match v {
                    Value::Bytes(b) => (b, Type::BYTEA),
                    Value::Text(t) => (t, Type::TEXT),
                    Value::OptText(t) => (t, Type::TEXT),
                    Value::Int(i) => (i, Type::INT8),
                    Value::OptInt(i) => (i, Type::INT8),
                }
            })
            .collect()
    }
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Runs `sql` with `bound` on `client`; rows affected.
async fn execute(
    client: &Client,
    sql: &str,
    bound: &Bound<'_>,
) -> Result<u64, tokio_postgres::Error> {
    client.execute_typed(sql, &bound.typed()).await
}

fn candidate(r: &tokio_postgres::Row) -> Result<Candidate, tokio_postgres::Error> {
    Ok(Candidate {
        seq: r.try_get(0)?,
        message_id: r.try_get(1)?,
        destination: r.try_get(2)?,
        ordering_key: r.try_get(3)?,
        payload: r.try_get(4)?,
        headers: r.try_get(5)?,
        attempts: r.try_get(6)?,
        created_at: r.try_get(7)?,
        earlier: r.try_get(8)?,
    })
}

impl PgStore {
    /// One lease transaction.
    async fn lease_once(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRow>, Error> {
        let err = |e| store_error("leasing outbox rows", e);
        let tx = self.begin_relay().await?;
        let v = Values {
            relay,
            limit: count(limit),
            lease: micros(lease),
            ..Values::default()
        };
        let select = &self.osql.lease;
        let rows = tx
            .query_typed(&select.sql, &Bound::new(select, &v).typed())
            .await
            .map_err(err)?;
        let candidates = rows
            .iter()
            .map(candidate)
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        // The statement leased what it returned, all of which the per-key rule admitted; this
        // sets aside the rows that cannot be rebuilt as messages.
        let admitted = admit(candidates);
        if let Some(update) = &self.osql.lease_update {
            for chunk in admitted.seqs().chunks(SEQ_CHUNK) {
                let v = Values { seqs: chunk, ..v };
                execute(&tx, &update.text(chunk.len()), &Bound::new(update, &v))
                    .await
                    .map_err(err)?;
            }
        }
        for (seq, reason) in &admitted.undecodable {
            let moved = self.move_to_dead_letters(&tx, relay, *seq, reason).await?;
            tracing::debug!(
                relay,
                seq,
                moved,
                reason,
                "outbox row dead-lettered at lease"
            );
        }
        tx.commit().await.map_err(commit_error)?;
        Ok(admitted.rows)
    }

    /// Copies row `seq` (leased to `relay`, unsent) into the dead-letter table and deletes it,
    /// in `tx`: whether it moved.
    async fn move_to_dead_letters(
        &self,
        tx: &PgTx,
        relay: &str,
        seq: i64,
        reason: &str,
    ) -> Result<bool, Error> {
        let err = |e| store_error("dead-lettering an outbox row", e);
        let v = Values {
            relay,
            seq,
            reason: bounded(reason),
            ..Values::default()
        };
        let (copy, delete) = (&self.osql.dead_letter_copy, &self.osql.dead_letter_delete);
        let copied = execute(tx, &copy.sql, &Bound::new(copy, &v))
            .await
            .map_err(err)?;
        if copied == 0 {
            return Ok(false);
        }
        let deleted = execute(tx, &delete.sql, &Bound::new(delete, &v))
            .await
            .map_err(err)?;
        Ok(deleted == copied)
    }

    /// A transaction of the relay's own (lease, dead letter): begun with the dialect's
    /// `relay_begin`, which does not wait for the commit to reach the disk.
    async fn begin_relay(&self) -> Result<PgTx, Error> {
        match self.osql.relay_begin {
            Some(begin) => self.begin_with(begin).await,
            None => self.begin_tx().await,
        }
    }

    /// A relay statement outside any transaction, on a connection of its own; rows affected.
    async fn execute_relay(&self, what: &str, sql: &str, bound: &Bound<'_>) -> Result<u64, Error> {
        let lease = self.lease().await?;
        execute(lease.client(), sql, bound)
            .await
            .map_err(|e| store_error(what, e))
    }
}

impl OutboxStore for PgStore {
    /// One prepared multi-row insert per [`EnqueueStatement::MAX_ROWS`] messages, in `tx`; an
    /// ID already in the table inserts nothing.
    async fn enqueue(&self, tx: &mut PgTx, messages: &[Outgoing]) -> Result<(), Error> {
        let what = "enqueuing outgoing messages";
        if messages.is_empty() {
            return Ok(());
        }
        for m in messages {
            if m.id().len() > MAX_MESSAGE_ID_LEN {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "an outgoing message ID is {} bytes; this store's outbox holds at most \
                         {MAX_MESSAGE_ID_LEN}",
                        m.id().len()
                    ),
                ));
            }
        }
        let insert = &self.osql.enqueue;
        let headers: Vec<String> = messages
            .iter()
            .map(|m| encode_headers(m.headers()))
            .collect();
        for (chunk, headers) in messages
            .chunks(EnqueueStatement::MAX_ROWS)
            .zip(headers.chunks(EnqueueStatement::MAX_ROWS))
        {
            let rows: Vec<Values<'_>> = chunk
                .iter()
                .zip(headers)
                .map(|(m, headers)| Values {
                    id: m.id().as_bytes(),
                    destination: m.destination(),
                    key: m.key(),
                    payload: m.payload(),
                    headers,
                    ..Values::default()
                })
                .collect();
            // Prepared per row count: a consumer's batches are mostly full, so one or two
            // texts per connection.
            let statement = tx
                .prepare_cached(&insert.text(chunk.len()))
                .await
                .map_err(|e| store_error(what, e))?;
            let bound = Bound {
                values: insert.bind(&rows),
            };
            let params: Vec<&(dyn ToSql + Sync)> =
                bound.typed().into_iter().map(|(p, _)| p).collect();
            let done = tx.execute(&statement, &params).await;
            tx.saw(&done);
            done.map_err(|e| store_error(what, e))?;
        }
        if let Some(notify) = &self.osql.notify {
            let done = tx.execute(notify.sql.as_str(), &[]).await;
            tx.saw(&done);
            done.map_err(|e| store_error("notifying relays of the outbox", e))?;
        }
        Ok(())
    }
}

impl RelayStore for PgStore {
    async fn lease(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRow>, Error> {
        check_relay(relay)?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        lease_with_retries(relay, || self.lease_once(relay, limit, lease)).await
    }

    async fn mark_sent(&self, relay: &str, seqs: &[i64]) -> Result<(), Error> {
        check_relay(relay)?;
        if seqs.is_empty() {
            return Ok(());
        }
        let what = "marking outbox rows sent";
        let mark = &self.osql.mark_sent;
        // In a relay transaction, whose commit does not wait for the disk: a mark lost in a
        // crash only publishes its rows again under the same IDs.
        let tx = self.begin_relay().await?;
        let mut marked = 0;
        for chunk in seqs.chunks(SEQ_CHUNK) {
            let v = Values {
                relay,
                seqs: chunk,
                ..Values::default()
            };
            marked += execute(&tx, &mark.text(chunk.len()), &Bound::new(mark, &v))
                .await
                .map_err(|e| store_error(what, e))?;
        }
        tx.commit().await.map_err(commit_error)?;
        note_unmarked(relay, seqs.len(), marked);
        Ok(())
    }

    async fn release(
        &self,
        relay: &str,
        seq: i64,
        error: &str,
        retry_in: Duration,
    ) -> Result<(), Error> {
        check_relay(relay)?;
        let release = &self.osql.release;
        let v = Values {
            relay,
            seq,
            error: bounded(error),
            retry_in: micros(retry_in),
            ..Values::default()
        };
        let released = self
            .execute_relay(
                "releasing an outbox row",
                &release.sql,
                &Bound::new(release, &v),
            )
            .await?;
        if released == 0 {
            tracing::debug!(
                relay,
                seq,
                "outbox row not released: no longer leased to this relay"
            );
        }
        Ok(())
    }

    async fn dead_letter(&self, relay: &str, seq: i64, reason: &str) -> Result<(), Error> {
        check_relay(relay)?;
        let tx = self.begin_relay().await?;
        if self.move_to_dead_letters(&tx, relay, seq, reason).await? {
            tx.commit().await.map_err(commit_error)
        } else {
            tracing::debug!(
                relay,
                seq,
                "outbox row not dead-lettered: no longer leased to this relay"
            );
            tx.rollback().await.map_err(|e| store_error("rollback", e))
        }
    }

    async fn purge_sent(&self, limit: usize) -> Result<u64, Error> {
        if limit == 0 {
            return Ok(0);
        }
        let purge = &self.osql.purge_sent;
        let v = Values {
            limit: count(limit),
            ..Values::default()
        };
        self.execute_relay(
            "purging sent outbox rows",
            &purge.sql,
            &Bound::new(purge, &v),
        )
        .await
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let err = |e| store_error("reading the outbox backlog", e);
        let read = &self.osql.backlog;
        let lease = self.lease().await?;
        let row = lease
            .client()
            .query_typed_opt(&read.sql, &[])
            .await
            .map_err(err)?
            .ok_or_else(|| {
                Error::new(ErrorKind::Store, "the outbox backlog read returned no row")
            })?;
        let (unsent, oldest, sent, dead, now): (i64, Option<i64>, i64, i64, i64) = (
            row.try_get(0).map_err(err)?,
            row.try_get(1).map_err(err)?,
            row.try_get(2).map_err(err)?,
            row.try_get(3).map_err(err)?,
            row.try_get(4).map_err(err)?,
        );
        let n = |c: i64| u64::try_from(c).unwrap_or(0);
        Ok(Backlog {
            unsent: n(unsent),
            oldest_unsent: oldest
                .map(|t| Duration::from_micros(u64::try_from(now.saturating_sub(t)).unwrap_or(0))),
            sent: n(sent),
            dead_lettered: n(dead),
        })
    }
}
