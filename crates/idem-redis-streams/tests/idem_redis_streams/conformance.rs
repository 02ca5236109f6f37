//! The shared broker conformance suite against a real Redis (`IDEM_TEST_REDIS_URL`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem_core::Error;
use idem_redis_streams::{RedisStreamProducer, RedisStreamSource, RedisStreamSourceBuilder};
use idem_testkit::{BrokerFixture, DeadLettered};
use redis::aio::ConnectionManager;

/// Short enough that the redelivery checks finish quickly, long enough that a slow test
/// handler (300 ms) is never reclaimed while it runs.
const MIN_IDLE: Duration = Duration::from_millis(1500);
const BLOCK: Duration = Duration::from_millis(200);

const EMPTY_FIELD: &str = "empty message_id field";

struct RedisFixture {
    url: String,
    stream: String,
    conn: ConnectionManager,
    producer: RedisStreamProducer,
    sources: AtomicU32,
}

impl RedisFixture {
    fn options(&self, consumer: String) -> RedisStreamSourceBuilder {
        RedisStreamSource::builder(&self.stream, "conformance", consumer)
            .min_idle(MIN_IDLE)
            .block(BLOCK)
    }

    fn dead_letter_stream(&self) -> String {
        self.options("any".into()).dead_letter_stream_key()
    }

    /// `XADD` of `fields`, bypassing the producer helper.
    async fn xadd(&self, fields: &[(&str, &[u8])]) {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
        let _: String = cmd
            .query_async(&mut self.conn.clone())
            .await
            .expect("XADD without the producer");
    }
}

impl BrokerFixture for RedisFixture {
    type Source = RedisStreamSource;
    const URL_VAR: &'static str = idem_testkit::services::REDIS;
    /// Redis's `proto-max-bulk-len` (its default, 512 MiB) bounds each field; a 10 MiB ID
    /// and a 10 MiB payload go through.
    const MAX_ID_BYTES: usize = 512 * 1024 * 1024;
    const MAX_MESSAGE_BYTES: usize = 512 * 1024 * 1024;
    const EMPTY_ID_FORMS: &'static [&'static str] = &[EMPTY_FIELD];

    async fn setup(url: String, name: String) -> Self {
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let conn = ConnectionManager::new(client)
            .await
            .expect("connect to redis");
        let producer = RedisStreamProducer::new(conn.clone());
        Self {
            url,
            stream: name,
            conn,
            producer,
            sources: AtomicU32::new(0),
        }
    }

    async fn try_publish(&self, id: Option<&[u8]>, payload: &[u8]) -> Result<(), Error> {
        match id {
            Some(id) => self
                .producer
                .publish(&self.stream, id, payload)
                .await
                .map(drop),
            None => {
                self.xadd(&[("payload", payload)]).await;
                Ok(())
            }
        }
    }

    /// The producer refuses an empty ID; another client may still write the field empty.
    async fn publish_empty_id_form(&self, form: &'static str, payload: &[u8]) {
        assert_eq!(form, EMPTY_FIELD);
        self.xadd(&[("message_id", b""), ("payload", payload)])
            .await;
    }

    async fn source(&self) -> RedisStreamSource {
        // Each source is a distinct group member, as separate processes would be.
        let n = self.sources.fetch_add(1, Ordering::Relaxed);
        self.options(format!("member-{n}"))
            .connect(&self.url)
            .await
            .expect("source connects")
    }

    async fn dead_letters(&self, n: usize, timeout: Duration) -> Vec<DeadLettered> {
        let deadline = Instant::now() + timeout;
        loop {
            let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(self.dead_letter_stream())
                .arg("-")
                .arg("+")
                .query_async(&mut self.conn.clone())
                .await
                .expect("XRANGE dead letters");
            if entries.ids.len() >= n || Instant::now() >= deadline {
                return entries.ids.into_iter().map(to_dead_lettered).collect();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn redelivery_timeout(&self) -> Duration {
        MIN_IDLE + BLOCK + Duration::from_secs(2)
    }

    async fn teardown(self) {
        let _: () = redis::cmd("DEL")
            .arg(&self.stream)
            .arg(self.dead_letter_stream())
            .query_async(&mut self.conn.clone())
            .await
            .expect("DEL");
    }
}

fn to_dead_lettered(entry: redis::streams::StreamId) -> DeadLettered {
    let mut headers = HashMap::new();
    let mut payload = Vec::new();
    for (k, v) in entry.map {
        let bytes: Vec<u8> = redis::from_redis_value(v).expect("field bytes");
        if k == "payload" {
            payload = bytes.clone();
        }
        headers.insert(k, String::from_utf8_lossy(&bytes).into_owned());
    }
    DeadLettered { payload, headers }
}

idem_testkit::broker_conformance_tests!(RedisFixture);
