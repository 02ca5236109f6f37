//! The capability impls whose code is the same on every engine — transactions, the single
//! claim, savepoints, bounded pruning, stats — generated once per store from the engine-specific
//! pieces each store module provides: `begin_tx`, `claim_on`, and its `sql` statements.

/// Implements the low-level `claim_on` and `TransactionalStore`, `ClaimStore`, `Savepoints`,
/// `Prune` and `Stats` for a store struct with fields `pool` and `sql` (with `claim`,
/// `read_fingerprint`, `prune_all`, `prune_consumer`, `stats`; prune parameters are bound in the
/// order now, older-than, [consumer,] limit) and an inherent `begin_tx()`. `$stamp` turns a
/// [`Stamp`](idem_core::Stamp) into the bound `processed_at` / prune `now`: `None` makes the
/// statement read the server's clock.
macro_rules! impl_sql_capabilities {
    ($store:ty, $db:ty, $tx:ty, $max_id_len:expr, $stamp:path) => {
        impl $store {
            /// The claim on a connection inside a transaction the caller began (see
            /// `begin_tx`). `None`: inserted now; `Some(fp)`: already claimed with
            /// fingerprint `fp`.
            ///
            /// One insert that cannot race; it reports exactly one affected row when this
            /// transaction inserted the claim (see the module docs for each engine's statement).
            pub async fn claim_on(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                claim: idem_core::ClaimRequest<'_>,
            ) -> Result<Option<idem_core::Fingerprint>, idem_core::Error> {
                let inserted = sqlx::query(&self.sql.claim)
                    .bind(claim.consumer.as_str())
                    .bind(claim.id.as_bytes())
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind($stamp(claim.at))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| $crate::errors::store_error("claim", e))?
                    .rows_affected();
                if inserted == 1 {
                    return Ok(None);
                }
                let row: Option<Vec<u8>> = sqlx::query_scalar(&self.sql.read_fingerprint)
                    .bind(claim.consumer.as_str())
                    .bind(claim.id.as_bytes())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| {
                        $crate::errors::store_error("reading the stored fingerprint", e)
                    })?;
                $crate::common::stored_fingerprint(row)
            }
        }

        impl idem_core::TransactionalStore for $store {
            type Tx = $tx;

            async fn begin(&self) -> Result<Self::Tx, idem_core::Error> {
                self.begin_tx().await
            }

            async fn commit(&self, tx: Self::Tx) -> Result<(), idem_core::Error> {
                tx.commit().await.map_err($crate::errors::commit_error)
            }

            async fn rollback(&self, tx: Self::Tx) -> Result<(), idem_core::Error> {
                tx.rollback()
                    .await
                    .map_err(|e| $crate::errors::store_error("rollback", e))
            }

            fn classify(
                &self,
                error: &(dyn std::error::Error + 'static),
            ) -> Option<idem_core::ErrorKind> {
                $crate::errors::classify(error)
            }
        }

        impl idem_core::ClaimStore for $store {
            fn max_message_id_len(&self) -> usize {
                $max_id_len
            }

            async fn claim(
                &self,
                tx: &mut Self::Tx,
                claim: idem_core::ClaimRequest<'_>,
            ) -> Result<Option<idem_core::Fingerprint>, idem_core::Error> {
                self.claim_on(tx, claim).await
            }
        }

        impl idem_core::Savepoints for $store {
            async fn savepoint(&self, tx: &mut Self::Tx) -> Result<(), idem_core::Error> {
                $crate::capabilities::exec::<$db>(tx, "SAVEPOINT idem_message").await
            }

            async fn release_savepoint(&self, tx: &mut Self::Tx) -> Result<(), idem_core::Error> {
                $crate::capabilities::exec::<$db>(tx, "RELEASE SAVEPOINT idem_message").await
            }

            async fn rollback_to_savepoint(
                &self,
                tx: &mut Self::Tx,
            ) -> Result<(), idem_core::Error> {
                // ROLLBACK TO keeps the savepoint; release it so savepoints do not pile up.
                $crate::capabilities::exec::<$db>(tx, "ROLLBACK TO SAVEPOINT idem_message").await?;
                $crate::capabilities::exec::<$db>(tx, "RELEASE SAVEPOINT idem_message").await
            }
        }

        impl idem_core::Prune for $store {
            async fn prune_batch(
                &self,
                consumer: Option<&idem_core::ConsumerName>,
                now: idem_core::Stamp,
                older_than: std::time::Duration,
                limit: u32,
            ) -> Result<u64, idem_core::Error> {
                let limit = i64::from(limit);
                let (now, older_than) = ($stamp(now), $crate::common::micros(older_than));
                let q = match consumer {
                    None => sqlx::query(&self.sql.prune_all)
                        .bind(now)
                        .bind(older_than)
                        .bind(limit),
                    Some(c) => sqlx::query(&self.sql.prune_consumer)
                        .bind(now)
                        .bind(older_than)
                        .bind(c.as_str())
                        .bind(limit),
                };
                q.execute(&self.pool)
                    .await
                    .map(|r| r.rows_affected())
                    .map_err(|e| $crate::errors::store_error("prune", e))
            }
        }

        impl idem_core::Stats for $store {
            async fn stats(&self) -> Result<Vec<idem_core::ConsumerStats>, idem_core::Error> {
                let rows = sqlx::query(&self.sql.stats)
                    .fetch_all(&self.pool)
                    .await
                    .map_err(|e| $crate::errors::store_error("stats", e))?;
                rows.iter()
                    .map($crate::common::stats_row)
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(|e| $crate::errors::store_error("stats", e))
            }
        }
    };
}

pub(crate) use impl_sql_capabilities;

/// Runs a fixed statement on the transaction's connection.
pub(crate) async fn exec<DB: sqlx::Database>(
    conn: &mut DB::Connection,
    sql: &'static str,
) -> Result<(), idem_core::Error>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    sqlx::query::<DB>(sql)
        .execute(conn)
        .await
        .map(drop)
        .map_err(|e| crate::errors::store_error(sql, e))
}
