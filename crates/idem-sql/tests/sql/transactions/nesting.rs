//! A handler that begins a transaction of its own on `&mut **tx` — the `Acquire` helper
//! pattern — gets a savepoint, as inside a `sqlx::Transaction`: its `commit()` commits nothing
//! yet, a later failure rolls all of it back with the claim (and the redelivery is processed,
//! not a duplicate), and a nested rollback or drop undoes only the nested part. The same on
//! every engine, on the pool and on held connections, per message and in a batch; afterwards
//! the application's own `pool.begin()` still finds its connections outside any transaction.

use std::sync::atomic::{AtomicBool, Ordering};

use idem_core::{BoxError, Handler, Message, MessageId, Outcome, Processor};
use sqlx::{Acquire, TransactionManager};

use super::fixture::Fx;

fn msg(id: &str, payload: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), payload.as_bytes().to_vec())
}

macro_rules! nesting_tests {
    ($engine:ident, $db:ty, $setup:ident) => {
        mod $engine {
            use super::*;

            type Db = $db;
            type Conn = <Db as sqlx::Database>::Connection;
            type Tx = idem_sql::Tx<Db>;

            async fn insert(conn: &mut Conn, k: &str) -> Result<(), sqlx::Error> {
                sqlx::query(&format!("INSERT INTO effects (k) VALUES ('{k}')"))
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn count(fx: &Fx<Db>, k: &str) -> i64 {
                sqlx::query_scalar(&format!("SELECT COUNT(*) FROM effects WHERE k = '{k}'"))
                    .fetch_one(&fx.observer)
                    .await
                    .expect("count effects")
            }

            async fn all_effects(fx: &Fx<Db>) -> i64 {
                sqlx::query_scalar("SELECT COUNT(*) FROM effects")
                    .fetch_one(&fx.observer)
                    .await
                    .expect("count effects")
            }

            async fn claims(fx: &Fx<Db>) -> i64 {
                sqlx::query_scalar("SELECT COUNT(*) FROM idem_processed")
                    .fetch_one(&fx.observer)
                    .await
                    .expect("count claims")
            }

            /// While the handler runs, from outside: nothing of its transaction is committed.
            async fn nothing_committed_yet(fx: &Fx<Db>) {
                assert_eq!(
                    (claims(fx).await, all_effects(fx).await),
                    (0, 0),
                    "a nested commit or rollback commits nothing of the outer transaction"
                );
            }

            /// The application's own transaction on the pool idem shares: its connection is at
            /// depth 0 (a `BEGIN`, not a `SAVEPOINT`), and a nested one in it works too.
            async fn application_transaction_works(fx: &Fx<Db>) {
                {
                    let conn = fx.store.pool().acquire().await.expect("acquire");
                    let depth =
                        <Db as sqlx::Database>::TransactionManager::get_transaction_depth(&conn);
                    assert_eq!(
                        depth, 0,
                        "a pooled connection rests outside any transaction"
                    );
                }
                let mut tx = fx
                    .store
                    .pool()
                    .begin()
                    .await
                    .expect("the application begins a transaction");
                insert(&mut tx, "app").await.expect("app insert");
                let mut nested = tx.begin().await.expect("the application nests");
                insert(&mut nested, "app-nested")
                    .await
                    .expect("nested insert");
                nested.commit().await.expect("release");
                tx.commit().await.expect("the application commits");
                assert_eq!(
                    (count(fx, "app").await, count(fx, "app-nested").await),
                    (1, 1)
                );
            }

            async fn commit_then_failure(test: &str, held: bool) {
                let Some(fx) = Fx::<Db>::$setup(test, held).await else {
                    return;
                };
                let p = Processor::builder(fx.store.clone(), "nesting")
                    .build()
                    .expect("processor");
                let m = msg("m-1", "x");
                let nested_committed = AtomicBool::new(false);
                let failed = p
                    .process(&m, async |tx| {
                        insert(tx, "outer-1").await?;
                        let mut inner = (&mut **tx).begin().await?;
                        insert(&mut inner, "inner").await?;
                        inner.commit().await?;
                        nested_committed.store(true, Ordering::SeqCst);
                        nothing_committed_yet(&fx).await;
                        insert(tx, "outer-2").await?;
                        Err::<(), BoxError>("the handler fails after its nested commit".into())
                    })
                    .await;
                assert!(failed.is_err(), "{failed:?}");
                assert!(
                    nested_committed.load(Ordering::SeqCst),
                    "the nested transaction began and committed: {failed:?}"
                );
                assert_eq!(
                    all_effects(&fx).await,
                    0,
                    "nothing of the failed handler is committed"
                );
                assert_eq!(claims(&fx).await, 0, "nor its claim");

                let again = p
                    .process(&m, async |tx| insert(tx, "redelivered").await)
                    .await;
                assert!(
                    matches!(again, Ok(Outcome::Processed(()))),
                    "the redelivery is processed, not a duplicate: {again:?}"
                );
                assert_eq!((all_effects(&fx).await, claims(&fx).await), (1, 1));
                application_transaction_works(&fx).await;
                fx.teardown().await;
            }

            async fn rollback_and_drop(test: &str, held: bool) {
                let Some(fx) = Fx::<Db>::$setup(test, held).await else {
                    return;
                };
                let p = Processor::builder(fx.store.clone(), "nesting")
                    .build()
                    .expect("processor");
                let m = msg("m-1", "x");
                let done = p
                    .process(&m, async |tx| {
                        insert(tx, "outer-1").await?;
                        let mut inner = (&mut **tx).begin().await?;
                        insert(&mut inner, "rolled-back").await?;
                        inner.rollback().await?;
                        {
                            let mut dropped = (&mut **tx).begin().await?;
                            insert(&mut dropped, "dropped").await?;
                        }
                        insert(tx, "outer-2").await?;
                        nothing_committed_yet(&fx).await;
                        Ok::<_, BoxError>(())
                    })
                    .await;
                assert!(matches!(done, Ok(Outcome::Processed(()))), "{done:?}");
                assert_eq!(
                    [
                        count(&fx, "outer-1").await,
                        count(&fx, "outer-2").await,
                        count(&fx, "rolled-back").await,
                        count(&fx, "dropped").await,
                    ],
                    [1, 1, 0, 0],
                    "the outer writes commit, the nested ones rolled back or dropped do not"
                );
                assert_eq!(claims(&fx).await, 1);
                let again = p.process(&m, async |tx| insert(tx, "twice").await).await;
                assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
                application_transaction_works(&fx).await;
                fx.teardown().await;
            }

            /// Per message of a batch: nests and commits, writes again, and fails when its
            /// payload says so.
            struct Nests;

            impl Handler<Tx, Vec<u8>> for Nests {
                type Output = ();

                async fn handle(
                    &self,
                    tx: &mut Tx,
                    msg: &Message<Vec<u8>>,
                ) -> Result<(), BoxError> {
                    let key = String::from_utf8_lossy(msg.payload()).into_owned();
                    let mut inner = (&mut **tx).begin().await?;
                    insert(&mut inner, &format!("{key}-inner")).await?;
                    inner.commit().await?;
                    insert(tx, &format!("{key}-outer")).await?;
                    if key.starts_with("fail") {
                        return Err("this message fails after its nested commit".into());
                    }
                    Ok(())
                }
            }

            async fn batch(test: &str, held: bool) {
                let Some(fx) = Fx::<Db>::$setup(test, held).await else {
                    return;
                };
                let p = Processor::builder(fx.store.clone(), "nesting")
                    .build()
                    .expect("processor");
                let msgs = [msg("b-1", "ok-1"), msg("b-2", "fail-2"), msg("b-3", "ok-3")];
                let results = p.process_batch(&msgs, &Nests).await.expect("batch");
                assert!(
                    matches!(results[0], Ok(Outcome::Processed(()))),
                    "{results:?}"
                );
                assert!(results[1].is_err(), "{results:?}");
                assert!(
                    matches!(results[2], Ok(Outcome::Processed(()))),
                    "{results:?}"
                );
                assert_eq!(
                    [
                        count(&fx, "ok-1-inner").await,
                        count(&fx, "ok-1-outer").await,
                        count(&fx, "ok-3-inner").await,
                        count(&fx, "ok-3-outer").await,
                        count(&fx, "fail-2-inner").await,
                        count(&fx, "fail-2-outer").await,
                    ],
                    [1, 1, 1, 1, 0, 0],
                    "the failed message's writes, nested ones included, are gone"
                );
                assert_eq!(claims(&fx).await, 2, "the failed message is not claimed");
                let again = p
                    .process(&msgs[1], async |tx| insert(tx, "fail-2-redelivered").await)
                    .await;
                assert!(
                    matches!(again, Ok(Outcome::Processed(()))),
                    "the failed message's redelivery is processed: {again:?}"
                );
                application_transaction_works(&fx).await;
                fx.teardown().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pooled_nested_commit_then_failure_commits_nothing() {
                commit_then_failure(
                    concat!(stringify!($engine), "_pooled_nested_commit_then_failure"),
                    false,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn held_nested_commit_then_failure_commits_nothing() {
                commit_then_failure(
                    concat!(stringify!($engine), "_held_nested_commit_then_failure"),
                    true,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pooled_nested_rollback_and_drop_keep_the_outer() {
                rollback_and_drop(
                    concat!(stringify!($engine), "_pooled_nested_rollback_and_drop"),
                    false,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn held_nested_rollback_and_drop_keep_the_outer() {
                rollback_and_drop(
                    concat!(stringify!($engine), "_held_nested_rollback_and_drop"),
                    true,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pooled_batch_with_nesting_isolates_the_failure() {
                batch(concat!(stringify!($engine), "_pooled_batch_nesting"), false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn held_batch_with_nesting_isolates_the_failure() {
                batch(concat!(stringify!($engine), "_held_batch_nesting"), true).await;
            }
        }
    };
}

nesting_tests!(sqlite, sqlx::Sqlite, sqlite);
nesting_tests!(postgres, sqlx::Postgres, postgres);
nesting_tests!(mysql, sqlx::MySql, mysql);
