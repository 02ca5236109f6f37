//! On PostgreSQL, sqlx counting idem's transactions costs no round trip: a one-message
//! transaction with a one-statement handler is still `BEGIN`, the claim, the statement, the
//! commit (four) on held connections, and the same plus the pool's two pings (six) on the
//! pool. Counted through a proxy that holds every answer back. Between transactions a held
//! connection rests outside any transaction on the server (`idle`, not `idle in
//! transaction`), and so does a pooled one once the pool has it back.

use std::time::Duration;

use idem_core::{Message, MessageId, Migrate, Outcome, Processor};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;
use sqlx::postgres::PgPoolOptions;

use super::proxy::{Proxy, upstream};

/// Far longer than the client takes between two requests it sends without waiting.
const HOLD: Duration = Duration::from_millis(40);

async fn state_of(admin: &sqlx::PgPool, pid: i32) -> String {
    sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(admin)
        .await
        .expect("the backend's state")
}

/// A store migrated in a schema of its own with an `effects (k text)` table, whose one
/// connection (held, or a pool of one) goes through a proxy counting round trips; `admin`
/// reaches the schema directly.
pub(super) struct Counted {
    pub(super) schema: PgSchema,
    pub(super) admin: sqlx::PgPool,
    pub(super) proxy: Proxy,
    pub(super) store: PostgresStore,
}

impl Counted {
    pub(super) async fn setup(prefix: &str, test: &str, held: bool) -> Option<Self> {
        let schema = PgSchema::create(prefix, test).await?;
        let admin = schema.pool(2).await;
        PostgresStore::from_pool(admin.clone())
            .migrate()
            .await
            .expect("migrate");
        sqlx::query("CREATE TABLE effects (k text NOT NULL)")
            .execute(&admin)
            .await
            .expect("effects");
        let proxy = Proxy::start(upstream(schema.url(), 5432).await, HOLD).await;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(schema.options().host("127.0.0.1").port(proxy.port()));
        let store = PostgresStore::from_pool(pool);
        let store = if held {
            store.hold_connections(1)
        } else {
            store
        };
        Some(Self {
            schema,
            admin,
            proxy,
            store,
        })
    }

    /// Lets the pool's return ping, which runs in a task of its own, land before counting.
    pub(super) async fn settle() {
        tokio::time::sleep(HOLD * 4).await;
    }
}

async fn run(test: &str, held: bool) {
    let Some(Counted {
        schema,
        admin,
        proxy,
        store,
    }) = Counted::setup("idem_rt", test, held).await
    else {
        return;
    };
    let p = Processor::builder(store.clone(), "rt")
        .build()
        .expect("processor");
    let process = async |id: &str, nested: bool| -> i32 {
        let m = Message::new(MessageId::new(id).expect("id"), b"x".to_vec());
        let outcome = p
            .process(&m, async |tx| {
                if nested {
                    use sqlx::Acquire;
                    let mut inner = (&mut **tx).begin().await?;
                    sqlx::query("INSERT INTO effects (k) VALUES ('nested')")
                        .execute(&mut *inner)
                        .await?;
                    inner.commit().await?;
                }
                sqlx::query_scalar::<_, i32>(
                    "WITH e AS (INSERT INTO effects (k) VALUES ('x')) SELECT pg_backend_pid()",
                )
                .fetch_one(&mut **tx)
                .await
            })
            .await;
        match outcome {
            Ok(Outcome::Processed(pid)) => pid,
            other => panic!("{id}: {other:?}"),
        }
    };
    let settle = Counted::settle;

    // Prepared statements are cached per connection: warm up first.
    process("warm-1", true).await;
    let pid = process("warm-2", false).await;
    settle().await;
    proxy.take();

    process("m-1", false).await;
    settle().await;
    let expected = if held { 4 } else { 6 };
    assert_eq!(
        proxy.take(),
        expected,
        "BEGIN, the claim, the handler's statement, the commit{}",
        if held {
            ""
        } else {
            ", and the pool's two pings"
        }
    );
    process("m-2", true).await;
    settle().await;
    assert_eq!(
        proxy.take(),
        expected + 3,
        "a nested transaction: its SAVEPOINT, its statement, its RELEASE"
    );
    assert_eq!(
        state_of(&admin, pid).await,
        "idle",
        "between transactions the connection is outside any transaction on the server"
    );
    drop((p, store));
    admin.close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_transaction_round_trips() {
    run("held_transaction_round_trips", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_transaction_round_trips() {
    run("pooled_transaction_round_trips", false).await;
}
