//! The idempotent-request conformance suite against a real Redis (`IDEM_TEST_REDIS_URL`),
//! each check under its own key prefix.

use idem_core::BoxError;
use idem_redis::{RedisRequestStore, RedisTx};
use idem_testkit::RequestFixture;
use redis::aio::ConnectionManager;

struct RedisFixture {
    store: RedisRequestStore,
    /// For the effects and the teardown, beside the store's own connection.
    conn: ConnectionManager,
    prefix: String,
}

impl RedisFixture {
    /// Effects live under the fixture's prefix, so the teardown removes them too.
    fn effect_key(&self, key: &str) -> String {
        format!("{}:effects:{key}", self.prefix)
    }
}

impl RequestFixture for RedisFixture {
    type Store = RedisRequestStore;
    const SHARED_TRANSACTION: bool = false;
    const EXPIRES_ITSELF: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let url = idem_testkit::service_url(idem_testkit::services::REDIS, test)?;
        let prefix = idem_testkit::unique_name("idem_req", test);
        let store = RedisRequestStore::builder(&url)
            .key_prefix(&prefix)
            .connect()
            .await
            .expect("store connects to redis");
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let conn = ConnectionManager::new(client)
            .await
            .expect("connect to redis");
        Some(Self {
            store,
            conn,
            prefix,
        })
    }

    fn store(&self) -> RedisRequestStore {
        self.store.clone()
    }

    /// No transaction to write through: the effect is an `INCR`, done at once.
    async fn record_effect(&self, _tx: &mut RedisTx, key: &str) -> Result<(), BoxError> {
        let _: i64 = redis::cmd("INCR")
            .arg(self.effect_key(key))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        let n: Option<i64> = redis::cmd("GET")
            .arg(self.effect_key(key))
            .query_async(&mut self.conn.clone())
            .await
            .expect("GET effect counter");
        n.unwrap_or(0)
    }

    async fn teardown(self) {
        let mut conn = self.conn.clone();
        let pattern = format!("{}:*", self.prefix);
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            if !keys.is_empty() {
                let _: i64 = redis::cmd("DEL")
                    .arg(&keys)
                    .query_async(&mut conn)
                    .await
                    .expect("DEL");
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

idem_testkit::request_conformance_tests!(RedisFixture);
