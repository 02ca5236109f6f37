//! Adapter-specific behaviour against a real Redis (`IDEM_TEST_REDIS_URL`): field mapping,
//! reclaiming a dead member's entries, resuming one's own, and the dead-letter stream.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_consumer::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, DETAIL_HEADER, DeadLetter, DeadLetterReason, Delivery,
    IdSource, REASON_HEADER, Source,
};
use idem_core::MessageId;
use idem_redis_streams::{
    ORIGINAL_ID_FIELD, ORIGINAL_STREAM_FIELD, RedisStreamProducer, RedisStreamSource,
    RedisStreamSourceBuilder, StartFrom,
};
use redis::aio::ConnectionManager;

/// One test's stream, its dead-letter stream and a raw connection to inspect them.
struct Ctx {
    url: String,
    stream: String,
    conn: ConnectionManager,
    producer: RedisStreamProducer,
}

impl Ctx {
    async fn new(test: &str) -> Option<Self> {
        let url = idem_testkit::service_url(idem_testkit::services::REDIS, test)?;
        let stream = idem_testkit::unique_name("idem_rs", test);
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let conn = ConnectionManager::new(client).await.expect("connect");
        let producer = RedisStreamProducer::new(conn.clone());
        Some(Self {
            url,
            stream,
            conn,
            producer,
        })
    }

    fn options(&self, consumer: &str) -> RedisStreamSourceBuilder {
        RedisStreamSource::builder(&self.stream, "g", consumer)
            .min_idle(Duration::from_secs(1))
            .block(Duration::from_millis(100))
    }

    async fn source(&self, consumer: &str) -> RedisStreamSource {
        self.options(consumer)
            .connect(&self.url)
            .await
            .expect("source connects")
    }

    fn dead_letter_stream(&self) -> String {
        self.options("x").dead_letter_stream_key()
    }

    async fn pending(&self) -> i64 {
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg("g")
            .query_async(&mut self.conn.clone())
            .await
            .expect("XPENDING");
        match summary {
            redis::Value::Array(v) => match v.first() {
                Some(redis::Value::Int(n)) => *n,
                other => panic!("unexpected XPENDING summary {other:?}"),
            },
            other => panic!("unexpected XPENDING summary {other:?}"),
        }
    }

    async fn dead_letters(&self) -> Vec<HashMap<String, Vec<u8>>> {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(self.dead_letter_stream())
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await
            .expect("XRANGE");
        reply
            .ids
            .into_iter()
            .map(|e| {
                e.map
                    .into_iter()
                    .map(|(k, v)| (k, redis::from_redis_value(v).expect("bytes")))
                    .collect()
            })
            .collect()
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

async fn next_one(source: &mut RedisStreamSource) -> idem_redis_streams::RedisStreamDelivery {
    let mut batch = tokio::time::timeout(Duration::from_secs(10), source.next(10))
        .await
        .expect("a delivery within 10 s")
        .expect("next succeeds");
    assert_eq!(batch.len(), 1, "{batch:?}");
    batch.remove(0)
}

#[tokio::test]
async fn round_trip_maps_fields_to_id_payload_and_headers() {
    let Some(ctx) = Ctx::new("round_trip").await else {
        return;
    };
    let mut source = ctx.source("c1").await;
    assert_eq!(source.default_id_source(), IdSource::header("message_id"));
    let id = MessageId::new("order-1").expect("valid");
    let payload = [0xff, 0x00, b'{', 0xfe]; // not UTF-8: bytes must survive as bytes
    let entry = ctx
        .producer
        .publish_with_fields(&ctx.stream, &id, &payload, &[("tenant", b"acme")])
        .await
        .expect("publish");

    let d = next_one(&mut source).await;
    assert_eq!(d.payload(), payload);
    assert_eq!(d.header("message_id").as_deref(), Some(&b"order-1"[..]));
    assert_eq!(d.header("tenant").as_deref(), Some(&b"acme"[..]));
    assert_eq!(d.header("absent"), None);
    assert_eq!(d.previous_deliveries(), 0);
    assert_eq!(d.entry_id(), entry);
    assert_eq!(
        d.origin().to_string(),
        format!("stream {} id {entry}", ctx.stream)
    );
    assert_eq!(ctx.pending().await, 1, "pending until acked");
    d.ack().await.expect("ack");
    assert_eq!(
        ctx.pending().await,
        0,
        "XACK removed it from the pending list"
    );
    ctx.teardown().await;
}

#[tokio::test]
async fn dead_members_entries_are_reclaimed_after_min_idle() {
    let Some(ctx) = Ctx::new("reclaim").await else {
        return;
    };
    let mut dead = ctx.source("dead").await;
    let mut alive = ctx.source("alive").await;
    ctx.producer
        .publish(&ctx.stream, "m-1", b"one")
        .await
        .expect("publish");

    let taken = next_one(&mut dead).await;
    let read_at = Instant::now();
    // The member dies with the entry unacknowledged.
    drop(taken);
    drop(dead);

    let d = next_one(&mut alive).await;
    assert!(
        read_at.elapsed() >= Duration::from_secs(1),
        "not reclaimed before min_idle: {:?}",
        read_at.elapsed()
    );
    assert_eq!(d.header("message_id").as_deref(), Some(&b"m-1"[..]));
    assert_eq!(d.payload(), b"one");
    assert!(d.previous_deliveries() >= 1, "{d:?}");
    d.ack().await.expect("ack");
    assert_eq!(ctx.pending().await, 0);
    ctx.teardown().await;
}

#[tokio::test]
async fn restarted_member_resumes_its_own_pending_entries_at_once() {
    let Some(ctx) = Ctx::new("resume").await else {
        return;
    };
    let mut first = ctx.source("pod-0").await;
    ctx.producer
        .publish(&ctx.stream, "m-1", b"one")
        .await
        .expect("publish");
    drop(next_one(&mut first).await);
    drop(first);

    // Same name, min_idle far away: only the own-pending re-read can hand it out now.
    let options = ctx.options("pod-0").min_idle(Duration::from_secs(3600));
    let mut restarted = options.connect(&ctx.url).await.expect("connect");
    let started = Instant::now();
    let d = next_one(&mut restarted).await;
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(d.payload(), b"one");
    assert_eq!(d.previous_deliveries(), 1, "{d:?}");
    d.ack().await.expect("ack");

    // New entries follow once the own pending list is drained.
    ctx.producer
        .publish(&ctx.stream, "m-2", b"two")
        .await
        .expect("publish");
    let d = next_one(&mut restarted).await;
    assert_eq!(d.payload(), b"two");
    assert_eq!(d.previous_deliveries(), 0);
    d.ack().await.expect("ack");
    ctx.teardown().await;
}

#[tokio::test]
async fn dead_letter_copies_fields_adds_reason_and_acks() {
    let Some(ctx) = Ctx::new("dead_letter").await else {
        return;
    };
    let mut source = ctx.source("c1").await;
    let payload = [b'x', 0x80, 0x00, b'y'];
    let entry = ctx
        .producer
        .publish_with_fields(&ctx.stream, "bad-1", &payload, &[("trace", b"t-9")])
        .await
        .expect("publish");
    let d = next_one(&mut source).await;
    let reason = DeadLetter::new(DeadLetterReason::Rejected, "unknown account\nsecond line")
        .with_context("billing", 3);
    d.dead_letter(&reason).await.expect("dead-letter");

    let letters = ctx.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let dl = &letters[0];
    assert_eq!(dl["payload"], payload, "payload intact, byte for byte");
    assert_eq!(dl["message_id"], b"bad-1");
    assert_eq!(dl["trace"], b"t-9");
    assert_eq!(dl[REASON_HEADER], b"rejected");
    assert_eq!(dl[DETAIL_HEADER], b"unknown account second line");
    assert_eq!(dl[CONSUMER_HEADER], b"billing");
    assert_eq!(dl[ATTEMPTS_HEADER], b"3");
    assert_eq!(dl[ORIGINAL_STREAM_FIELD], ctx.stream.as_bytes());
    assert_eq!(dl[ORIGINAL_ID_FIELD], entry.as_bytes());
    assert_eq!(ctx.pending().await, 0, "the original is acknowledged");
    ctx.teardown().await;
}

#[tokio::test]
async fn entry_without_payload_field_is_dead_lettered_by_the_adapter() {
    let Some(ctx) = Ctx::new("no_payload").await else {
        return;
    };
    let mut source = ctx.source("c1").await;
    let _: String = redis::cmd("XADD")
        .arg(&ctx.stream)
        .arg("*")
        .arg("message_id")
        .arg("np-1")
        .arg("body")
        .arg("misnamed")
        .query_async(&mut ctx.conn.clone())
        .await
        .expect("XADD");
    ctx.producer
        .publish(&ctx.stream, "ok-1", b"fine")
        .await
        .expect("publish");

    // The poison entry is never handed out; the good one is.
    let d = next_one(&mut source).await;
    assert_eq!(d.header("message_id").as_deref(), Some(&b"ok-1"[..]));
    d.ack().await.expect("ack");

    let letters = ctx.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let dl = &letters[0];
    assert_eq!(dl[REASON_HEADER], b"undecodable");
    let detail = String::from_utf8_lossy(&dl[DETAIL_HEADER]).into_owned();
    assert!(detail.contains("\"payload\""), "{detail}");
    assert_eq!(dl["message_id"], b"np-1");
    assert_eq!(dl["body"], b"misnamed");
    assert_eq!(ctx.pending().await, 0);
    ctx.teardown().await;
}

#[tokio::test]
async fn ensure_group_ahead_of_the_consumers_keeps_what_is_published_meanwhile() {
    let Some(ctx) = Ctx::new("ensure_group").await else {
        return;
    };
    ctx.producer
        .publish(&ctx.stream, "before", b"before")
        .await
        .expect("publish");
    // Created reading only what comes next; an existing group is left as it is.
    for _ in 0..2 {
        idem_redis_streams::ensure_group(
            &mut ctx.conn.clone(),
            &ctx.stream,
            "g",
            StartFrom::NewOnly,
        )
        .await
        .expect("ensure the group");
    }
    ctx.producer
        .publish(&ctx.stream, "meanwhile", b"meanwhile")
        .await
        .expect("publish");
    let mut source = ctx.source("c1").await;
    let d = next_one(&mut source).await;
    assert_eq!(
        d.payload(),
        b"meanwhile",
        "the group's start is where ensure_group put it"
    );
    d.ack().await.expect("ack");
    ctx.teardown().await;
}

#[tokio::test]
async fn group_starts_where_configured_and_is_recreated_after_loss() {
    let Some(ctx) = Ctx::new("start_from").await else {
        return;
    };
    ctx.producer
        .publish(&ctx.stream, "old", b"old")
        .await
        .expect("publish");
    let options = ctx.options("c1").start_from(StartFrom::NewOnly);
    let mut source = options.connect(&ctx.url).await.expect("connect");
    ctx.producer
        .publish(&ctx.stream, "new", b"new")
        .await
        .expect("publish");
    let d = next_one(&mut source).await;
    assert_eq!(
        d.payload(),
        b"new",
        "an entry older than the group is skipped"
    );
    d.ack().await.expect("ack");

    // A Redis restart without persistence forgets the group: the next fetch fails once,
    // recreates the group, and consuming resumes.
    let _: () = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&ctx.stream)
        .arg("g")
        .query_async(&mut ctx.conn.clone())
        .await
        .expect("XGROUP DESTROY");
    let err = source.next(10).await.expect_err("the group is gone");
    assert_eq!(err.kind(), idem_core::ErrorKind::Unavailable);
    ctx.producer
        .publish(&ctx.stream, "after", b"after")
        .await
        .expect("publish");
    let d = next_one(&mut source).await;
    assert_eq!(d.payload(), b"after");
    d.ack().await.expect("ack");
    ctx.teardown().await;
}

#[tokio::test]
async fn producer_trims_and_rejects_empty_ids() {
    let Some(ctx) = Ctx::new("producer").await else {
        return;
    };
    let producer = RedisStreamProducer::new(ctx.conn.clone()).max_len(10);
    let key = idem_core::DerivedKey::new(
        &idem_core::ConsumerName::new("c").expect("valid"),
        &MessageId::new("m").expect("valid"),
        "step",
    );
    for _ in 0..300 {
        producer
            .publish(&ctx.stream, &key, b"p")
            .await
            .expect("publish");
    }
    let len: i64 = redis::cmd("XLEN")
        .arg(&ctx.stream)
        .query_async(&mut ctx.conn.clone())
        .await
        .expect("XLEN");
    assert!(len < 300, "MAXLEN ~ trimmed the stream: {len}");
    let err = producer
        .publish(&ctx.stream, "", b"p")
        .await
        .expect_err("empty ID");
    assert_eq!(err.kind(), idem_core::ErrorKind::InvalidMessageId);
    ctx.teardown().await;
}

#[tokio::test]
async fn an_entry_still_in_flight_here_is_not_handed_out_twice() {
    let Some(ctx) = Ctx::new("in_flight").await else {
        return;
    };
    let mut source = ctx.source("c1").await;
    ctx.producer
        .publish(&ctx.stream, "slow", b"slow")
        .await
        .expect("publish");
    let slow = next_one(&mut source).await;
    // Past min_idle the entry is reclaimable, by this member too; it is still being handled.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    ctx.producer
        .publish(&ctx.stream, "next", b"next")
        .await
        .expect("publish");
    let d = next_one(&mut source).await;
    assert_eq!(d.payload(), b"next", "the slow entry is not returned again");
    d.ack().await.expect("ack");
    slow.ack().await.expect("ack");
    assert_eq!(ctx.pending().await, 0);
    ctx.teardown().await;
}

#[tokio::test]
async fn a_killed_connection_is_reported_unavailable_then_reconnected() {
    let Some(ctx) = Ctx::new("reconnect").await else {
        return;
    };
    // Redis 7.0 cannot tag connections (no lib-name in CLIENT LIST), so this test alone works
    // in database 15: the source's connections are the ones there that are not `own`.
    const DB: i64 = 15;
    let info = redis::IntoConnectionInfo::into_connection_info(ctx.url.as_str()).expect("URL");
    let settings = info.redis_settings().clone().set_db(DB);
    let client = redis::Client::open(info.set_redis_settings(settings)).expect("client");
    let mut own = ConnectionManager::new(client.clone())
        .await
        .expect("connect");
    let own_id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut own)
        .await
        .expect("CLIENT ID");
    let producer = RedisStreamProducer::new(own.clone());
    let mut source = ctx
        .options("c1")
        .connect_with(client)
        .await
        .expect("connect");
    producer
        .publish(&ctx.stream, "a", b"a")
        .await
        .expect("publish");
    next_one(&mut source).await.ack().await.expect("ack");

    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut own)
        .await
        .expect("CLIENT LIST");
    let ids: Vec<String> = list
        .lines()
        .filter(|l| l.contains(&format!(" db={DB} ")) && !l.starts_with(&format!("id={own_id} ")))
        .filter_map(|l| {
            l.split(' ')
                .find_map(|kv| kv.strip_prefix("id="))
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "the reader and the command connection: {list}"
    );
    for id in &ids {
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async(&mut own)
            .await
            .expect("CLIENT KILL");
    }

    producer
        .publish(&ctx.stream, "b", b"b")
        .await
        .expect("publish");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut failures = 0;
    let d = loop {
        match source.next(10).await {
            Ok(mut batch) => break batch.remove(0),
            Err(e) => {
                assert_eq!(e.kind(), idem_core::ErrorKind::Unavailable, "{e}");
                failures += 1;
                assert!(Instant::now() < deadline, "no reconnect within 10 s: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(d.payload(), b"b");
    d.ack().await.expect("ack after reconnect");
    // One failed fetch per killed connection is expected; more would mean no reconnect.
    assert!(failures <= 4, "{failures} failed fetches");
    let _: () = redis::cmd("DEL")
        .arg(&ctx.stream)
        .query_async(&mut own)
        .await
        .expect("DEL");
    ctx.teardown().await;
}

#[tokio::test]
async fn a_refused_dead_letter_leaves_the_original_unacknowledged() {
    let Some(ctx) = Ctx::new("refused_dead_letter").await else {
        return;
    };
    let mut source = ctx.source("c1").await;
    // The dead-letter key holds a string, so XADD to it fails.
    let _: () = redis::cmd("SET")
        .arg(ctx.dead_letter_stream())
        .arg("not a stream")
        .query_async(&mut ctx.conn.clone())
        .await
        .expect("SET");
    ctx.producer
        .publish(&ctx.stream, "bad", b"bad")
        .await
        .expect("publish");
    let d = next_one(&mut source).await;
    let reason = DeadLetter::new(DeadLetterReason::Rejected, "no");
    let err = d.dead_letter(&reason).await.expect_err("XADD is refused");
    assert_eq!(err.kind(), idem_core::ErrorKind::Unavailable);
    assert_eq!(
        ctx.pending().await,
        1,
        "not acknowledged without its dead letter"
    );
    ctx.teardown().await;
}
