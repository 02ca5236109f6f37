//! The completer against real stores: SQLite always, PostgreSQL and MySQL from
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` (each test on its own schema or database;
//! `SKIPPING` when unset). A "crash" is an operation whose second phase never returns on its
//! first attempt: its future is dropped there, after the first phase's boundary committed, and
//! its short lease runs out.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::{BoxError, IdempotencyKey, Migrate, RequestScope};
use idem_request::{Completer, Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};

const SHORT: Duration = Duration::from_millis(500);
const PAST_SHORT: Duration = Duration::from_millis(800);

#[derive(Debug, Serialize, Deserialize)]
enum Phase {
    /// Local: effect `<key>/reserve`.
    Reserve,
    /// Foreign: never returns on the first attempt (the crash); fails always for `fail-` keys.
    Charge,
    /// Local: effect `<key>/record`, then done.
    Record,
}

fn scope() -> RequestScope {
    RequestScope::new(["create_order"])
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).expect("valid key")
}

macro_rules! completer_tests {
    ($backend:ident, $store:ty, $ph:literal, $setup:expr) => {
        mod $backend {
            use super::*;

            type S = $store;

            async fn effect(
                tx: &mut <S as idem_core::TransactionalStore>::Tx,
                what: String,
            ) -> Result<(), BoxError> {
                sqlx::query(concat!("INSERT INTO effects (what) VALUES (", $ph, ")"))
                    .bind(what)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            async fn count(store: &S, what: &str) -> i64 {
                sqlx::query_scalar(concat!("SELECT count(*) FROM effects WHERE what = ", $ph))
                    .bind(what)
                    .fetch_one(store.pool())
                    .await
                    .expect("count effects")
            }

            /// The operation's one step function: the caller's and the completer's.
            async fn step(
                phase: Phase,
                ctx: &mut PhaseCtx<S>,
            ) -> Result<Step<Phase, String>, BoxError> {
                let k = ctx.key().key.as_str().to_owned();
                Ok(match phase {
                    Phase::Reserve => {
                        effect(ctx.tx(), format!("{k}/reserve")).await?;
                        Step::Next(Phase::Charge)
                    }
                    Phase::Charge => {
                        if k.starts_with("fail-") {
                            return Err("the processor refuses".into());
                        }
                        if ctx.attempt() == 1 {
                            std::future::pending::<()>().await;
                        }
                        Step::Next(Phase::Record)
                    }
                    Phase::Record => {
                        effect(ctx.tx(), format!("{k}/record")).await?;
                        Step::Done(format!("done {k}"))
                    }
                })
            }

            fn idem(store: &S) -> Idempotency<S> {
                Idempotency::builder(store.clone())
                    .lease(SHORT)
                    .without_heartbeat()
                    .build()
                    .expect("idempotency")
            }

            fn completer(store: &S, gave_up: Arc<AtomicU32>) -> Completer<S> {
                let idem = Idempotency::builder(store.clone())
                    .lease(SHORT)
                    .build()
                    .expect("idempotency");
                Completer::builder(idem)
                    .max_attempts(2)
                    .operation(
                        scope(),
                        "create_order",
                        |idem: Idempotency<S>, stuck| async move {
                            idem.resume_phases(stuck, step).await.map(drop)
                        },
                        move |execution: idem_request::Execution<S>, _recovery| {
                            let gave_up = Arc::clone(&gave_up);
                            async move {
                                let k = execution.key().key.as_str().to_owned();
                                execution
                                    .give_up(b"\"refunded\"", async |tx| {
                                        gave_up.fetch_add(1, Ordering::SeqCst);
                                        effect(tx, format!("{k}/refund")).await
                                    })
                                    .await
                            }
                        },
                    )
                    .build()
                    .expect("completer")
            }

            /// Runs the operation of `k` until it crashes in its second phase.
            async fn crash(store: &S, k: &str) {
                let (idem, key) = (idem(store), key(k));
                let run =
                    idem.run_phases::<_, _, String, _, _>(scope(), &key, &(), Phase::Reserve, step);
                let r = tokio::time::timeout(Duration::from_millis(200), run).await;
                assert!(r.is_err(), "the first attempt must hang in Charge");
            }

            #[tokio::test]
            async fn a_crashed_operation_is_finished_once() {
                let Some((store, _guard)) = $setup("completer_crash").await else {
                    return;
                };
                crash(&store, "k1").await;
                assert_eq!(count(&store, "k1/reserve").await, 1);
                tokio::time::sleep(PAST_SHORT).await;
                let c = completer(&store, Arc::default());
                assert_eq!(c.pass().await.expect("pass"), 1);
                assert_eq!(
                    c.pass().await.expect("pass"),
                    0,
                    "a finished operation is not stuck"
                );
                let stats = c.stats();
                assert_eq!(
                    (
                        stats.stuck_seen,
                        stats.resumed,
                        stats.failed,
                        stats.abandoned
                    ),
                    (1, 1, 0, 0)
                );
                assert_eq!(
                    count(&store, "k1/reserve").await,
                    1,
                    "a committed phase never runs again"
                );
                assert_eq!(count(&store, "k1/record").await, 1);
                // A retry replays the completer's response without running a phase.
                let replay: String = idem(&store)
                    .run_phases(
                        scope(),
                        &key("k1"),
                        &(),
                        Phase::Reserve,
                        async |_: Phase, _: &mut PhaseCtx<S>| {
                            Err::<Step<Phase, String>, _>("must not run")
                        },
                    )
                    .await
                    .expect("replay");
                assert_eq!(replay, "done k1");
            }

            #[tokio::test]
            async fn two_completers_finish_each_operation_once() {
                let Some((store, _guard)) = $setup("completer_two").await else {
                    return;
                };
                let keys: Vec<String> = (0..6).map(|i| format!("two-{i}")).collect();
                for k in &keys {
                    crash(&store, k).await;
                }
                tokio::time::sleep(PAST_SHORT).await;
                let (a, b) = (
                    completer(&store, Arc::default()),
                    completer(&store, Arc::default()),
                );
                let (ra, rb) = tokio::join!(a.pass(), b.pass());
                let (ra, rb) = (ra.expect("pass a"), rb.expect("pass b"));
                assert_eq!(
                    ra + rb,
                    keys.len(),
                    "each stuck operation taken by one completer"
                );
                assert_eq!(a.stats().resumed + b.stats().resumed, keys.len() as u64);
                for k in &keys {
                    assert_eq!(count(&store, &format!("{k}/record")).await, 1, "{k}");
                    assert_eq!(count(&store, &format!("{k}/reserve")).await, 1, "{k}");
                }
            }

            #[tokio::test]
            async fn an_operation_out_of_attempts_is_given_up_once() {
                let Some((store, _guard)) = $setup("completer_abandon").await else {
                    return;
                };
                let err = idem(&store)
                    .run_phases::<_, _, String, _, _>(
                        scope(),
                        &key("fail-1"),
                        &(),
                        Phase::Reserve,
                        step,
                    )
                    .await;
                assert!(err.is_err(), "Charge fails");
                let gave_up = Arc::new(AtomicU32::new(0));
                let c = completer(&store, Arc::clone(&gave_up));
                // Attempt 2 (the completer's first) resumes and fails; attempt 3 gives up.
                for _ in 0..2 {
                    tokio::time::sleep(PAST_SHORT).await;
                    assert_eq!(c.pass().await.expect("pass"), 1);
                }
                tokio::time::sleep(PAST_SHORT).await;
                assert_eq!(
                    c.pass().await.expect("pass"),
                    0,
                    "an abandoned operation is not stuck"
                );
                let stats = c.stats();
                assert_eq!((stats.failed, stats.abandoned, stats.resumed), (1, 1, 0));
                assert_eq!(gave_up.load(Ordering::SeqCst), 1);
                assert_eq!(count(&store, "fail-1/refund").await, 1);
                assert_eq!(count(&store, "fail-1/reserve").await, 1);
                let replay: String = idem(&store)
                    .run_phases(scope(), &key("fail-1"), &(), Phase::Reserve, step)
                    .await
                    .expect("replay");
                assert_eq!(replay, "refunded");
            }

            #[tokio::test]
            async fn a_live_operation_is_not_touched() {
                let Some((store, _guard)) = $setup("completer_live").await else {
                    return;
                };
                // Held with a heartbeat well past its lease while the completer passes.
                let live = Idempotency::builder(store.clone())
                    .lease(SHORT)
                    .build()
                    .expect("idempotency");
                let c = completer(&store, Arc::default());
                let slow = async |phase: Phase,
                                  ctx: &mut PhaseCtx<S>|
                       -> Result<Step<Phase, String>, BoxError> {
                    if let Phase::Reserve = phase {
                        effect(ctx.tx(), "live/reserve".into()).await?;
                        return Ok(Step::Next(Phase::Charge));
                    }
                    tokio::time::sleep(PAST_SHORT * 2).await;
                    Ok(Step::Done("live".into()))
                };
                let passes = async {
                    tokio::time::sleep(PAST_SHORT).await;
                    let first = c.pass().await.expect("pass");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    first + c.pass().await.expect("pass")
                };
                let live_key = key("live");
                let (done, taken) = tokio::join!(
                    live.run_phases(scope(), &live_key, &(), Phase::Reserve, slow),
                    passes
                );
                assert_eq!(done.expect("the live operation finishes"), "live");
                assert_eq!(taken, 0);
                assert_eq!(c.stats().stuck_seen, 0);
            }

            #[tokio::test]
            async fn run_finishes_stuck_operations_until_shutdown() {
                let Some((store, _guard)) = $setup("completer_run").await else {
                    return;
                };
                crash(&store, "run-1").await;
                tokio::time::sleep(PAST_SHORT).await;
                let c = completer(&store, Arc::default());
                let shutdown = tokio_util::sync::CancellationToken::new();
                let task = tokio::spawn(c.clone().run(shutdown.clone()));
                for _ in 0..50 {
                    if c.stats().resumed == 1 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                shutdown.cancel();
                let stats = tokio::time::timeout(Duration::from_secs(5), task)
                    .await
                    .expect("stops on shutdown")
                    .expect("no panic");
                assert_eq!((stats.resumed, stats.failed, stats.outages), (1, 0, 0));
                assert_eq!(count(&store, "run-1/record").await, 1);
            }

            #[tokio::test]
            async fn a_refusing_store_is_an_outage_not_a_failure() {
                let Some((store, _guard)) = $setup("completer_outage").await else {
                    return;
                };
                let missing = store
                    .clone()
                    .with_requests_table(
                        idem_sql::TableName::new("no_such_requests").expect("name"),
                    )
                    .expect("table");
                let c = completer(&missing, Arc::default());
                assert!(c.pass().await.is_err(), "the table is missing");
                let shutdown = tokio_util::sync::CancellationToken::new();
                let task = tokio::spawn(c.clone().run(shutdown.clone()));
                tokio::time::sleep(Duration::from_millis(300)).await;
                shutdown.cancel();
                let stats = tokio::time::timeout(Duration::from_secs(5), task)
                    .await
                    .expect("stops on shutdown")
                    .expect("no panic");
                assert!(stats.outages >= 2, "{stats:?}");
                assert_eq!((stats.passes, stats.failed, stats.abandoned), (0, 0, 0));
            }

            #[tokio::test]
            async fn a_store_failing_under_an_operation_stops_the_pass_as_an_outage() {
                let Some((store, _guard)) = $setup("completer_midoutage").await else {
                    return;
                };
                crash(&store, "mid-1").await;
                crash(&store, "mid-2").await;
                tokio::time::sleep(PAST_SHORT).await;
                let calls = Arc::new(AtomicU32::new(0));
                let seen = Arc::clone(&calls);
                let idem2 = Idempotency::builder(store.clone())
                    .lease(SHORT)
                    .build()
                    .expect("idempotency");
                let c = Completer::builder(idem2)
                    .max_attempts(5)
                    .operation(
                        scope(),
                        "create_order",
                        move |_: Idempotency<S>, _stuck| {
                            seen.fetch_add(1, Ordering::SeqCst);
                            async {
                                Err(idem_core::Error::new(
                                    idem_core::ErrorKind::Unavailable,
                                    "the database went away",
                                ))
                            }
                        },
                        |_: idem_request::Execution<S>, _| async {
                            panic!("never given up for an outage")
                        },
                    )
                    .build()
                    .expect("completer");
                assert!(c.pass().await.is_err(), "an outage, not a pass");
                let stats = c.stats();
                assert_eq!(
                    calls.load(Ordering::SeqCst),
                    1,
                    "the pass stops at the first"
                );
                assert_eq!((stats.outages, stats.failed, stats.abandoned), (1, 0, 0));
                assert_eq!(
                    count(&store, "mid-1/record").await + count(&store, "mid-2/record").await,
                    0
                );
            }

            #[tokio::test]
            async fn an_unknown_operation_is_left_alone() {
                let Some((store, _guard)) = $setup("completer_unknown").await else {
                    return;
                };
                let other = RequestScope::new(["another_operation"]);
                let (idem1, k1) = (idem(&store), key("u1"));
                let run =
                    idem1.run_phases::<_, _, String, _, _>(other, &k1, &(), Phase::Reserve, step);
                assert!(
                    tokio::time::timeout(Duration::from_millis(200), run)
                        .await
                        .is_err()
                );
                tokio::time::sleep(PAST_SHORT).await;
                let gave_up = Arc::new(AtomicU32::new(0));
                let c = completer(&store, Arc::clone(&gave_up));
                for _ in 0..4 {
                    c.pass().await.expect("pass");
                    tokio::time::sleep(PAST_SHORT).await;
                }
                let stats = c.stats();
                assert!(stats.unknown >= 1, "{stats:?}");
                assert_eq!((stats.resumed, stats.abandoned, stats.failed), (0, 0, 0));
                assert_eq!(gave_up.load(Ordering::SeqCst), 0);
                assert_eq!(count(&store, "u1/record").await, 0);
                // Still resumable by a completer that knows it.
                let idem2 = Idempotency::builder(store.clone())
                    .lease(SHORT)
                    .build()
                    .expect("idempotency");
                let knows = Completer::builder(idem2)
                    .max_attempts(100)
                    .operation(
                        other,
                        "another_operation",
                        |idem: Idempotency<S>, stuck| async move {
                            idem.resume_phases(stuck, step).await.map(drop)
                        },
                        |execution: idem_request::Execution<S>, _| async move {
                            execution
                                .give_up(b"null", async |_| Ok::<(), BoxError>(()))
                                .await
                        },
                    )
                    .build()
                    .expect("completer");
                assert_eq!(knows.pass().await.expect("pass"), 1);
                assert_eq!(knows.stats().resumed, 1);
                assert_eq!(count(&store, "u1/record").await, 1);
            }
        }
    };
}

async fn sqlite(_test: &str) -> Option<(idem_sql::SqliteStore, tempfile::TempDir)> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store =
        idem_sql::SqliteStore::open(dir.path().join("c.db"), idem_sql::SqliteOptions::default())
            .await
            .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    Some((store, dir))
}

async fn postgres(
    test: &str,
) -> Option<(idem_sql::PostgresStore, idem_testkit::isolated::PgSchema)> {
    let schema = idem_testkit::isolated::PgSchema::create("idem_cmp", test).await?;
    let store = idem_sql::PostgresStore::from_pool(schema.pool(10).await);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what text NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    Some((store, schema))
}

async fn mysql(
    test: &str,
) -> Option<(idem_sql::MySqlStore, idem_testkit::isolated::MySqlDatabase)> {
    let db = idem_testkit::isolated::MySqlDatabase::create("idem_cmp", test).await?;
    let store = idem_sql::MySqlStore::from_pool(db.pool(10).await);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what varchar(200) NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    Some((store, db))
}

completer_tests!(on_sqlite, idem_sql::SqliteStore, "?", sqlite);
completer_tests!(on_postgres, idem_sql::PostgresStore, "$1", postgres);
completer_tests!(on_mysql, idem_sql::MySqlStore, "?", mysql);
