//! Recovery points from consumer handlers (`run_phased`) against real stores: SQLite always,
//! PostgreSQL and MySQL from `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` (each test in
//! its own schema or database; `SKIPPING` when unset). The broker is the in-memory fake.
//!
//! The operation: `Reserve` (local effect), `Charge` (a "processor" call counted per derived
//! key, charging once per key as a real processor replays), `Record` (local effect). A crash
//! is an execution on a runtime of its own that is shut down inside `Charge`, after the
//! processor charged: nothing of it runs again (no release, no heartbeat), so its record stays
//! held until its lease runs out, as after a killed process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::phased::{Phased, PhasedHandler, PhasedOutcome};
use idem_consumer::{
    CancellationToken, Consumer, InMemoryBroker, Json, REASON_HEADER, RetryPolicy, Settled,
};
use idem_core::{BoxError, Fingerprint, Message, MessageId, Processor, Recovery};
use idem_request::{Completer, Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// How long a record is held without renewal in these tests.
const LEASE: Duration = Duration::from_millis(1500);

/// `n` that makes `Charge` give the operation up.
const ABANDON: i64 = -1;
/// `n` whose first execution never returns from `Charge` (after the processor charged).
const CRASH: i64 = 666;
/// `n` whose `Charge` waits for [`Probe::release`] (a live holder).
const HOLD: i64 = 777;

#[derive(Debug, Deserialize)]
struct Pay {
    n: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Phase {
    Reserve { n: i64 },
    Charge { n: i64 },
    Record { n: i64, charge: String },
}

/// What the phases did outside the database: the processor's calls and charges per derived
/// key, and the holder's gate.
#[derive(Debug, Default)]
struct Probe {
    calls: Mutex<HashMap<String, u32>>,
    release: Notify,
}

impl Probe {
    /// Charges under `key` (once per key, as a processor that replays by key), counting
    /// the call; the charge's ID.
    fn charge(&self, key: &str) -> String {
        *self
            .calls
            .lock()
            .expect("calls")
            .entry(key.to_owned())
            .or_default() += 1;
        format!("ch-{}", &key[..12.min(key.len())])
    }

    /// (distinct keys charged, calls in all).
    fn counts(&self) -> (usize, u32) {
        let calls = self.calls.lock().expect("calls");
        (calls.len(), calls.values().sum())
    }
}

fn msg(id: &str, n: i64) -> Message<Pay> {
    let payload = format!(r#"{{"n":{n}}}"#);
    Message::with_fingerprint(
        MessageId::new(id).expect("id"),
        Fingerprint::of(payload.as_bytes()),
        Pay { n },
    )
}

fn publish(broker: &InMemoryBroker, id: &str, n: i64) {
    broker.publish(&[("message-id", id.as_bytes())], format!(r#"{{"n":{n}}}"#));
}

fn quick(attempts: u32) -> RetryPolicy {
    RetryPolicy::exponential(
        attempts,
        Duration::from_millis(20),
        Duration::from_millis(200),
    )
}

macro_rules! phased_tests {
    ($backend:ident, $store:ty, $ph:literal, $setup:expr, $reopen:expr) => {
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

            struct Ops(Arc<Probe>);

            impl PhasedHandler<S, Pay> for Ops {
                type Phase = Phase;
                type Output = String;

                fn first(&self, msg: &Message<Pay>) -> Result<Phase, BoxError> {
                    Ok(Phase::Reserve { n: msg.payload().n })
                }

                async fn step(
                    &self,
                    phase: Phase,
                    ctx: &mut PhaseCtx<S>,
                ) -> Result<Step<Phase, String>, BoxError> {
                    let k = ctx.key().key.as_str().to_owned();
                    Ok(match phase {
                        Phase::Reserve { n } => {
                            effect(ctx.tx(), format!("{k}/reserve")).await?;
                            Step::Next(Phase::Charge { n })
                        }
                        Phase::Charge { n } => {
                            let charge = self.0.charge(&ctx.foreign_key("charge").to_uuid_string());
                            if n == ABANDON {
                                return Ok(Step::Abandon("declined".into()));
                            }
                            if n == CRASH && ctx.attempt() == 1 {
                                std::future::pending::<()>().await;
                            }
                            if n == HOLD && ctx.attempt() == 1 {
                                self.0.release.notified().await;
                            }
                            Step::Next(Phase::Record { n, charge })
                        }
                        Phase::Record { n, charge } => {
                            effect(ctx.tx(), format!("{k}/record")).await?;
                            Step::Done(format!("{n} {charge}"))
                        }
                    })
                }

                fn abandoned(&self, _recovery: &Recovery) -> String {
                    "gave up".into()
                }
            }

            fn phased(store: &S, probe: &Arc<Probe>, heartbeat: bool) -> Phased<S, Ops> {
                let builder = Idempotency::builder(store.clone()).lease(LEASE);
                let builder = if heartbeat {
                    builder
                } else {
                    builder.without_heartbeat()
                };
                Phased::new(
                    builder.build().expect("idempotency"),
                    "phased-test",
                    Ops(Arc::clone(probe)),
                )
            }

            /// Runs `broker`'s messages (it is closed first) through a phased consumer
            /// until the source ends.
            async fn consume(
                store: &S,
                probe: &Arc<Probe>,
                broker: &InMemoryBroker,
                retry: RetryPolicy,
            ) -> idem_consumer::RunStats {
                broker.close();
                let processor =
                    Arc::new(Processor::builder(store.clone(), "phased-test").build().expect("processor"));
                Consumer::new(processor, broker.source())
                    .retry(retry)
                    .run_phased(Json::<Pay>::new(), phased(store, probe, true), CancellationToken::new())
                    .await
                    .expect("run")
            }

            /// The crash: `id`'s operation runs on a runtime of its own, with a store of
            /// its own, until it hangs in `Charge`; then the runtime is shut down.
            fn crash(url: String, probe: Arc<Probe>, id: &'static str) {
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(async {
                        let store: S = $reopen(&url).await;
                        let run = async {
                            phased(&store, &probe, false).process(&msg(id, CRASH)).await
                        };
                        let r = tokio::time::timeout(Duration::from_millis(500), run).await;
                        assert!(r.is_err(), "the first execution hangs in Charge");
                    });
                    // Pending tasks (the interrupted execution's release) never run.
                    drop(rt);
                })
                .join()
                .expect("the crashing thread");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_runs_its_phases_once_and_its_redelivery_is_a_duplicate() {
                let Some((store, _guard, _url)) = $setup("phased_once").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                let broker = InMemoryBroker::new();
                publish(&broker, "once-1", 1);
                publish(&broker, "once-1", 1);
                let stats = consume(&store, &probe, &broker, quick(3)).await;
                assert_eq!((stats.processed, stats.duplicates, stats.dead_lettered), (1, 1, 0), "{stats:?}");
                assert!(broker.settled().iter().all(|(_, _, s)| *s == Settled::Acked));
                assert_eq!(count(&store, "once-1/reserve").await, 1);
                assert_eq!(count(&store, "once-1/record").await, 1);
                assert_eq!(probe.counts(), (1, 1), "one call to the processor");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_same_id_with_another_payload_is_dead_lettered_as_a_conflict() {
                let Some((store, _guard, _url)) = $setup("phased_conflict").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                let broker = InMemoryBroker::new();
                publish(&broker, "conflict-1", 1);
                publish(&broker, "conflict-1", 2);
                let stats = consume(&store, &probe, &broker, quick(3)).await;
                assert_eq!((stats.processed, stats.conflicts, stats.retries), (1, 1, 0), "{stats:?}");
                let dead: Vec<_> = broker
                    .settled()
                    .into_iter()
                    .filter_map(|(_, payload, s)| match s {
                        Settled::DeadLettered(h) => Some((payload, h)),
                        Settled::Acked => None,
                    })
                    .collect();
                assert_eq!(dead.len(), 1);
                assert_eq!(dead[0].0, br#"{"n":2}"#.to_vec());
                assert!(dead[0].1.contains(&(REASON_HEADER, "conflict".to_owned())), "{:?}", dead[0].1);
                assert_eq!(count(&store, "conflict-1/record").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_abandoned_operation_is_acked_and_stays_abandoned() {
                let Some((store, _guard, _url)) = $setup("phased_abandon").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                let broker = InMemoryBroker::new();
                publish(&broker, "abandon-1", ABANDON);
                publish(&broker, "abandon-1", ABANDON);
                let stats = consume(&store, &probe, &broker, quick(3)).await;
                assert_eq!((stats.processed, stats.operations_abandoned, stats.duplicates, stats.dead_lettered), (1, 1, 1, 0), "{stats:?}");
                assert!(broker.settled().iter().all(|(_, _, s)| *s == Settled::Acked));
                assert_eq!(count(&store, "abandon-1/reserve").await, 1);
                assert_eq!(count(&store, "abandon-1/record").await, 0);
                let replay = phased(&store, &probe, true).process(&msg("abandon-1", ABANDON)).await.expect("replay");
                assert_eq!(replay, PhasedOutcome::Duplicate);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_redelivery_after_a_crash_mid_phase_resumes_at_the_recovery_point() {
                let Some((store, _guard, url)) = $setup("phased_crash").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                crash(url, Arc::clone(&probe), "crash-1");
                assert_eq!(count(&store, "crash-1/reserve").await, 1, "Reserve committed before the crash");
                assert_eq!(probe.counts(), (1, 1), "the processor charged before the crash");
                // The redelivery: with one attempt only, anything but waiting for the dead
                // execution's lease and resuming would dead-letter it.
                let broker = InMemoryBroker::new();
                publish(&broker, "crash-1", CRASH);
                let stats = consume(&store, &probe, &broker, quick(1)).await;
                assert_eq!((stats.processed, stats.dead_lettered), (1, 0), "{stats:?}");
                assert_eq!(count(&store, "crash-1/reserve").await, 1, "a committed local phase never runs again");
                assert_eq!(count(&store, "crash-1/record").await, 1);
                assert_eq!(probe.counts(), (1, 2), "the foreign call repeated with the same derived key");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_redelivery_while_another_consumer_holds_the_record_waits_and_is_never_dead_lettered() {
                let Some((store, _guard, _url)) = $setup("phased_held").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                // A live holder: its heartbeat keeps the lease while it waits in Charge.
                let holder = {
                    let (store, probe) = (store.clone(), Arc::clone(&probe));
                    tokio::spawn(async move {
                        phased(&store, &probe, true).process(&msg("held-1", HOLD)).await
                    })
                };
                while probe.counts().1 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let broker = InMemoryBroker::new();
                publish(&broker, "held-1", HOLD);
                broker.close();
                let processor =
                    Arc::new(Processor::builder(store.clone(), "phased-test").build().expect("processor"));
                // One attempt: a wait that spent it would dead-letter the message.
                let consumer = Consumer::new(processor, broker.source()).retry(quick(1));
                let observer = consumer.observer();
                let run = tokio::spawn(consumer.run_phased(
                    Json::<Pay>::new(),
                    phased(&store, &probe, true),
                    CancellationToken::new(),
                ));
                // Past the lease: the holder renews it, so the redelivery keeps waiting.
                while observer.snapshot().held_elsewhere < 3 && broker.settled().is_empty() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                tokio::time::sleep(LEASE * 2).await;
                assert!(broker.settled().is_empty(), "neither acked nor dead-lettered while held");
                probe.release.notify_one();
                let held = holder.await.expect("holder").expect("the holder finishes");
                assert!(matches!(held, PhasedOutcome::Done(_)), "{held:?}");
                let stats = run.await.expect("no panic").expect("run");
                assert_eq!((stats.duplicates, stats.processed, stats.dead_lettered), (1, 0, 0), "{stats:?}");
                assert!(broker.settled().iter().all(|(_, _, s)| *s == Settled::Acked));
                assert_eq!(count(&store, "held-1/record").await, 1);
                assert_eq!(probe.counts(), (1, 1));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_completer_finishes_a_crashed_message_with_the_same_step() {
                let Some((store, _guard, url)) = $setup("phased_completer").await else {
                    return;
                };
                let probe = Arc::new(Probe::default());
                crash(url, Arc::clone(&probe), "cmp-1");
                tokio::time::sleep(LEASE + Duration::from_millis(300)).await;
                let p = phased(&store, &probe, true);
                let completer = p
                    .register(Completer::builder(p.idempotency().clone()))
                    .build()
                    .expect("completer");
                assert_eq!(completer.pass().await.expect("pass"), 1);
                assert_eq!(completer.stats().resumed, 1);
                assert_eq!(count(&store, "cmp-1/reserve").await, 1);
                assert_eq!(count(&store, "cmp-1/record").await, 1);
                assert_eq!(probe.counts(), (1, 2));
                // The redelivery that comes later is a duplicate.
                let broker = InMemoryBroker::new();
                publish(&broker, "cmp-1", CRASH);
                let stats = consume(&store, &probe, &broker, quick(1)).await;
                assert_eq!((stats.duplicates, stats.processed), (1, 0), "{stats:?}");
                assert_eq!(count(&store, "cmp-1/record").await, 1);
            }
        }
    };
}

async fn sqlite(_test: &str) -> Option<(idem_sql::SqliteStore, tempfile::TempDir, String)> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p.db");
    let store = idem_sql::SqliteStore::open(&path, idem_sql::SqliteOptions::default())
        .await
        .expect("open");
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    Some((store, dir, path.display().to_string()))
}

async fn reopen_sqlite(path: &str) -> idem_sql::SqliteStore {
    idem_sql::SqliteStore::open(path, idem_sql::SqliteOptions::default())
        .await
        .expect("reopen")
}

async fn postgres(
    test: &str,
) -> Option<(
    idem_sql::PostgresStore,
    idem_testkit::isolated::PgSchema,
    String,
)> {
    let schema = idem_testkit::isolated::PgSchema::create("idem_phc", test).await?;
    let store = idem_sql::PostgresStore::from_pool(schema.pool(10).await);
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what text NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    let url = format!(
        "{}{}options=-c%20search_path%3D{}",
        schema.url(),
        if schema.url().contains('?') { "&" } else { "?" },
        schema.name()
    );
    Some((store, schema, url))
}

async fn reopen_postgres(url: &str) -> idem_sql::PostgresStore {
    idem_sql::PostgresStore::from_pool(sqlx::PgPool::connect(url).await.expect("reconnect"))
}

async fn mysql(
    test: &str,
) -> Option<(
    idem_sql::MySqlStore,
    idem_testkit::isolated::MySqlDatabase,
    String,
)> {
    let db = idem_testkit::isolated::MySqlDatabase::create("idem_phc", test).await?;
    let store = idem_sql::MySqlStore::from_pool(db.pool(10).await);
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    sqlx::query("CREATE TABLE effects (what varchar(200) NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects");
    let mut url = url::Url::parse(db.url()).expect("IDEM_TEST_MYSQL_URL is a URL");
    url.set_path(db.name());
    Some((store, db, url.to_string()))
}

async fn reopen_mysql(url: &str) -> idem_sql::MySqlStore {
    idem_sql::MySqlStore::from_pool(sqlx::MySqlPool::connect(url).await.expect("reconnect"))
}

phased_tests!(on_sqlite, idem_sql::SqliteStore, "?", sqlite, reopen_sqlite);
phased_tests!(
    on_postgres,
    idem_sql::PostgresStore,
    "$1",
    postgres,
    reopen_postgres
);
phased_tests!(on_mysql, idem_sql::MySqlStore, "?", mysql, reopen_mysql);
