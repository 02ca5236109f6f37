//! The opt-in local cache of completed claims (`Consumer::local_cache`): what it answers, and
//! above all what it must never hold. Over an in-memory fake claim store that counts the
//! transactions it is asked for (a cached duplicate costs none), and one PostgreSQL run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_consumer::{
    CancellationToken, Consumer, Handler, InMemoryBroker, Json, LocalCache, REASON_HEADER,
    RetryPolicy, RunStats, SetHandler, Settled,
};
use idem_core::{
    BatchClaimStore, BoxError, ClaimRequest, ClaimStore, ConsumerName, Error, ErrorKind,
    Fingerprint, Identified, Message, MessageId, Processor, Stamp, TransactionalStore,
};

#[derive(Debug, serde::Deserialize)]
struct Ping {
    n: i64,
}

// ---- an in-memory fake claim store ------------------------------------------------------------

#[derive(Debug, Default)]
struct Db {
    /// Committed claims: ID → fingerprint.
    claims: HashMap<Vec<u8>, Fingerprint>,
    /// Committed effects: (ID, n).
    effects: Vec<(Vec<u8>, i64)>,
    /// Transactions begun: what a cached duplicate saves.
    begins: u64,
    /// IDs sent in claim statements.
    claimed: Vec<Vec<u8>>,
}

/// Claims in memory, no concurrency control (the tests run one message at a time): enough to
/// see which deliveries reach the store. `lose_commits` commits fail as a connection lost
/// during `COMMIT` (outcome unknown) without committing.
#[derive(Debug, Clone, Default)]
struct MemoryClaims {
    db: Arc<Mutex<Db>>,
    lose_commits: Arc<AtomicU32>,
}

#[derive(Debug, Default)]
struct MemTx {
    claims: Vec<(Vec<u8>, Fingerprint)>,
    effects: Vec<(Vec<u8>, i64)>,
}

impl MemoryClaims {
    fn db(&self) -> std::sync::MutexGuard<'_, Db> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn begins(&self) -> u64 {
        self.db().begins
    }
    fn effects(&self) -> usize {
        self.db().effects.len()
    }
}

impl TransactionalStore for MemoryClaims {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, Error> {
        self.db().begins += 1;
        Ok(MemTx::default())
    }

    async fn commit(&self, tx: MemTx) -> Result<(), Error> {
        let lose = self
            .lose_commits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            return Err(Error::new(
                ErrorKind::OutcomeUnknown,
                "connection lost during COMMIT",
            ));
        }
        let mut db = self.db();
        db.claims.extend(tx.claims);
        db.effects.extend(tx.effects);
        Ok(())
    }

    async fn rollback(&self, _tx: MemTx) -> Result<(), Error> {
        Ok(())
    }

    async fn probe(&self) -> Result<(), Error> {
        Ok(())
    }
}

impl ClaimStore for MemoryClaims {
    fn max_message_id_len(&self) -> usize {
        255
    }

    async fn claim(
        &self,
        tx: &mut MemTx,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        let id = claim.id.as_bytes().to_vec();
        let mut db = self.db();
        db.claimed.push(id.clone());
        if let Some(fp) = db.claims.get(&id) {
            return Ok(Some(*fp));
        }
        if let Some((_, fp)) = tx.claims.iter().find(|(i, _)| *i == id) {
            return Ok(Some(*fp));
        }
        tx.claims.push((id, *claim.fingerprint));
        Ok(None)
    }
}

impl BatchClaimStore for MemoryClaims {
    async fn claim_many(
        &self,
        tx: &mut MemTx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let mut found = Vec::with_capacity(items.len());
        for (id, fingerprint) in items {
            let claim = ClaimRequest {
                consumer,
                id,
                fingerprint,
                at,
            };
            found.push(self.claim(tx, claim).await?);
        }
        Ok(found)
    }
}

/// A payload [`Record`] rejects the first time it sees it (rolled back, dead-lettered).
const REJECTED_ONCE: i64 = 7;

/// Records `n` in the transaction; rejects [`REJECTED_ONCE`] while it has rejections left.
#[derive(Default)]
struct Record {
    rejections: AtomicU32,
}

impl Record {
    /// Rejects [`REJECTED_ONCE`] until its message is dead-lettered once in `mode`: a set
    /// batch that fails is redone message by message, so there it takes two rejections.
    fn for_mode(mode: Mode) -> Self {
        let n = if mode == Mode::Set { 2 } else { 1 };
        Self {
            rejections: AtomicU32::new(n),
        }
    }
}

impl Handler<MemTx, Ping> for Record {
    type Output = ();
    async fn handle(&self, tx: &mut MemTx, msg: &Message<Ping>) -> Result<(), BoxError> {
        let reject = msg.payload().n == REJECTED_ONCE
            && self
                .rejections
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if reject {
            return Err(Error::reject("rejected once").into());
        }
        tx.effects
            .push((msg.message_id().as_bytes().to_vec(), msg.payload().n));
        Ok(())
    }
}

impl SetHandler<MemTx, Ping> for Record {
    type Output = ();
    async fn handle_set(&self, tx: &mut MemTx, msgs: &[&Message<Ping>]) -> Result<(), BoxError> {
        for m in msgs {
            Handler::handle(self, tx, m).await?;
        }
        Ok(())
    }
}

// ---- running a consumer over a fixed stream ---------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    PerMessage,
    Batch,
    Set,
}

const MODES: [Mode; 3] = [Mode::PerMessage, Mode::Batch, Mode::Set];

fn publish(broker: &InMemoryBroker, id: &str, n: i64) {
    broker.publish(&[("message-id", id.as_bytes())], format!(r#"{{"n":{n}}}"#));
}

fn processor(store: &MemoryClaims, keep_for: Duration) -> Arc<Processor<MemoryClaims>> {
    let p = Processor::builder(store.clone(), "cache")
        .retention(idem_core::Retention::new(keep_for, keep_for).expect("retention"))
        .build()
        .expect("processor");
    Arc::new(p)
}

fn quick() -> RetryPolicy {
    RetryPolicy::exponential(3, Duration::from_millis(1), Duration::from_millis(5))
}

/// Consumes `broker` until it is drained (it must be closed) with the cache on or off; batches
/// of 2 in the batch modes, one fetch per batch.
async fn consume(
    processor: Arc<Processor<MemoryClaims>>,
    broker: &InMemoryBroker,
    mode: Mode,
    cache: Option<LocalCache>,
) -> RunStats {
    let mut consumer = Consumer::new(processor, broker.source()).retry(quick());
    if let Some(c) = cache {
        consumer = consumer.local_cache(c);
    }
    let stop = CancellationToken::new();
    let handler = Record::for_mode(mode);
    match mode {
        Mode::PerMessage => consumer.run(Json::<Ping>::new(), handler, stop).await,
        Mode::Batch => {
            consumer
                .batch(2)
                .run(Json::<Ping>::new(), handler, stop)
                .await
        }
        Mode::Set => {
            consumer
                .batch(2)
                .run_set(Json::<Ping>::new(), handler, stop)
                .await
        }
    }
    .expect("run")
}

fn reasons(broker: &InMemoryBroker) -> Vec<String> {
    broker
        .settled()
        .into_iter()
        .filter_map(|(_, _, s)| match s {
            Settled::DeadLettered(h) => h
                .into_iter()
                .find(|(name, _)| *name == REASON_HEADER)
                .map(|(_, v)| v),
            Settled::Acked => None,
        })
        .collect()
}

// ---- the rules --------------------------------------------------------------------------------

/// m-1 m-2 | m-1 m-3 | m-2 m-1: with the cache the repeats of committed IDs are acked without a
/// transaction, and in batch modes left out of the batch's claim; without it each goes to the
/// store. Either way one effect per ID, and the repeats count as duplicates.
#[tokio::test]
async fn in_memory_store_cached_redeliveries_are_duplicates_without_a_round_trip() {
    for mode in MODES {
        let mut begins = Vec::new();
        for cache in [None, Some(LocalCache::new(100))] {
            let store = MemoryClaims::default();
            let broker = InMemoryBroker::new();
            for (id, n) in [
                ("m-1", 1),
                ("m-2", 2),
                ("m-1", 1),
                ("m-3", 3),
                ("m-2", 2),
                ("m-1", 1),
            ] {
                publish(&broker, id, n);
            }
            broker.close();
            let stats = consume(
                processor(&store, Duration::from_secs(3600)),
                &broker,
                mode,
                cache,
            )
            .await;
            assert_eq!(stats.processed, 3, "{mode:?} cache {cache:?}: {stats:?}");
            assert_eq!(stats.duplicates, 3, "{mode:?} cache {cache:?}: {stats:?}");
            assert_eq!(store.effects(), 3, "{mode:?} cache {cache:?}");
            let hits = if cache.is_some() { 3 } else { 0 };
            assert_eq!(
                stats.cache_hits, hits,
                "{mode:?} cache {cache:?}: {stats:?}"
            );
            if cache.is_some() {
                let claimed = store.db().claimed.clone();
                assert_eq!(
                    claimed,
                    [b"m-1".to_vec(), b"m-2".to_vec(), b"m-3".to_vec()],
                    "{mode:?}: only the new IDs reach a claim statement"
                );
            }
            begins.push(store.begins());
        }
        let (off, on) = (begins[0], begins[1]);
        match mode {
            Mode::PerMessage => assert_eq!((off, on), (6, 3), "{mode:?}"),
            // Batches: [m-1 m-2] [m-1 m-3] [m-2 m-1]; the last is all cached.
            _ => assert_eq!((off, on), (3, 2), "{mode:?}"),
        }
    }
}

/// A message whose transaction rolled back (its handler rejected it once) is not cached: its
/// redelivery, with the same payload, goes to the store and runs.
#[tokio::test]
async fn in_memory_store_a_rolled_back_message_is_not_cached() {
    for mode in MODES {
        let store = MemoryClaims::default();
        let broker = InMemoryBroker::new();
        publish(&broker, "m-1", REJECTED_ONCE); // rejected: rolled back, dead-lettered
        publish(&broker, "m-2", 2);
        publish(&broker, "m-1", REJECTED_ONCE); // the same message again: runs now
        publish(&broker, "m-3", 3);
        broker.close();
        let stats = consume(
            processor(&store, Duration::from_secs(3600)),
            &broker,
            mode,
            Some(LocalCache::new(100)),
        )
        .await;
        assert_eq!(
            stats.processed, 3,
            "{mode:?}: the redelivery after a rollback ran: {stats:?}"
        );
        assert_eq!(stats.dead_lettered, 1, "{mode:?}: {stats:?}");
        assert_eq!(stats.cache_hits, 0, "{mode:?}: {stats:?}");
        assert_eq!(store.effects(), 3, "{mode:?}");
    }
}

/// A commit whose outcome is unknown (the connection lost during `COMMIT`; here it did not
/// commit) is not cached: the retry goes to the store, finds no claim and runs.
#[tokio::test]
async fn in_memory_store_a_commit_with_an_unknown_outcome_is_not_cached() {
    for mode in MODES {
        let store = MemoryClaims::default();
        store.lose_commits.store(1, Ordering::SeqCst);
        let broker = InMemoryBroker::new();
        publish(&broker, "m-1", 1);
        broker.close();
        let stats = consume(
            processor(&store, Duration::from_secs(3600)),
            &broker,
            mode,
            Some(LocalCache::new(100)),
        )
        .await;
        assert_eq!(stats.processed, 1, "{mode:?}: the retry ran: {stats:?}");
        assert_eq!(stats.cache_hits, 0, "{mode:?}: {stats:?}");
        assert_eq!(store.effects(), 1, "{mode:?}: the effect committed once");
        assert_eq!(broker.settled().len(), 1, "{mode:?}");
    }
}

/// A cached ID delivered with another payload is not answered from the cache: the store
/// reports the conflict and it is dead-lettered `conflict`, as without the cache.
#[tokio::test]
async fn in_memory_store_a_cached_id_with_another_payload_is_still_a_conflict() {
    for mode in MODES {
        let store = MemoryClaims::default();
        let broker = InMemoryBroker::new();
        publish(&broker, "m-1", 1);
        publish(&broker, "m-2", 2);
        publish(&broker, "m-1", 999); // a producer bug: same ID, other payload
        publish(&broker, "m-3", 3);
        broker.close();
        let stats = consume(
            processor(&store, Duration::from_secs(3600)),
            &broker,
            mode,
            Some(LocalCache::new(100)),
        )
        .await;
        assert_eq!(stats.conflicts, 1, "{mode:?}: {stats:?}");
        assert_eq!(stats.cache_hits, 0, "{mode:?}: {stats:?}");
        assert_eq!(reasons(&broker), ["conflict"], "{mode:?}");
        assert_eq!(store.effects(), 3, "{mode:?}");
    }
}

/// An entry lives no longer than the claims' retention: past it, a redelivery goes to the
/// store again (here the fake store still has the claim and answers "duplicate").
#[tokio::test]
async fn in_memory_store_entries_expire_with_the_retention() {
    let store = MemoryClaims::default();
    let broker = InMemoryBroker::new();
    let p = processor(&store, Duration::from_millis(300));
    let consumer = Consumer::new(p, broker.source())
        .retry(quick())
        .local_cache(LocalCache::new(100));
    let run = tokio::spawn(consumer.run(
        Json::<Ping>::new(),
        Record::default(),
        CancellationToken::new(),
    ));
    publish(&broker, "m-1", 1);
    publish(&broker, "m-1", 1); // within the retention: from the cache
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before = store.begins();
    tokio::time::sleep(Duration::from_millis(300)).await;
    publish(&broker, "m-1", 1); // past the retention: from the store
    broker.close();
    let stats = run.await.expect("task").expect("run");
    assert_eq!((stats.processed, stats.duplicates), (1, 2), "{stats:?}");
    assert_eq!(stats.cache_hits, 1, "{stats:?}");
    assert_eq!(
        (before, store.begins()),
        (1, 2),
        "the expired entry went to the store"
    );
}

/// A naturally idempotent processor writes no claims: every redelivery runs again, so none is
/// answered from the cache.
#[tokio::test]
async fn in_memory_store_naturally_idempotent_consumers_cache_nothing() {
    let store = MemoryClaims::default();
    let broker = InMemoryBroker::new();
    publish(&broker, "m-1", 1);
    publish(&broker, "m-1", 1);
    broker.close();
    let p = Processor::builder(store.clone(), "natural")
        .naturally_idempotent()
        .build()
        .expect("processor");
    let stats = Consumer::new(Arc::new(p), broker.source())
        .local_cache(LocalCache::new(100))
        .run(
            Json::<Ping>::new(),
            Record::default(),
            CancellationToken::new(),
        )
        .await
        .expect("run");
    assert_eq!((stats.processed, stats.cache_hits), (2, 0), "{stats:?}");
}

// ---- PostgreSQL -------------------------------------------------------------------------------

/// Inserts the message's `n` into `pings`, through the claim's transaction.
struct Insert;

impl Handler<idem_sql::PostgresTx, Ping> for Insert {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut idem_sql::PostgresTx,
        msg: &Message<Ping>,
    ) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO pings (n) VALUES ($1)")
            .bind(msg.payload().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl SetHandler<idem_sql::PostgresTx, Ping> for Insert {
    type Output = ();
    async fn handle_set(
        &self,
        tx: &mut idem_sql::PostgresTx,
        msgs: &[&Message<Ping>],
    ) -> Result<(), BoxError> {
        let ns: Vec<i64> = msgs.iter().map(|m| m.payload().n).collect();
        sqlx::query("INSERT INTO pings (n) SELECT * FROM unnest($1::bigint[])")
            .bind(&ns)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// On the real server, in every mode: 30 messages, each redelivered once right behind its
/// batch, and one ID republished with another payload. Every effect once, every repeat a
/// duplicate (most from the cache), the conflict dead-lettered `conflict`.
#[tokio::test]
async fn postgres_cached_redeliveries_keep_exactly_once_and_conflicts() {
    let test = "postgres_cached_redeliveries_keep_exactly_once_and_conflicts";
    let Some(schema) = idem_testkit::isolated::PgSchema::create("lcache", test).await else {
        return;
    };
    let store = idem_sql::PostgresStore::from_pool(schema.pool(4).await);
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    sqlx::query("CREATE TABLE pings (n bigint NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    for (i, mode) in MODES.into_iter().enumerate() {
        let broker = InMemoryBroker::new();
        let base = 1000 * i as i64;
        for chunk in (0..30).collect::<Vec<i64>>().chunks(2) {
            for n in chunk {
                publish(&broker, &format!("m-{}", base + n), base + n);
            }
            for n in chunk {
                publish(&broker, &format!("m-{}", base + n), base + n);
            }
        }
        publish(&broker, &format!("m-{base}"), -1); // same ID, another payload
        broker.close();
        let processor = Arc::new(
            Processor::builder(store.clone(), format!("lcache-{i}"))
                .build()
                .expect("processor"),
        );
        let consumer = Consumer::new(processor, broker.source())
            .retry(quick())
            .local_cache(LocalCache::new(1_000));
        let stop = CancellationToken::new();
        let stats = match mode {
            Mode::PerMessage => consumer.run(Json::<Ping>::new(), Insert, stop).await,
            Mode::Batch => {
                consumer
                    .batch(2)
                    .run(Json::<Ping>::new(), Insert, stop)
                    .await
            }
            Mode::Set => {
                consumer
                    .batch(2)
                    .run_set(Json::<Ping>::new(), Insert, stop)
                    .await
            }
        }
        .expect("run");
        assert_eq!(stats.processed, 30, "{mode:?}: {stats:?}");
        assert_eq!(stats.duplicates, 30, "{mode:?}: {stats:?}");
        assert_eq!(
            stats.cache_hits, 30,
            "{mode:?}: every redelivery from the cache: {stats:?}"
        );
        assert_eq!(stats.conflicts, 1, "{mode:?}: {stats:?}");
        assert_eq!(reasons(&broker), ["conflict"], "{mode:?}");
        let (rows, distinct): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT n) FROM pings WHERE n >= $1 AND n < $1 + 1000",
        )
        .bind(base)
        .fetch_one(store.pool())
        .await
        .expect("count");
        assert_eq!(
            (rows, distinct),
            (30, 30),
            "{mode:?}: one effect per message"
        );
    }
    schema.drop().await;
}
