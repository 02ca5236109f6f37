//! Claims are stamped, and prune cutoffs measured, by the database server's clock: a consumer
//! host whose clock is off can neither stamp claims that look old nor prune them early. Each
//! test gives its server a clock far from this host's — PostgreSQL through a `now()` that
//! shadows `pg_catalog.now()` on the connection's `search_path`, MySQL through `SET timestamp`
//! — and checks that the stamps and the cutoff follow the server, and so do idempotent-request
//! fences, leases and expiry.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{
    Begin, BoxError, ClaimStore, Clock, Fence, Fingerprint, IdempotencyKey, ManualClock, Message,
    MessageId, Migrate, Processor, Prune, RequestKey, RequestScope, Stats, SystemClock, Timestamp,
};
use idem_sql::{MySqlStore, PostgresStore};
use idem_testkit::{service_url, services, unique_name};
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// 2001-09-09T01:46:40Z: the server's "now" in these tests.
const SERVER_NOW: i64 = 1_000_000_000_000_000;
const DAY: Duration = Duration::from_secs(86_400);

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"x".to_vec())
}

async fn claim<S: ClaimStore, C: Clock>(p: &Processor<S, C>, id: &str) {
    let out = p.process(&msg(id), async |_tx| Ok::<_, BoxError>(())).await;
    assert!(out.is_ok(), "{id}: {out:?}");
}

async fn stamps_and_prunes_by_the_server_clock<S>(store: S)
where
    S: ClaimStore + Prune + Stats + Clone,
{
    // The default processor: no clock injected, so the store's (the server's) clock.
    let billing = Processor::builder(store.clone(), "billing")
        .build()
        .expect("p");
    claim(&billing, "fresh").await;
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats[0].oldest, stats[0].newest),
        (
            Timestamp::from_micros(SERVER_NOW),
            Timestamp::from_micros(SERVER_NOW)
        ),
        "the claim was stamped by this host's clock, not the server's"
    );
    // Two older claims written with explicit stamps: 8 days before the server's now (past the
    // 7-day retention) and 8 days before this host's now (years after the server's now).
    let at = |t: Timestamp| {
        Processor::builder(store.clone(), "billing")
            .clock(Arc::new(ManualClock::new(t.saturating_sub(8 * DAY))))
            .build()
            .expect("p")
    };
    claim(&at(Timestamp::from_micros(SERVER_NOW)), "old-by-server").await;
    claim(&at(SystemClock.now()), "old-by-host").await;
    // Pruned on the server's clock, only the claim 8 days older than the server's now goes;
    // on this host's clock all three would.
    assert_eq!(billing.prune().await.expect("prune"), 1);
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats[0].claims, 2, "{stats:?}");
    assert_eq!(stats[0].oldest, Timestamp::from_micros(SERVER_NOW));
}

/// A record taken on the server's clock: its fence is the server's now, its lease runs 30 s of
/// the server's time (on this host's clock, years later, it would have lapsed long ago), and a
/// day-long TTL keeps it from the reaper.
async fn requests_follow_the_server_clock<S: RequestStore + ReapRequests>(store: &S) {
    let k = RequestKey::new(
        RequestScope::new(["clock"]),
        IdempotencyKey::new("k").expect("key"),
    );
    let fp = Fingerprint::of(b"body");
    let lease = Duration::from_secs(30);
    let begin = store
        .begin_request(&k, &fp, lease, DAY)
        .await
        .expect("begin");
    let server_now = u64::try_from(SERVER_NOW).expect("positive");
    assert_eq!(
        begin,
        Begin::Acquired {
            fence: Fence(server_now),
            takeover: false
        },
        "a new record's fence is the server's clock"
    );
    let retry = store
        .begin_request(&k, &fp, lease, DAY)
        .await
        .expect("retry");
    assert_eq!(
        retry,
        Begin::InProgress { retry_after: lease },
        "the lease was measured on this host's clock"
    );
    let mut tx = store.begin().await.expect("tx");
    store
        .complete_in(&mut tx, &k, Fence(server_now), b"r", DAY)
        .await
        .expect("complete");
    store.commit(tx).await.expect("commit");
    assert_eq!(
        store.reap_batch(100).await.expect("reap"),
        0,
        "reaped by the host's clock"
    );
    assert_eq!(
        store
            .begin_request(&k, &fp, lease, DAY)
            .await
            .expect("replay"),
        Begin::Completed {
            result: b"r".to_vec()
        }
    );
}

#[tokio::test]
async fn postgres_stamps_and_prunes_by_the_server_clock() {
    let test = "postgres_stamps_and_prunes_by_the_server_clock";
    let Some(url) = service_url(services::POSTGRES, test) else {
        return;
    };
    let schema = unique_name("clk", test);
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect to IDEM_TEST_POSTGRES_URL");
    for sql in [
        format!("CREATE SCHEMA {schema}"),
        format!(
            "CREATE FUNCTION {schema}.now() RETURNS timestamptz LANGUAGE sql \
             AS $$ SELECT to_timestamp({}) $$",
            SERVER_NOW / 1_000_000
        ),
        // Request records read the statement's start rather than the transaction's.
        format!(
            "CREATE FUNCTION {schema}.statement_timestamp() RETURNS timestamptz LANGUAGE sql \
             AS $$ SELECT to_timestamp({}) $$",
            SERVER_NOW / 1_000_000
        ),
    ] {
        sqlx::query(&sql).execute(&admin).await.expect("setup");
    }
    // pg_catalog listed after the schema: an unqualified now() resolves to the one above.
    let search_path = format!("{schema},pg_catalog");
    let options = PgConnectOptions::from_str(&url)
        .expect("url")
        .options([("search_path", search_path.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("connect");
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    stamps_and_prunes_by_the_server_clock(store.clone()).await;
    requests_follow_the_server_clock(&store).await;
    store.pool().close().await;
    let _ = sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await;
}

#[tokio::test]
async fn mysql_stamps_and_prunes_by_the_server_clock() {
    let test = "mysql_stamps_and_prunes_by_the_server_clock";
    let Some(url) = service_url(services::MYSQL, test) else {
        return;
    };
    let database = unique_name("clk", test);
    let admin = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect to IDEM_TEST_MYSQL_URL");
    sqlx::query(&format!("CREATE DATABASE {database}"))
        .execute(&admin)
        .await
        .expect("database");
    let options = MySqlConnectOptions::from_str(&url)
        .expect("url")
        .database(&database);
    // `SET timestamp` fixes the session's NOW() and UTC_TIMESTAMP().
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(format!("SET timestamp = {}", SERVER_NOW / 1_000_000).as_str())
                    .await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .expect("connect");
    let store = MySqlStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    stamps_and_prunes_by_the_server_clock(store.clone()).await;
    requests_follow_the_server_clock(&store).await;
    store.pool().close().await;
    let _ = sqlx::query(&format!("DROP DATABASE {database}"))
        .execute(&admin)
        .await;
}
