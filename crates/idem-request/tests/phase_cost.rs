//! What a phase boundary costs, counted on SQLite, where a commit hook on every pooled
//! connection sees each write transaction commit: one commit per boundary, none for the first
//! recovery point (the take writes it), none for a replay — and a first phase that calls a
//! third party starts from a point already committed, which the completer resumes after a crash.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{BoxError, IdempotencyKey, Migrate, RequestScope};
use idem_request::{Idempotency, PhaseCtx, Step};
use idem_sql::{SqliteOptions, SqliteStore};
use serde::{Deserialize, Serialize};

type S = SqliteStore;

const SHORT: Duration = Duration::from_millis(300);
const PAST_SHORT: Duration = Duration::from_millis(500);

#[derive(Debug, Serialize, Deserialize)]
enum Phase {
    /// Local: an order row.
    Order,
    /// Foreign: the "call" (recorded with its derived key); hangs after it when asked to (a
    /// crash after the call).
    Charge { order: i64 },
    /// Local: a charge row; done.
    Record { order: i64, charge: String },
}

/// A store whose every pooled connection counts its commits, with the effect tables.
async fn counted_store(dir: &tempfile::TempDir) -> (S, Arc<AtomicU64>) {
    let store = SqliteStore::open(dir.path().join("cost.db"), SqliteOptions::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, op TEXT NOT NULL);
         CREATE TABLE charges (order_id INTEGER NOT NULL, charge TEXT NOT NULL);",
    )
    .execute(store.pool())
    .await
    .expect("tables");
    let commits = Arc::new(AtomicU64::new(0));
    // Every connection the pool will ever hand out, held at once so each gets its hook.
    let mut held = Vec::new();
    for _ in 0..store.pool().options().get_max_connections() {
        let mut conn = store.pool().acquire().await.expect("connection");
        let c = Arc::clone(&commits);
        conn.lock_handle()
            .await
            .expect("handle")
            .set_commit_hook(move || {
                c.fetch_add(1, Ordering::SeqCst);
                true
            });
        held.push(conn);
    }
    drop(held);
    (store, commits)
}

/// What the operation saw: the derived key of every call, and whether to hang after it.
#[derive(Clone, Default)]
struct Third {
    calls: Arc<Mutex<Vec<String>>>,
    hang_on_first_attempt: bool,
    /// The record's stored point as another connection read it just before each call.
    committed_before_call: Arc<Mutex<Vec<Option<String>>>>,
    /// Told when the operation hangs after its call.
    hung: Arc<tokio::sync::Notify>,
}

async fn step(
    store: &S,
    third: &Third,
    phase: Phase,
    ctx: &mut PhaseCtx<S>,
) -> Result<Step<Phase, String>, BoxError> {
    Ok(match phase {
        Phase::Order => {
            let op = ctx.key().key.as_str().to_owned();
            let order: i64 = sqlx::query_scalar("INSERT INTO orders (op) VALUES (?1) RETURNING id")
                .bind(op)
                .fetch_one(&mut **ctx.tx())
                .await?;
            Step::Next(Phase::Charge { order })
        }
        Phase::Charge { order } => {
            // What a crash right now would leave for a retry or the completer, as another
            // connection sees it (the phase's transaction holds nothing yet).
            let point: Option<String> = sqlx::query_scalar(
                "SELECT recovery_point FROM idem_requests WHERE idem_key = ?1 AND state = 0",
            )
            .bind(ctx.key().key.as_str().as_bytes().to_vec())
            .fetch_optional(store.pool())
            .await?
            .flatten();
            third
                .committed_before_call
                .lock()
                .expect("seen")
                .push(point);
            let key = ctx.foreign_key("charge").to_string();
            third.calls.lock().expect("seen").push(key.clone());
            if third.hang_on_first_attempt && ctx.attempt() == 1 {
                third.hung.notify_one();
                std::future::pending::<()>().await;
            }
            Step::Next(Phase::Record {
                order,
                charge: format!("ch_{}", &key[..8]),
            })
        }
        Phase::Record { order, charge } => {
            sqlx::query("INSERT INTO charges (order_id, charge) VALUES (?1, ?2)")
                .bind(order)
                .bind(&charge)
                .execute(&mut **ctx.tx())
                .await?;
            Step::Done(charge)
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

fn scope() -> RequestScope {
    RequestScope::new(["phase_cost"])
}

async fn run(
    store: &S,
    third: &Third,
    key: &str,
    first: Phase,
) -> Result<String, idem_core::Error> {
    let key = IdempotencyKey::new(key).expect("key");
    idem(store)
        .run_phases(
            scope(),
            &key,
            &(),
            first,
            async |phase, ctx: &mut PhaseCtx<S>| step(store, third, phase, ctx).await,
        )
        .await
}

async fn count(store: &S, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// Order (local) → Charge (foreign) → Record (local): the take, then one commit per phase —
/// 4 — and the record's first point costs none of its own. A repeat replays without a write.
#[tokio::test]
async fn each_boundary_is_one_commit_and_the_first_point_rides_on_the_take() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, commits) = counted_store(&dir).await;
    let third = Third::default();
    let before = commits.load(Ordering::SeqCst);
    let charge = run(&store, &third, "op-1", Phase::Order)
        .await
        .expect("run");
    let spent = commits.load(Ordering::SeqCst) - before;
    assert_eq!(
        spent, 4,
        "a take and three phase boundaries must be 4 commits (5 when the first point commits \
         on its own)"
    );
    // The first phase ran from a point already committed with the take.
    let before = commits.load(Ordering::SeqCst);
    let again = run(&store, &third, "op-1", Phase::Order)
        .await
        .expect("replay");
    assert_eq!(again, charge);
    assert_eq!(
        commits.load(Ordering::SeqCst) - before,
        0,
        "a replay writes"
    );
    assert_eq!(count(&store, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&store, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(third.calls.lock().expect("seen").len(), 1);
}

/// A first phase that calls out finds its point committed before the call (another connection
/// reads it), so when the executor crashes after the call the completer — which knows no first
/// phase — resumes there, and the call repeats with the same derived key.
#[tokio::test]
async fn a_foreign_first_phase_calls_from_a_committed_point_the_completer_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, commits) = counted_store(&dir).await;
    let third = Third {
        hang_on_first_attempt: true,
        ..Third::default()
    };
    let before = commits.load(Ordering::SeqCst);
    // The executor "crashes" after its call: its future is dropped there.
    let mut first = Box::pin(run(&store, &third, "op-2", Phase::Charge { order: 7 }));
    tokio::select! {
        ended = &mut first => panic!("the first attempt must hang after its call: {ended:?}"),
        () = third.hung.notified() => {}
    }
    drop(first);
    assert_eq!(
        third.committed_before_call.lock().expect("seen").as_slice(),
        [Some("Charge".to_owned())],
        "the first point was not committed before the call"
    );
    assert_eq!(
        commits.load(Ordering::SeqCst) - before,
        1,
        "only the take commits before a foreign first phase's call"
    );
    tokio::time::sleep(PAST_SHORT).await;
    let idem = idem(&store);
    let stuck = idem.take_stuck(10).await.expect("take stuck");
    assert_eq!(
        stuck.len(),
        1,
        "the completer does not see the crashed operation"
    );
    let done: String = idem
        .resume_phases(
            stuck.into_iter().next().expect("one"),
            async |phase, ctx: &mut PhaseCtx<S>| step(&store, &third, phase, ctx).await,
        )
        .await
        .expect("resumed");
    let calls = third.calls.lock().expect("seen").clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0], calls[1], "the repeated call changed its key");
    assert_eq!(done, format!("ch_{}", &calls[0][..8]));
    assert_eq!(count(&store, "SELECT count(*) FROM charges").await, 1);
}
