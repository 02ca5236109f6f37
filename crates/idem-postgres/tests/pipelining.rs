//! Proves the claim costs no round trip of its own: the store talks to the real PostgreSQL
//! server in `IDEM_TEST_POSTGRES_URL` through a proxy that holds every answer back for a
//! while and counts the client's *flights* — the times the client sent something after an
//! answer reached it. Held-back answers make the count exact: whatever the client sends
//! without waiting reaches the proxy long before any answer does, so it joins the flight
//! before it. A new message through `Processor::process` then takes as many flights as the
//! same handler without idem (`BEGIN`, the handler's statements, `COMMIT`), and one more
//! through the same store with the trait's default `begin_and_claim` (begin, then claim).
//! The same holds on a claims table partitioned by the ID's time, whose claim binds the
//! partition key too.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    BatchClaimStore, BoxError, ClaimRequest, ClaimStore, ConsumerName, Error, Fingerprint, Message,
    MessageId, Migrate, Outcome, Processor, Stamp, Timestamp, TransactionalStore,
};
use idem_postgres::partition::{Day, Partitioning};
use idem_postgres::tokio_postgres::config::Host;
use idem_postgres::tokio_postgres::{Config, NoTls};
use idem_postgres::{PgStore, PgTx};
use idem_testkit::isolated::PgSchema;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long the proxy holds each answer back: far longer than the client takes between two
/// requests it sends without waiting.
const HOLD: Duration = Duration::from_millis(40);

/// Counts the flights of every connection through it.
struct Proxy {
    addr: SocketAddr,
    flights: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let flights = Arc::new(AtomicUsize::new(0));
        let counted = flights.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(upstream).await.expect("upstream");
                tokio::spawn(relay(client, server, counted.clone()));
            }
        });
        Self { addr, flights }
    }

    /// Flights since the last call.
    fn take(&self) -> usize {
        self.flights.swap(0, Ordering::SeqCst)
    }
}

async fn relay(client: TcpStream, server: TcpStream, flights: Arc<AtomicUsize>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Whether an answer reached the client since it last sent something.
    let answered = Arc::new(AtomicBool::new(true));
    let seen = answered.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = client_read.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if seen.swap(false, Ordering::SeqCst) {
                flights.fetch_add(1, Ordering::SeqCst);
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = server_read.read(&mut buf).await {
            if n == 0 {
                break;
            }
            tokio::time::sleep(HOLD).await;
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            answered.store(true, Ordering::SeqCst);
        }
    };
    tokio::join!(up, down);
}

/// The same store, with the trait's default `begin_and_claim`: `BEGIN`, wait, claim.
#[derive(Debug, Clone)]
struct Unpipelined(PgStore);

impl TransactionalStore for Unpipelined {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, Error> {
        self.0.begin().await
    }

    async fn commit(&self, tx: PgTx) -> Result<(), Error> {
        self.0.commit(tx).await
    }

    async fn rollback(&self, tx: PgTx) -> Result<(), Error> {
        self.0.rollback(tx).await
    }
}

impl ClaimStore for Unpipelined {
    fn max_message_id_len(&self) -> usize {
        self.0.max_message_id_len()
    }

    async fn claim(
        &self,
        tx: &mut PgTx,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        self.0.claim(tx, claim).await
    }
}

impl BatchClaimStore for Unpipelined {
    async fn claim_many(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        self.0.claim_many(tx, consumer, items, at).await
    }
}

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"{}".to_vec())
}

/// The handler under test: two statements, as the benchmark's (a charge and a balance).
async fn handler(tx: &PgTx, key: &str) -> Result<(), BoxError> {
    let insert = tx
        .prepare_cached("INSERT INTO effects (key) VALUES ($1)")
        .await?;
    tx.execute(&insert, &[&key]).await?;
    let count = tx.prepare_cached("UPDATE counter SET n = n + 1").await?;
    tx.execute(&count, &[]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_message_costs_the_round_trips_of_the_bare_handler() {
    round_trips(
        "a_new_message_costs_the_round_trips_of_the_bare_handler",
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_message_costs_the_round_trips_of_the_bare_handler_partitioned() {
    round_trips(
        "a_new_message_costs_the_round_trips_of_the_bare_handler_partitioned",
        true,
    )
    .await;
}

/// `partitioned`: every ID's time is the test's start, so each claim goes into today's day
/// partition.
async fn round_trips(test: &str, partitioned: bool) {
    let Some(schema) = PgSchema::create("idem_pipe", test).await else {
        return;
    };
    let direct = common::config(&schema);
    let admin = common::client(&direct).await;
    admin
        .batch_execute(
            "CREATE TABLE effects (key text NOT NULL);
             CREATE TABLE counter (n bigint NOT NULL); INSERT INTO counter VALUES (0);",
        )
        .await
        .expect("tables");
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

    // One plain client through the proxy: every flight of the store's is counted.
    let mut config = Config::new();
    config
        .host("127.0.0.1")
        .port(proxy.addr.port())
        .dbname(direct.get_dbname().unwrap_or("postgres"))
        .options(direct.get_options().unwrap_or_default());
    if let Some(user) = direct.get_user() {
        config.user(user);
    }
    if let Some(password) = direct.get_password() {
        config.password(password);
    }
    let (client, connection) = config
        .connect(NoTls)
        .await
        .expect("connect through the proxy");
    tokio::spawn(connection);
    let store = PgStore::from_client(client);
    let today = partitioned.then(|| {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch")
            .as_micros();
        Timestamp::from_micros(i64::try_from(micros).expect("in range"))
    });
    let store = match today {
        Some(now) => store
            .partitioned(
                Partitioning::by("pipelining-today", move |_: &MessageId| Some(now))
                    .expect("named"),
            )
            .expect("partitioned"),
        None => store,
    };
    store.migrate().await.expect("migrate");
    let idem = Processor::builder(store.clone(), "pipe")
        .build()
        .expect("p");
    let unpipelined = Processor::builder(Unpipelined(store.clone()), "pipe-default")
        .build()
        .expect("p");

    // Statements are prepared once per connection: warm every path up first.
    let bare = async |key: &str| -> Result<(), BoxError> {
        let tx = store.begin_tx().await?;
        handler(&tx, key).await?;
        tx.commit().await?;
        Ok(())
    };
    bare("warm-bare").await.expect("bare");
    let processed = |o: Result<Outcome<()>, idem_core::Error>| {
        assert!(matches!(o, Ok(Outcome::Processed(()))), "{o:?}");
    };
    processed(
        idem.process(&msg("warm"), async |tx| handler(tx, "w").await)
            .await,
    );
    processed(
        unpipelined
            .process(&msg("warm"), async |tx| handler(tx, "w").await)
            .await,
    );
    let dup = idem
        .process(&msg("warm"), async |tx| handler(tx, "w").await)
        .await;
    assert!(matches!(dup, Ok(Outcome::Duplicate)), "{dup:?}");
    let set = [msg("warm-set-1"), msg("warm-set-2")];
    idem.process_batch_set(&set, async |tx, _fresh| handler(tx, "ws").await)
        .await
        .expect("set");
    proxy.take();

    bare("bare").await.expect("bare");
    let bare_flights = proxy.take();
    assert_eq!(bare_flights, 4, "BEGIN, two statements, COMMIT");

    processed(
        idem.process(&msg("m-1"), async |tx| handler(tx, "m-1").await)
            .await,
    );
    assert_eq!(
        proxy.take(),
        bare_flights,
        "a new message costs no round trip more than the bare handler"
    );

    processed(
        unpipelined
            .process(&msg("m-1"), async |tx| handler(tx, "m-1").await)
            .await,
    );
    assert_eq!(
        proxy.take(),
        bare_flights + 1,
        "begin, then claim, is one round trip more"
    );

    let dup = idem
        .process(&msg("m-1"), async |tx| handler(tx, "m-1").await)
        .await;
    assert!(matches!(dup, Ok(Outcome::Duplicate)), "{dup:?}");
    assert_eq!(
        proxy.take(),
        3,
        "a duplicate: BEGIN and the claim, the stored fingerprint, ROLLBACK"
    );

    let set = [msg("s-1"), msg("s-2"), msg("s-3")];
    let batch = idem
        .process_batch_set(&set, async |tx, fresh| {
            assert_eq!(fresh.len(), 3);
            handler(tx, "s").await
        })
        .await
        .expect("set batch");
    assert!(batch.output.is_some());
    assert_eq!(
        proxy.take(),
        bare_flights,
        "a batch of new messages: BEGIN and the batch claim, the handler, COMMIT"
    );

    if let Some(now) = today {
        let part = format!("idem_processed_p{}", Day::of(now).suffix());
        let count = "SELECT count(*) FROM idem_processed WHERE tableoid::regclass::text = $1";
        let (in_day, all) = (
            common::count(&admin, count, &[&part]).await,
            common::count(&admin, "SELECT count(*) FROM idem_processed", &[]).await,
        );
        assert_eq!((in_day, all), (9, 9), "every claim went into {part}");
    }
    drop((idem, unpipelined, store, admin));
    schema.drop().await;
}
