//! The transactional outbox ([`OutboxStore`], [`RelayStore`]) on every engine, over the
//! engine's `idem_dialect` outbox statements.
//!
//! Enqueue runs in the handler's transaction, so its rows commit with the claim and the
//! effect. A relay's lease is a short transaction of its own on the pool (never on the held
//! connections, which are the consumers'): select the leasable rows — `FOR UPDATE SKIP LOCKED`
//! on the servers, under `BEGIN IMMEDIATE` on SQLite — check the per-key rule
//! ([`idem_dialect::outbox::admit`]), lease them, commit. On PostgreSQL the select, the rule
//! and the lease are one statement. Every later step (mark, release,
//! dead letter) is guarded by `leased_by`: a relay whose lease lapsed and was taken over
//! changes nothing, which is logged at `debug` and is no error.

use std::time::Duration;

use idem_core::outbox::{Backlog, OutboxRow, OutboxStore, Outgoing, RelayStore};
use idem_core::{Error, ErrorKind, Stamp};
use idem_dialect::micros;
use idem_dialect::outbox::{
    SEQ_CHUNK, Values, admit, bounded, check_relay, encode_headers, lease_with_retries,
    note_unmarked,
};
use idem_dialect::{EnqueueStatement, OutboxStatement};

use crate::engine::{Engine, Param};
use crate::errors::{commit_error, store_error};
use crate::store::SqlStore;
use crate::tx::Tx;

fn params<'a>(statement: &OutboxStatement, values: &Values<'a>) -> Vec<Param<'a>> {
    values
        .bind(statement)
        .into_iter()
        .map(Param::from)
        .collect()
}

/// A row count as the statements bind it.
fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl<E: Engine> SqlStore<E> {
    /// The clock an outbox statement binds: this host's on an embedded engine, none on a
    /// server (its statements read the server's).
    fn outbox_now() -> Option<i64> {
        E::stamp(Stamp::StoreClock)
    }

    /// One lease transaction.
    async fn lease_once(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRow>, Error> {
        let err = |e| store_error::<E>("leasing outbox rows", e);
        let now = Self::outbox_now();
        let mut tx = self.begin_relay().await?;
        let v = Values {
            relay,
            limit: count(limit),
            lease: micros(lease),
            now,
            ..Values::default()
        };
        let select = &self.osql.lease;
        let candidates = E::fetch_candidates(&mut tx, &select.sql, &params(select, &v))
            .await
            .map_err(err)?;
        let admitted = admit(candidates);
        // PostgreSQL's lease statement leased what it returned; the others only selected.
        if let Some(update) = &self.osql.lease_update {
            for chunk in admitted.seqs().chunks(SEQ_CHUNK) {
                let v = Values { seqs: chunk, ..v };
                E::execute(&mut tx, &update.text(chunk.len()), &params(update, &v))
                    .await
                    .map_err(err)?;
            }
        }
        for (seq, reason) in &admitted.undecodable {
            let moved = self
                .move_to_dead_letters(&mut tx, relay, *seq, reason)
                .await?;
            tracing::debug!(
                relay,
                seq,
                moved,
                reason,
                "outbox row dead-lettered at lease"
            );
        }
        tx.commit().await.map_err(commit_error::<E>)?;
        Ok(admitted.rows)
    }

    /// Copies row `seq` (leased to `relay`, unsent) into the dead-letter table and deletes it,
    /// in `tx`: whether it moved.
    async fn move_to_dead_letters(
        &self,
        tx: &mut Tx<E>,
        relay: &str,
        seq: i64,
        reason: &str,
    ) -> Result<bool, Error> {
        let err = |e| store_error::<E>("dead-lettering an outbox row", e);
        let v = Values {
            relay,
            seq,
            reason: bounded(reason),
            now: Self::outbox_now(),
            ..Values::default()
        };
        let (copy, delete) = (&self.osql.dead_letter_copy, &self.osql.dead_letter_delete);
        let copied = E::execute(tx, &copy.sql, &params(copy, &v))
            .await
            .map_err(err)?;
        if copied == 0 {
            return Ok(false);
        }
        let deleted = E::execute(tx, &delete.sql, &params(delete, &v))
            .await
            .map_err(err)?;
        Ok(deleted == copied)
    }
}

impl<E: Engine> OutboxStore for SqlStore<E> {
    /// One multi-row insert per [`EnqueueStatement::MAX_ROWS`] messages, in `tx`; an ID
    /// already in the table inserts nothing.
    async fn enqueue(&self, tx: &mut Tx<E>, messages: &[Outgoing]) -> Result<(), Error> {
        for m in messages {
            if m.id().len() > E::MAX_MESSAGE_ID_LEN {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "an outgoing message ID is {} bytes; this store's outbox holds at most {}",
                        m.id().len(),
                        E::MAX_MESSAGE_ID_LEN
                    ),
                ));
            }
        }
        let now = Self::outbox_now();
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
                    now,
                    ..Values::default()
                })
                .collect();
            let bound: Vec<Param<'_>> = insert.bind(&rows).into_iter().map(Param::from).collect();
            E::execute(tx, &insert.text(chunk.len()), &bound)
                .await
                .map_err(|e| store_error::<E>("enqueuing outgoing messages", e))?;
        }
        if let (Some(notify), false) = (&self.osql.notify, messages.is_empty()) {
            E::execute(tx, &notify.sql, &[])
                .await
                .map_err(|e| store_error::<E>("notifying relays of the outbox", e))?;
        }
        Ok(())
    }
}

impl<E: Engine> RelayStore for SqlStore<E> {
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
        let err = |e| store_error::<E>("marking outbox rows sent", e);
        let mark = &self.osql.mark_sent;
        let mut marked = 0;
        // Where the engine has a relay transaction (PostgreSQL: its commit does not wait for
        // the disk), the mark runs in one; a mark lost in a crash only publishes its rows
        // again under the same IDs. Elsewhere each chunk commits on its own.
        let mut tx = match self.osql.relay_begin {
            Some(_) => Some(self.begin_relay().await?),
            None => None,
        };
        for chunk in seqs.chunks(SEQ_CHUNK) {
            let v = Values {
                relay,
                seqs: chunk,
                now: Self::outbox_now(),
                ..Values::default()
            };
            let (sql, bound) = (mark.text(chunk.len()), params(mark, &v));
            marked += match tx.as_mut() {
                Some(tx) => E::execute(tx, &sql, &bound).await.map_err(err)?,
                None => E::execute_pool(&self.pool, &sql, &bound)
                    .await
                    .map_err(err)?,
            };
        }
        if let Some(tx) = tx {
            tx.commit().await.map_err(commit_error::<E>)?;
        }
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
            now: Self::outbox_now(),
            ..Values::default()
        };
        let released = E::execute_pool(&self.pool, &release.sql, &params(release, &v))
            .await
            .map_err(|e| store_error::<E>("releasing an outbox row", e))?;
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
        let mut tx = self.begin_relay().await?;
        if self
            .move_to_dead_letters(&mut tx, relay, seq, reason)
            .await?
        {
            tx.commit().await.map_err(commit_error::<E>)
        } else {
            tracing::debug!(
                relay,
                seq,
                "outbox row not dead-lettered: no longer leased to this relay"
            );
            tx.rollback()
                .await
                .map_err(|e| store_error::<E>("rollback", e))
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
        E::execute_pool(&self.pool, &purge.sql, &params(purge, &v))
            .await
            .map_err(|e| store_error::<E>("purging sent outbox rows", e))
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let read = &self.osql.backlog;
        let v = Values {
            now: Self::outbox_now(),
            ..Values::default()
        };
        let (unsent, oldest, sent, dead, now) =
            E::fetch_backlog(&self.pool, &read.sql, &params(read, &v))
                .await
                .map_err(|e| store_error::<E>("reading the outbox backlog", e))?;
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
