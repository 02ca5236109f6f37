//! On PostgreSQL, what an idempotent request costs in round trips in the one-transaction mode,
//! counted through the proxy that holds every answer back (see `round_trips`): the record is
//! read on a connection that the execution's transaction then begins on, so a first execution
//! is the read, `BEGIN`, the take, the handler's statement, the completion and the commit (six)
//! on held connections, the same plus one pair of pool pings (eight) on the pool; a replay is
//! the read alone on held connections (one), the read and the pings (three) on the pool.

use std::time::Duration;

use idem_core::TransactionalStore;
use idem_core::store::RequestStore;
use idem_core::{Begin, BeginIn, Fingerprint, IdempotencyKey, RequestKey, RequestScope};

use super::round_trips::Counted;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

async fn run(test: &str, held: bool) {
    let Some(Counted {
        schema,
        admin,
        proxy,
        store,
    }) = Counted::setup("idem_rrt", test, held).await
    else {
        return;
    };
    // The same scope and keys in both tests, which run at once in two schemas: the take's
    // advisory lock is keyed on the table's OID, so they never meet on one lock (keyed on
    // the table's name, one test's take answered the other "in progress").
    let scope = RequestScope::new(["charges", "alice"]);
    let fingerprint = Fingerprint::of(b"{\"amount\":100}");
    let key = |k: &str| RequestKey::new(scope, IdempotencyKey::new(k).expect("key"));
    // A first execution: the handler's one statement, then the completion and the commit.
    let first = async |k: &str| {
        let begun = store
            .begin_request_in(&key(k), &fingerprint, LEASE, TTL)
            .await
            .expect("begin");
        let BeginIn::Acquired { fence, mut tx, .. } = begun else {
            panic!("{k}: not taken in its transaction: {begun:?}");
        };
        sqlx::query("INSERT INTO effects (k) VALUES ($1)")
            .bind(k)
            .execute(&mut *tx)
            .await
            .expect("effect");
        store
            .complete_in(&mut tx, &key(k), fence, b"201 charged", TTL)
            .await
            .expect("complete");
        store.commit(tx).await.expect("commit");
    };
    let replay = async |k: &str| match store
        .begin_request_in(&key(k), &fingerprint, LEASE, TTL)
        .await
        .expect("replay")
    {
        BeginIn::Answer(Begin::Completed { result }) => assert_eq!(result, b"201 charged"),
        other => panic!("{k}: not replayed: {other:?}"),
    };
    let settle = Counted::settle;

    // Prepared statements are cached per connection: warm up first.
    first("warm").await;
    replay("warm").await;
    settle().await;
    proxy.take();

    first("k-1").await;
    settle().await;
    let pings = if held { 0 } else { 2 };
    assert_eq!(
        proxy.take(),
        6 + pings,
        "the read, BEGIN, the take, the handler's statement, the completion, the commit{}",
        if held {
            ""
        } else {
            ", and one pair of pool pings"
        }
    );
    replay("k-1").await;
    settle().await;
    assert_eq!(
        proxy.take(),
        1 + pings,
        "a replay is the record read{}",
        if held { "" } else { " and the pool's pings" }
    );
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE k = 'k-1'")
        .fetch_one(&admin)
        .await
        .expect("count");
    assert_eq!(effects, 1, "the first execution committed its effect once");
    drop(store);
    admin.close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_request_round_trips() {
    run("held_request_round_trips", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_request_round_trips() {
    run("pooled_request_round_trips", false).await;
}
