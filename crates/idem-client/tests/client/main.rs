//! idem-client against the test kit's fake card processor over TCP (and, in `idem_http`, against
//! idem-http's layer): one key for every retry, one charge whatever the network loses, and
//! each retry rule and bound.

use std::time::Duration;

use idem_client::{
    DerivedKey, Error, ErrorKind, IdempotencyMiddleware, IdempotentRequestExt, Jitter, Outcome,
    RetryPolicy,
};
use idem_core::{ConsumerName, MessageId};
use idem_testkit::fake_processor::{FakeProcessor, Fault};
use reqwest_middleware::{ClientWithMiddleware, RequestBuilder};

const CHARGE: &str = r#"{"account":"acct_1","amount_cents":1250}"#;

/// Fast retries (1 ms doubling to 10 ms, no jitter) so real-time tests stay short.
fn fast() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(4)
        .backoff(Duration::from_millis(1), Duration::from_millis(10))
        .jitter(Jitter::None)
}

/// No reqwest timer (no timeout, no idle-pool sweep): under paused time a pending timer
/// would make tokio jump the clock while the client waits on the socket.
fn client_with(http: reqwest::Client, policy: RetryPolicy) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(http)
        .with(IdempotencyMiddleware::new(policy).seed(7))
        .build()
}

fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    let http = reqwest::Client::builder()
        .pool_idle_timeout(None)
        .build()
        .expect("client");
    client_with(http, policy)
}

fn charge(client: &ClientWithMiddleware, p: &FakeProcessor) -> RequestBuilder {
    client
        .post(p.charges_url())
        .header("content-type", "application/json")
        .body(CHARGE)
}

fn outcome(resp: &reqwest::Response) -> Outcome {
    Outcome::of(resp)
        .expect("an outcome on every response")
        .clone()
}

async fn processor() -> FakeProcessor {
    FakeProcessor::start().await.expect("fake processor")
}

#[tokio::test]
async fn every_retry_carries_the_same_fresh_key() {
    let p = processor().await;
    p.fault_next(Fault::Status {
        status: 503,
        retry_after: None,
    });
    p.fault_next(Fault::Status {
        status: 502,
        retry_after: None,
    });
    let resp = charge(&client(fast()), &p).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let o = outcome(&resp);
    assert_eq!(o.attempts, 3);
    assert!(!o.replayed && !o.gave_up);
    let key = o.key.expect("a POST gets a key").to_string();
    assert_eq!(
        uuid::Uuid::parse_str(&key).map(|u| u.get_version_num()),
        Ok(4),
        "{key}"
    );
    let stats = p.stats();
    assert_eq!(stats.calls, 3);
    assert_eq!(
        stats.calls_for(&key),
        3,
        "all three attempts sent {key}: {stats:?}"
    );
    assert_eq!(stats.effects_for(&key), 1);
}

#[tokio::test]
async fn two_logical_requests_get_two_keys() {
    let p = processor().await;
    let c = client(fast());
    let a = outcome(&charge(&c, &p).send().await.expect("a"));
    let b = outcome(&charge(&c, &p).send().await.expect("b"));
    assert_ne!(a.key, b.key);
    assert_eq!(p.stats().total_effects(), 2);
}

#[tokio::test]
async fn a_charge_whose_answer_was_lost_happens_once() {
    let p = processor().await;
    p.fault_next(Fault::ChargeThenDrop);
    let resp = charge(&client(fast()), &p)
        .idempotency_key("order-7-charge")
        .send()
        .await
        .expect("the retry gets the stored charge");
    assert_eq!(resp.status(), 200);
    let o = outcome(&resp);
    assert_eq!((o.attempts, o.replayed), (2, true));
    let body: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(body["amount_cents"], 1250);
    let stats = p.stats();
    assert_eq!(stats.calls_for("order-7-charge"), 2);
    assert_eq!(stats.effects_for("order-7-charge"), 1);
    assert_eq!(stats.total_effects(), 1);
}

#[tokio::test]
async fn transient_statuses_are_retried() {
    let p = processor().await;
    let c = client(fast());
    for status in [500, 502, 503, 504, 429, 408, 425] {
        p.fault_next(Fault::Status {
            status,
            retry_after: None,
        });
        let resp = charge(&c, &p).send().await.expect("send");
        assert_eq!(resp.status(), 200, "after {status}");
        assert_eq!(outcome(&resp).attempts, 2, "after {status}");
    }
    assert_eq!(p.stats().calls, 14);
    assert_eq!(p.stats().total_effects(), 7);
}

#[tokio::test]
async fn final_statuses_are_not_retried() {
    let p = processor().await;
    let c = client(fast());
    // 409 without Retry-After is a conflict, not "in progress".
    for status in [400, 401, 404, 409, 422, 501, 505] {
        p.fault_next(Fault::Status {
            status,
            retry_after: None,
        });
        let resp = charge(&c, &p).send().await.expect("send");
        assert_eq!(resp.status().as_u16(), status);
        let o = outcome(&resp);
        assert_eq!((o.attempts, o.gave_up), (1, false), "{status}");
    }
    assert_eq!(p.stats().calls, 7);
}

#[tokio::test]
async fn a_reused_key_with_another_body_is_not_retried() {
    let p = processor().await;
    let c = client(fast());
    charge(&c, &p)
        .idempotency_key("k-1")
        .send()
        .await
        .expect("first");
    let resp = c
        .post(p.charges_url())
        .idempotency_key("k-1")
        .header("content-type", "application/json")
        .body(r#"{"account":"acct_1","amount_cents":9999}"#)
        .send()
        .await
        .expect("second");
    assert_eq!(resp.status(), 422);
    assert_eq!(outcome(&resp).attempts, 1);
    assert_eq!(p.stats().effects_for("k-1"), 1);
}

#[tokio::test]
async fn a_timeout_is_retried_with_the_same_key() {
    let p = processor().await;
    p.fault_next(Fault::Hang);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let resp = charge(&client_with(http, fast()), &p)
        .idempotency_key("slow-1")
        .send()
        .await
        .expect("the retry answers");
    assert_eq!(resp.status(), 200);
    assert_eq!(outcome(&resp).attempts, 2);
    assert_eq!(p.stats().calls_for("slow-1"), 2);
    assert_eq!(p.stats().effects_for("slow-1"), 1);
}

#[tokio::test]
async fn a_refused_connection_is_retried_then_reported_with_its_outcome() {
    // A port nobody listens on: bind, learn the port, close.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port");
    let c = client(fast().max_attempts(3));
    let req = c
        .post(format!("http://{addr}/v1/charges"))
        .body(CHARGE)
        .build()
        .expect("request");
    let mut ext = http::Extensions::new();
    let err = c
        .execute_with_extensions(req, &mut ext)
        .await
        .expect_err("nothing listens");
    assert!(err.is_connect(), "{err}");
    let o = ext
        .get::<Outcome>()
        .expect("the outcome is in the caller's extensions");
    assert_eq!((o.attempts, o.gave_up), (3, true));
}

#[tokio::test]
async fn a_key_in_progress_is_waited_for_then_replayed() {
    let p = processor().await;
    let c = client(fast());
    p.fault_next(Fault::Slow { ms: 400 });
    let first = charge(&c, &p).idempotency_key("dup").send();
    let second = async {
        // Let the first one take the key.
        tokio::time::sleep(Duration::from_millis(100)).await;
        charge(&c, &p).idempotency_key("dup").send().await
    };
    let (first, second) = tokio::join!(first, second);
    let (first, second) = (first.expect("first"), second.expect("second"));
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let o = outcome(&second);
    assert_eq!(o.attempts, 2, "409 with Retry-After: 1, then the replay");
    assert!(o.replayed);
    assert!(
        o.waited >= Duration::from_secs(1),
        "Retry-After honoured: {:?}",
        o.waited
    );
    assert_eq!(p.stats().effects_for("dup"), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_honoured_on_tokios_clock() {
    let p = processor().await;
    p.fault_next(Fault::Status {
        status: 503,
        retry_after: Some("30".into()),
    });
    let policy = fast().max_elapsed(Duration::from_secs(60));
    let started = tokio::time::Instant::now();
    let resp = charge(&client(policy), &p).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let o = outcome(&resp);
    assert_eq!(o.attempts, 2);
    assert_eq!(o.waited, Duration::from_secs(30));
    assert!(started.elapsed() >= Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_budget_returns_the_answer() {
    let p = processor().await;
    p.fault_next(Fault::Status {
        status: 503,
        retry_after: Some("120".into()),
    });
    let policy = fast().max_elapsed(Duration::from_secs(60));
    let resp = charge(&client(policy), &p).send().await.expect("send");
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "120");
    let o = outcome(&resp);
    assert_eq!((o.attempts, o.gave_up, o.waited), (1, true, Duration::ZERO));
    assert_eq!(p.stats().calls, 1);
}

#[tokio::test]
async fn attempts_are_bounded() {
    let p = processor().await;
    for _ in 0..5 {
        p.fault_next(Fault::Status {
            status: 503,
            retry_after: None,
        });
    }
    let resp = charge(&client(fast().max_attempts(3)), &p)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 503);
    let o = outcome(&resp);
    assert_eq!((o.attempts, o.gave_up), (3, true));
    assert_eq!(p.stats().calls, 3);
    assert_eq!(p.stats().total_effects(), 0);
}

#[tokio::test(start_paused = true)]
async fn total_time_is_bounded() {
    let p = processor().await;
    for _ in 0..10 {
        p.fault_next(Fault::Status {
            status: 503,
            retry_after: None,
        });
    }
    // 10 s between attempts: attempts at 0 s, 10 s, 20 s; the next would start at 30 s > 25 s.
    let policy = RetryPolicy::default()
        .max_attempts(10)
        .max_elapsed(Duration::from_secs(25))
        .backoff(Duration::from_secs(10), Duration::from_secs(10))
        .jitter(Jitter::None);
    let resp = charge(&client(policy), &p).send().await.expect("send");
    assert_eq!(resp.status(), 503);
    let o = outcome(&resp);
    assert_eq!(
        (o.attempts, o.gave_up, o.waited),
        (3, true, Duration::from_secs(20))
    );
}

/// Three 503s then a charge, through a middleware with jitter seeded `seed`: the time waited.
async fn jittered_wait(seed: u64) -> Duration {
    let p = processor().await;
    for _ in 0..3 {
        p.fault_next(Fault::Status {
            status: 503,
            retry_after: None,
        });
    }
    let policy = RetryPolicy::default()
        .max_elapsed(Duration::from_secs(600))
        .backoff(Duration::from_secs(10), Duration::from_secs(15))
        .jitter(Jitter::Full);
    let http = reqwest::Client::builder()
        .pool_idle_timeout(None)
        .build()
        .expect("client");
    let c = reqwest_middleware::ClientBuilder::new(http)
        .with(IdempotencyMiddleware::new(policy).seed(seed))
        .build();
    let resp = charge(&c, &p).send().await.expect("send");
    let o = outcome(&resp);
    assert_eq!(o.attempts, 4);
    o.waited
}

#[tokio::test(start_paused = true)]
async fn full_jitter_waits_at_most_the_capped_delay_and_follows_the_seed() {
    let waited = jittered_wait(7).await;
    // Without jitter: 10 + 15 + 15 s. With it: less, and not nothing.
    assert!(
        waited < Duration::from_secs(40) && waited > Duration::ZERO,
        "{waited:?}"
    );
    assert_eq!(
        jittered_wait(7).await,
        waited,
        "the same seed, the same delays"
    );
    assert_ne!(jittered_wait(8).await, waited, "another seed, other delays");
}

#[tokio::test]
async fn a_post_without_a_key_is_never_retried() {
    let p = processor().await;
    p.fault_next(Fault::Status {
        status: 503,
        retry_after: None,
    });
    let resp = charge(&client(fast()), &p)
        .without_idempotency_key()
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 503);
    let o = outcome(&resp);
    assert_eq!((o.attempts, o.gave_up, o.key), (1, true, None));
    assert_eq!(p.stats().calls, 1);
    assert!(p.stats().calls_by_key.is_empty(), "no key was sent");
}

#[tokio::test]
async fn derived_and_header_keys_are_sent_as_given() {
    let p = processor().await;
    let c = client(fast());
    let consumer = ConsumerName::new("billing").expect("name");
    let id = MessageId::new("order-42").expect("id");
    let derived = DerivedKey::new(&consumer, &id, "card-charge");
    let resp = charge(&c, &p)
        .derived_key(derived)
        .send()
        .await
        .expect("send");
    assert_eq!(
        outcome(&resp).key.map(|k| k.to_string()),
        Some(derived.to_uuid_string())
    );
    assert_eq!(p.stats().effects_for(&derived.to_uuid_string()), 1);

    let resp = charge(&c, &p)
        .header("Idempotency-Key", "from-header")
        .send()
        .await
        .expect("send");
    assert_eq!(
        outcome(&resp).key.map(|k| k.to_string()).as_deref(),
        Some("from-header")
    );
    assert_eq!(p.stats().effects_for("from-header"), 1);
}

#[tokio::test]
async fn an_invalid_key_fails_before_sending() {
    let p = processor().await;
    let c = client(fast());
    for bad in [
        String::new(),
        "has space".into(),
        "k".repeat(256),
        "clé".into(),
    ] {
        let err = charge(&c, &p)
            .idempotency_key(bad.clone())
            .send()
            .await
            .expect_err("invalid key");
        let e =
            Error::of(&err).unwrap_or_else(|| panic!("an idem-client error for {bad:?}: {err}"));
        assert_eq!(e.kind(), ErrorKind::InvalidKey);
        let core = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<idem_core::Error>())
            .expect("idem-core's error inside");
        assert_eq!(
            core.kind(),
            idem_core::ErrorKind::Request(idem_core::RequestErrorKind::InvalidKey)
        );
    }
    assert_eq!(p.stats().calls, 0);
}

#[tokio::test]
async fn a_streaming_body_fails_clearly_when_a_retry_is_needed() {
    let p = processor().await;
    let c = client(fast());
    p.fault_next(Fault::Status {
        status: 503,
        retry_after: None,
    });
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = vec![Ok(bytes::Bytes::from(CHARGE))];
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let err = c
        .post(p.charges_url())
        .idempotency_key("stream-1")
        .body(body)
        .send()
        .await
        .expect_err("cannot resend a stream");
    let e = Error::of(&err).expect("an idem-client error");
    assert_eq!(e.kind(), ErrorKind::BodyNotReplayable);
    assert!(e.to_string().contains("stream"), "{e}");
    assert_eq!(p.stats().calls, 1);

    // Without a retry need, a stream goes through.
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = vec![Ok(bytes::Bytes::from(CHARGE))];
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let resp = c
        .post(p.charges_url())
        .body(body)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn faults_set_by_command_and_header_and_stats_over_http() {
    let p = processor().await;
    let plain = reqwest::Client::new();
    let r = plain
        .post(format!("{}/v1/_faults", p.url()))
        .header("content-type", "application/json")
        .body(r#"{"faults":[{"kind":"status","status":500}]}"#)
        .send()
        .await
        .expect("faults");
    assert_eq!(r.status(), 204);
    let c = client(fast().max_attempts(1));
    let resp = charge(&c, &p).send().await.expect("send");
    assert_eq!(resp.status(), 500);
    let resp = charge(&c, &p)
        .header("x-fake-fault", "status=418")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 418);
    let stats: serde_json::Value = plain
        .get(format!("{}/v1/_stats", p.url()))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("json");
    assert_eq!(stats["calls"], 2);
    assert_eq!(p.stats().total_effects(), 0);
}

mod idem_http;
