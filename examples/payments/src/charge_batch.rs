//! The set handler: a whole batch's charges in two statements (every `charges` row in one
//! insert, every touched balance in one upsert), for the consumer's peak-throughput mode
//! (`--set`). Same effects as [`Charge`](crate::ledger::Charge) applied message by message.

use std::collections::BTreeMap;

use idem_consumer::SetHandler;
use idem_core::{BoxError, Identified, Message};
use idem_sql::{MySqlStore, PostgresStore, PostgresTx, SqliteStore, Tx};
use sqlx::{MySql, QueryBuilder, Sqlite};

use crate::ledger::{Emit, PaymentRequested};

/// Charges a batch of accounts at once; with `--emit`, one `PaymentCharged` per message in the
/// outbox, in one insert per message.
#[derive(Debug, Clone)]
pub(crate) struct ChargeBatch<S> {
    pub(crate) emit: Option<Emit<S>>,
}

impl<S> ChargeBatch<S> {
    /// Charges only.
    pub(crate) fn plain() -> Self {
        Self { emit: None }
    }
}

/// Validates every payment (one invalid message fails the set; the runner then handles the
/// batch message by message, which dead-letters just that one) and sums the amounts per
/// account. The map is ordered, so balances are locked in account order: two concurrent
/// batches touching the same accounts wait for each other instead of deadlocking.
fn balances<'a>(
    payments: impl IntoIterator<Item = &'a PaymentRequested>,
) -> Result<BTreeMap<&'a str, i64>, BoxError> {
    let mut sums = BTreeMap::new();
    for p in payments {
        p.validate()?;
        let sum: &mut i64 = sums.entry(p.account.as_str()).or_default();
        *sum = sum
            .checked_add(p.amount_cents)
            .ok_or_else(|| idem_core::Error::reject("batch total overflows a 64-bit balance"))?;
    }
    Ok(sums)
}

impl SetHandler<Tx<Sqlite>, PaymentRequested> for ChargeBatch<SqliteStore> {
    type Output = ();

    async fn handle_set(
        &self,
        tx: &mut Tx<Sqlite>,
        msgs: &[&Message<PaymentRequested>],
    ) -> Result<(), BoxError> {
        let sums = balances(msgs.iter().map(|m| m.payload()))?;
        let mut charges =
            QueryBuilder::<Sqlite>::new("INSERT INTO charges (message_id, account, amount_cents) ");
        charges.push_values(msgs, |mut row, m| {
            row.push_bind(m.message_id().to_string())
                .push_bind(m.payload().account.clone())
                .push_bind(m.payload().amount_cents);
        });
        charges.build().execute(&mut **tx).await?;
        let mut accounts =
            QueryBuilder::<Sqlite>::new("INSERT INTO accounts (account, balance_cents) ");
        accounts.push_values(&sums, |mut row, (account, sum)| {
            row.push_bind(account.to_string()).push_bind(*sum);
        });
        accounts.push(
            " ON CONFLICT (account) DO UPDATE SET balance_cents = balance_cents + excluded.balance_cents",
        );
        accounts.build().execute(&mut **tx).await?;
        crate::ledger::emit_all(&self.emit, tx, msgs).await
    }
}

impl SetHandler<PostgresTx, PaymentRequested> for ChargeBatch<PostgresStore> {
    type Output = ();

    /// See [`charge_set_postgres`].
    async fn handle_set(
        &self,
        tx: &mut PostgresTx,
        msgs: &[&Message<PaymentRequested>],
    ) -> Result<(), BoxError> {
        let ids: Vec<String> = msgs.iter().map(|m| m.message_id().to_string()).collect();
        let payments: Vec<&PaymentRequested> = msgs.iter().map(|m| m.payload()).collect();
        charge_set_postgres(tx, ids, &payments).await?;
        crate::ledger::emit_all(&self.emit, tx, msgs).await
    }
}

/// The set's effect on PostgreSQL, `ChargeBatch`'s and the bench's bare consumer's (which has
/// no claim and no `Message`): every charge row in one insert, every touched balance in one
/// upsert. `ids[i]` is `payments[i]`'s message ID.
///
/// Arrays bound once each (`unnest`): the statement text is the same for every batch size,
/// so it is prepared once.
pub(crate) async fn charge_set_postgres(
    conn: &mut sqlx::PgConnection,
    ids: Vec<String>,
    payments: &[&PaymentRequested],
) -> Result<(), BoxError> {
    let sums = balances(payments.iter().copied())?;
    let accounts: Vec<&str> = payments.iter().map(|p| p.account.as_str()).collect();
    let amounts: Vec<i64> = payments.iter().map(|p| p.amount_cents).collect();
    sqlx::query(
        "INSERT INTO charges (message_id, account, amount_cents)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
    )
    .bind(&ids)
    .bind(&accounts)
    .bind(&amounts)
    .execute(&mut *conn)
    .await?;
    let (names, totals): (Vec<&str>, Vec<i64>) = sums.into_iter().unzip();
    sqlx::query(
        "INSERT INTO accounts (account, balance_cents)
         SELECT * FROM unnest($1::text[], $2::bigint[])
         ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
    )
    .bind(&names)
    .bind(&totals)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl SetHandler<Tx<MySql>, PaymentRequested> for ChargeBatch<MySqlStore> {
    type Output = ();

    async fn handle_set(
        &self,
        tx: &mut Tx<MySql>,
        msgs: &[&Message<PaymentRequested>],
    ) -> Result<(), BoxError> {
        let sums = balances(msgs.iter().map(|m| m.payload()))?;
        // Bytes for the VARBINARY columns, as `Charge` binds them.
        let mut charges =
            QueryBuilder::<MySql>::new("INSERT INTO charges (message_id, account, amount_cents) ");
        charges.push_values(msgs, |mut row, m| {
            row.push_bind(m.message_id().as_bytes().to_vec())
                .push_bind(m.payload().account.as_bytes().to_vec())
                .push_bind(m.payload().amount_cents);
        });
        charges.build().execute(&mut **tx).await?;
        let mut accounts =
            QueryBuilder::<MySql>::new("INSERT INTO accounts (account, balance_cents) ");
        accounts.push_values(&sums, |mut row, (account, sum)| {
            row.push_bind(account.as_bytes().to_vec()).push_bind(*sum);
        });
        accounts
            .push(" ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)");
        accounts.build().execute(&mut **tx).await?;
        crate::ledger::emit_all(&self.emit, tx, msgs).await
    }
}
