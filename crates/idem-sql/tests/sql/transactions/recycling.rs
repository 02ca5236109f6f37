//! Held connections are given up, and the next transaction opens a new one: past their
//! lifetime, after an idle spell, when their `BEGIN` does not answer (a peer behind a network
//! that stopped forwarding), and after repeated read-only answers (a session that a failover
//! left on a replica) — on the pool too for the last. The bounds default to the pool's
//! options (`max_lifetime`, `idle_timeout`, the acquire timeout for `BEGIN`); a change of
//! backend shows as a new `pg_backend_pid()` / `CONNECTION_ID()`.

use std::time::{Duration, Instant};

use idem_core::{ErrorKind, Message, MessageId, Migrate, Outcome, Processor};
use idem_sql::{MySqlStore, PostgresStore};
use idem_testkit::isolated::{MySqlDatabase, PgSchema};
use idem_testkit::unique_name;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;

use super::proxy::{Proxy, upstream};

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"x".to_vec())
}

/// A migrated schema, and a pool on it as its superuser for the test's own queries.
async fn schema(test: &str) -> Option<(PgSchema, sqlx::PgPool)> {
    let schema = PgSchema::create("idem_rc", test).await?;
    let admin = schema.pool(2).await;
    PostgresStore::from_pool(admin.clone())
        .migrate()
        .await
        .expect("migrate");
    Some((schema, admin))
}

/// Processes `id` with a handler that reports its backend.
async fn pg_pid(p: &Processor<PostgresStore>, id: &str) -> Result<i32, idem_core::Error> {
    match p
        .process(&msg(id), async |tx| {
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await
        })
        .await?
    {
        Outcome::Processed(pid) => Ok(pid),
        other => panic!("{id} was not new: {other:?}"),
    }
}

async fn alive(admin: &sqlx::PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
        .bind(pid)
        .fetch_one(admin)
        .await
        .expect("pg_stat_activity")
}

/// Waits up to 5 s for backend `pid` to end.
async fn gone(admin: &sqlx::PgPool, pid: i32) -> bool {
    for _ in 0..50 {
        if !alive(admin, pid).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_past_its_lifetime_is_replaced() {
    let Some((schema, admin)) = schema("held_lifetime").await else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(Duration::from_millis(1500))
        .idle_timeout(None)
        .connect_lazy_with(schema.options());
    let p = Processor::builder(PostgresStore::from_pool(pool).hold_connections(1), "life")
        .build()
        .expect("processor");
    let first = pg_pid(&p, "l-1").await.expect("l-1");
    assert_eq!(pg_pid(&p, "l-2").await.expect("l-2"), first, "reused");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let next = pg_pid(&p, "l-3").await.expect("l-3");
    assert_ne!(next, first, "past its lifetime, the connection is replaced");
    assert!(gone(&admin, first).await, "and closed");
    drop(p);
    admin.close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_idle_too_long_is_replaced() {
    let Some((schema, admin)) = schema("held_idle").await else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(Duration::from_millis(1500))
        .connect_lazy_with(schema.options());
    let p = Processor::builder(PostgresStore::from_pool(pool).hold_connections(1), "idle")
        .build()
        .expect("processor");
    let first = pg_pid(&p, "i-1").await.expect("i-1");
    // Used every 0.6 s: older than the idle timeout, never idle that long.
    for id in ["i-2", "i-3", "i-4"] {
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(pg_pid(&p, id).await.expect(id), first, "{id}: reused");
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let next = pg_pid(&p, "i-5").await.expect("i-5");
    assert_ne!(next, first, "idle too long, the connection is replaced");
    assert!(gone(&admin, first).await, "and closed");
    drop(p);
    admin.close().await;
    schema.drop().await;
}

/// The test's login role, and the failover: its sessions read-only, then no longer for new
/// ones (role settings apply when a session starts, so one opened before stays read-only).
struct ReadOnlyRole {
    name: String,
}

impl ReadOnlyRole {
    async fn create(admin: &sqlx::PgPool, schema: &PgSchema) -> Self {
        let name = unique_name("idem_ro", "role");
        for sql in [
            format!("CREATE ROLE {name} LOGIN"),
            format!("GRANT USAGE ON SCHEMA {} TO {name}", schema.name()),
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {name}",
                schema.name()
            ),
            format!("ALTER ROLE {name} SET default_transaction_read_only = on"),
        ] {
            sqlx::query(&sql).execute(admin).await.expect(&sql);
        }
        Self { name }
    }

    async fn fail_over(&self, admin: &sqlx::PgPool) {
        let sql = format!(
            "ALTER ROLE {} SET default_transaction_read_only = off",
            self.name
        );
        sqlx::query(&sql).execute(admin).await.expect("fail over");
    }

    async fn backends(&self, admin: &sqlx::PgPool) -> Vec<i32> {
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE usename = $1")
            .bind(&self.name)
            .fetch_all(admin)
            .await
            .expect("the role's backends")
    }

    async fn drop(self, admin: &sqlx::PgPool) {
        let _ = sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
        )
        .bind(&self.name)
        .execute(admin)
        .await;
        for sql in [
            format!("DROP OWNED BY {}", self.name),
            format!("DROP ROLE {}", self.name),
        ] {
            let _ = sqlx::query(&sql).execute(admin).await;
        }
    }
}

/// Two claims refused as read-only in a row on one connection, then the third transaction
/// runs on a new one, which after the "failover" takes writes.
async fn read_only(test: &str, held: bool) {
    let Some((schema, admin)) = schema(test).await else {
        return;
    };
    let role = ReadOnlyRole::create(&admin, &schema).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(schema.options().username(&role.name));
    let store = PostgresStore::from_pool(pool);
    let store = if held {
        store.hold_connections(1)
    } else {
        store
    };
    let p = Processor::builder(store, "ro").build().expect("processor");

    let refused = pg_pid(&p, "r-1").await.expect_err("a read-only session");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    let before = role.backends(&admin).await;
    assert_eq!(before.len(), 1, "one connection: {before:?}");
    role.fail_over(&admin).await;
    let refused = pg_pid(&p, "r-1")
        .await
        .expect_err("the same read-only session");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    let pid = pg_pid(&p, "r-1")
        .await
        .expect("after two read-only answers the connection is replaced");
    assert!(!before.contains(&pid), "a new backend: {pid} vs {before:?}");
    assert!(gone(&admin, before[0]).await, "the read-only one is closed");
    drop(p);
    role.drop(&admin).await;
    admin.close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_answering_read_only_is_replaced() {
    read_only("held_read_only", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_answering_read_only_is_replaced() {
    read_only("pooled_read_only", false).await;
}

/// A `BEGIN` that gets no answer (the proxy stops forwarding) fails as unavailable within the
/// bound (the pool's acquire timeout by default) instead of waiting until TCP gives up, and
/// once the path forwards again the next transaction runs on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_begin_that_hangs_times_out() {
    let Some((schema, admin)) = schema("held_begin_hangs").await else {
        return;
    };
    let proxy = Proxy::start(upstream(schema.url(), 5432).await, Duration::ZERO).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(schema.options().host("127.0.0.1").port(proxy.port()));
    let p = Processor::builder(PostgresStore::from_pool(pool).hold_connections(1), "hang")
        .build()
        .expect("processor");
    let first = pg_pid(&p, "h-1").await.expect("h-1");

    proxy.freeze();
    let started = Instant::now();
    let hung = tokio::time::timeout(Duration::from_secs(15), pg_pid(&p, "h-2"))
        .await
        .expect("a BEGIN without an answer fails instead of hanging");
    let err = hung.expect_err("no answer");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    proxy.thaw();
    let next = pg_pid(&p, "h-2").await.expect("a new connection");
    assert_ne!(next, first);
    drop(p);
    // The frozen connection's backend is still in its idle state upstream; end it.
    let _ = sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(first)
        .execute(&admin)
        .await;
    admin.close().await;
    schema.drop().await;
}

/// The same lifetime on MySQL, whose connections close through its own protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_mysql_connection_past_its_lifetime_is_replaced() {
    let Some(database) = MySqlDatabase::create("idem_rc", "held_lifetime").await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .max_lifetime(Duration::from_millis(1500))
        .idle_timeout(None)
        .connect_lazy_with(database.options());
    let store = MySqlStore::from_pool(pool).hold_connections(1);
    store.migrate().await.expect("migrate");
    let p = Processor::builder(store, "life")
        .build()
        .expect("processor");
    let id = async |id: &str| -> u64 {
        match p
            .process(&msg(id), async |tx| {
                sqlx::query_scalar::<_, u64>("SELECT CONNECTION_ID()")
                    .fetch_one(&mut **tx)
                    .await
            })
            .await
        {
            Ok(Outcome::Processed(c)) => c,
            other => panic!("{id}: {other:?}"),
        }
    };
    let first = id("l-1").await;
    assert_eq!(id("l-2").await, first, "reused");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_ne!(id("l-3").await, first, "past its lifetime, replaced");
    drop(p);
    database.drop().await;
}
