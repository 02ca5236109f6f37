//! Savepoints inside a handler's transaction, and connections given up, against the real
//! PostgreSQL server in `IDEM_TEST_POSTGRES_URL`.
//!
//! `Client::transaction` cannot be called on a [`PgTx`] (it derefs to `&Client` only), so a
//! handler nests with [`PgTx::savepoint`]: a released savepoint commits nothing before the
//! transaction does (a later failure rolls everything back, and the redelivery is processed),
//! a rolled-back one undoes only its part, and one dropped open fails the commit. Pooled
//! connections are retired past their lifetime and idle timeout (a new `pg_backend_pid()`),
//! after repeated read-only answers (a role whose sessions are read-only until a "failover"),
//! and a `BEGIN` that gets no answer (a proxy that stops forwarding) fails as unavailable
//! within the bound, on the pool and on plain clients.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_core::{BoxError, ErrorKind, Message, MessageId, Migrate, Outcome, Processor};
use idem_postgres::tokio_postgres::config::Host;
use idem_postgres::tokio_postgres::{Client, Config};
use idem_postgres::{PgStore, PgTx};
use idem_testkit::isolated::PgSchema;
use idem_testkit::unique_name;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{self, Conns};

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"x".to_vec())
}

async fn insert(tx: &PgTx, k: &str) -> Result<(), BoxError> {
    tx.execute("INSERT INTO effects (k) VALUES ($1)", &[&k])
        .await?;
    Ok(())
}

async fn count(admin: &Client, sql: &str) -> i64 {
    common::count(admin, sql, &[]).await
}

/// A migrated store with an `effects` table, and an admin client.
async fn setup(test: &str, conns: Conns) -> Option<(PgSchema, PgStore, Client)> {
    let schema = PgSchema::create("idem_pgtx", test).await?;
    let config = common::config(&schema);
    let store = common::store(&config, conns).await;
    store.migrate().await.expect("migrate");
    let admin = common::client(&config).await;
    admin
        .batch_execute("CREATE TABLE effects (k text NOT NULL)")
        .await
        .expect("effects");
    Some((schema, store, admin))
}

async fn savepoints(conns: Conns, test: &str) {
    let Some((schema, store, admin)) = setup(test, conns).await else {
        return;
    };
    let p = Processor::builder(store.clone(), "nest")
        .build()
        .expect("p");

    // Released, then the handler fails: nothing of it, nor its claim, is committed.
    let released = AtomicBool::new(false);
    let failed = p
        .process(&msg("m-1"), async |tx| {
            insert(tx, "outer-1").await?;
            let sp = tx.savepoint().await?;
            insert(&sp, "inner").await?;
            sp.release().await?;
            released.store(true, Ordering::SeqCst);
            assert_eq!(
                count(&admin, "SELECT count(*) FROM idem_processed").await,
                0,
                "a released savepoint commits nothing"
            );
            insert(tx, "outer-2").await?;
            Err::<(), BoxError>("fails after its savepoint was released".into())
        })
        .await;
    assert!(
        failed.is_err() && released.load(Ordering::SeqCst),
        "{failed:?}"
    );
    assert_eq!(count(&admin, "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        count(&admin, "SELECT count(*) FROM idem_processed").await,
        0
    );
    let again = p
        .process(&msg("m-1"), async |tx| insert(tx, "redelivered").await)
        .await;
    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");

    // Rolled back (after a failed statement in it, even), then nested ones: only its part
    // is undone.
    let done = p
        .process(&msg("m-2"), async |tx| {
            insert(tx, "kept-1").await?;
            let mut sp = tx.savepoint().await?;
            insert(&sp, "undone").await?;
            let deeper = sp.savepoint().await?;
            insert(&deeper, "undone-deeper").await?;
            deeper.release().await?;
            assert!(
                sp.execute("SELECT * FROM no_such_table", &[])
                    .await
                    .is_err()
            );
            sp.rollback().await?;
            insert(tx, "kept-2").await?;
            Ok::<_, BoxError>(())
        })
        .await;
    assert!(matches!(done, Ok(Outcome::Processed(()))), "{done:?}");
    let kept = count(
        &admin,
        "SELECT count(*) FROM effects WHERE k IN ('kept-1', 'kept-2')",
    )
    .await;
    let undone = count(
        &admin,
        "SELECT count(*) FROM effects WHERE k LIKE 'undone%'",
    )
    .await;
    assert_eq!((kept, undone), (2, 0));

    // Dropped open: the commit fails and nothing is committed.
    let dropped = p
        .process(&msg("m-3"), async |tx| {
            insert(tx, "lost-1").await?;
            {
                let sp = tx.savepoint().await?;
                insert(&sp, "lost-2").await?;
            }
            insert(tx, "lost-3").await?;
            Ok::<_, BoxError>(())
        })
        .await;
    let err = dropped.expect_err("a savepoint dropped open fails the commit");
    assert!(err.to_string().contains("savepoint"), "{err}");
    assert_eq!(
        count(&admin, "SELECT count(*) FROM effects WHERE k LIKE 'lost%'").await,
        0
    );
    let again = p
        .process(&msg("m-3"), async |tx| insert(tx, "m-3").await)
        .await;
    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
    drop((p, store, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoints_nest_inside_the_claim_transaction_pooled() {
    savepoints(Conns::Pool(2), "savepoints_pooled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoints_nest_inside_the_claim_transaction_on_clients() {
    savepoints(Conns::Clients(1), "savepoints_clients").await;
}

async fn pid(p: &Processor<PgStore>, id: &str) -> Result<i32, idem_core::Error> {
    match p
        .process(&msg(id), async |tx| {
            Ok::<_, BoxError>(tx.query_one("SELECT pg_backend_pid()", &[]).await?.get(0))
        })
        .await?
    {
        Outcome::Processed(pid) => Ok(pid),
        other => panic!("{id} was not new: {other:?}"),
    }
}

/// Waits up to 5 s for backend `pid` to end.
async fn gone(admin: &Client, pid: i32) -> bool {
    for _ in 0..50 {
        let alive = admin
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity")
            .get::<_, bool>(0);
        if !alive {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_past_its_lifetime_is_replaced() {
    let Some((schema, store, admin)) = setup("pool_lifetime", Conns::Pool(1)).await else {
        return;
    };
    let store = store
        .max_lifetime(Some(Duration::from_millis(1500)))
        .idle_timeout(None);
    let p = Processor::builder(store, "life").build().expect("p");
    let first = pid(&p, "l-1").await.expect("l-1");
    assert_eq!(pid(&p, "l-2").await.expect("l-2"), first, "reused");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_ne!(pid(&p, "l-3").await.expect("l-3"), first, "replaced");
    assert!(gone(&admin, first).await, "and closed");
    drop((p, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_idle_too_long_is_replaced() {
    let Some((schema, store, admin)) = setup("pool_idle", Conns::Pool(1)).await else {
        return;
    };
    let store = store
        .max_lifetime(None)
        .idle_timeout(Some(Duration::from_millis(1500)));
    let p = Processor::builder(store, "idle").build().expect("p");
    let first = pid(&p, "i-1").await.expect("i-1");
    for id in ["i-2", "i-3", "i-4"] {
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(pid(&p, id).await.expect(id), first, "{id}: reused");
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_ne!(pid(&p, "i-5").await.expect("i-5"), first, "replaced");
    assert!(gone(&admin, first).await, "and closed");
    drop((p, admin));
    schema.drop().await;
}

/// Two claims refused as read-only on one pooled connection (a role whose sessions start
/// read-only), then the "failover" (new sessions writable): the third transaction runs on a
/// new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_answering_read_only_is_replaced() {
    let Some((schema, _store, admin)) = setup("pool_read_only", Conns::Pool(1)).await else {
        return;
    };
    let role = unique_name("idem_ro", "pg");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {s} TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {role};
             ALTER ROLE {role} SET default_transaction_read_only = on;",
            s = schema.name()
        ))
        .await
        .expect("read-only role");
    let mut config = common::config(&schema);
    config.user(&role);
    let store = PgStore::from_pool(common::pool(&config, 1));
    let p = Processor::builder(store, "ro").build().expect("p");
    let backends = async || -> Vec<i32> {
        admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE usename = $1",
                &[&role],
            )
            .await
            .expect("backends")
            .iter()
            .map(|r| r.get(0))
            .collect()
    };

    let refused = pid(&p, "r-1").await.expect_err("read-only");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    let before = backends().await;
    admin
        .batch_execute(&format!(
            "ALTER ROLE {role} SET default_transaction_read_only = off"
        ))
        .await
        .expect("fail over");
    let refused = pid(&p, "r-1")
        .await
        .expect_err("the same read-only session");
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    let new = pid(&p, "r-1")
        .await
        .expect("after two read-only answers the connection is replaced");
    assert!(!before.contains(&new), "{new} vs {before:?}");
    assert!(gone(&admin, before[0]).await, "the read-only one is closed");
    drop(p);
    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';
             DROP OWNED BY {role}; DROP ROLE {role};"
        ))
        .await;
    drop(admin);
    schema.drop().await;
}

/// A TCP proxy to the server that can stop forwarding, as a peer that vanished behind a
/// network dropping its packets.
struct Proxy {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let frozen = Arc::new(AtomicBool::new(false));
        let stopped = frozen.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    if stopped.load(Ordering::SeqCst) {
                        let _ = swallow(client).await;
                        return;
                    }
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        let (mut cr, mut cw) = client.into_split();
                        let (mut sr, mut sw) = server.into_split();
                        let up_stopped = stopped.clone();
                        tokio::join!(
                            pump(&mut cr, &mut sw, &up_stopped),
                            pump(&mut sr, &mut cw, &stopped)
                        );
                    }
                });
            }
        });
        Self { addr, frozen }
    }

    /// `direct`'s database, user and options, through this proxy (`Config::host` adds a
    /// host rather than replacing one, hence a new `Config`).
    fn config(&self, direct: &Config) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.addr.port())
            .dbname(direct.get_dbname().unwrap_or("postgres"))
            .options(direct.get_options().unwrap_or_default());
        if let Some(user) = direct.get_user() {
            config.user(user);
        }
        if let Some(password) = direct.get_password() {
            config.password(password);
        }
        config
    }
}

async fn swallow(mut client: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    while client.read(&mut buf).await? > 0 {}
    Ok(())
}

/// Copies `from` to `to`, dropping everything while `frozen`.
async fn pump(
    from: &mut (impl AsyncReadExt + Unpin),
    to: &mut (impl AsyncWriteExt + Unpin),
    frozen: &AtomicBool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        if !frozen.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

/// A `BEGIN` that gets no answer fails as unavailable within the bound instead of waiting
/// until TCP gives up, and its connection is closed: the pool opens a new one once the path
/// forwards again; a plain client is dropped for good.
async fn begin_hangs(conns: Conns, test: &str) {
    let Some((schema, _store, admin)) = setup(test, conns).await else {
        return;
    };
    let direct = common::config(&schema);
    let Some(Host::Tcp(host)) = direct.get_hosts().first() else {
        panic!("IDEM_TEST_POSTGRES_URL must name a TCP host for this test");
    };
    let port = direct.get_ports().first().copied().unwrap_or(5432);
    let upstream = tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let through = proxy.config(&direct);
    let store = common::store(&through, conns)
        .await
        .begin_timeout(Some(Duration::from_secs(2)));
    let p = Processor::builder(store.clone(), "hang")
        .build()
        .expect("p");
    let first = pid(&p, "h-1").await.expect("h-1");

    proxy.frozen.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let hung = tokio::time::timeout(Duration::from_secs(15), pid(&p, "h-2"))
        .await
        .expect("a BEGIN without an answer fails instead of hanging");
    let err = hung.expect_err("no answer");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    proxy.frozen.store(false, Ordering::SeqCst);
    match conns {
        Conns::Pool(_) => {
            let next = pid(&p, "h-2").await.expect("a new connection");
            assert_ne!(next, first);
        }
        Conns::Clients(_) => {
            let err = pid(&p, "h-2")
                .await
                .expect_err("the only client was dropped");
            assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        }
    }
    drop((p, store));
    let _ = admin
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await;
    drop(admin);
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_that_hangs_times_out_pooled() {
    begin_hangs(Conns::Pool(1), "begin_hangs_pooled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_that_hangs_times_out_on_clients() {
    begin_hangs(Conns::Clients(1), "begin_hangs_clients").await;
}
