//! The JetStream adapter against a real server (`IDEM_TEST_NATS_URL`).

use crate::common;

use std::time::Duration;

use common::Streams;
use idem_consumer::{DeadLetter, DeadLetterReason, Delivery, Source};
use idem_core::ErrorKind;
use idem_nats::{JetStreamSource, async_nats};
use idem_testkit::{service_url, services::NATS, unique_name};

async fn streams(test: &str) -> Option<Streams> {
    let url = service_url(NATS, test)?;
    Some(Streams::create(url, unique_name("idem", test)).await)
}

async fn source(s: &Streams, ack_wait: Duration) -> JetStreamSource {
    JetStreamSource::builder(&s.stream, "worker")
        .ack_wait(ack_wait)
        .pull_expires(Duration::from_secs(2))
        .connect(&s.url)
        .await
        .expect("build source")
}

/// `next` with a deadline; `None` when nothing came.
async fn next_within(
    src: &mut JetStreamSource,
    max: usize,
    wait: Duration,
) -> Option<Vec<idem_nats::JetStreamDelivery>> {
    tokio::time::timeout(wait, src.next(max))
        .await
        .ok()
        .map(|r| r.expect("fetch"))
}

async fn ack_pending(s: &Streams) -> (u64, usize) {
    let info =
        s.js.get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
            "worker", &s.stream,
        )
        .await
        .expect("consumer")
        .get_info()
        .await
        .expect("consumer info");
    (info.num_pending, info.num_ack_pending)
}

#[tokio::test]
async fn publish_fetch_ack_round_trip() {
    let Some(s) = streams("publish_fetch_ack_round_trip").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(30)).await;
    let ack = s
        .producer
        .publish(s.subject.clone(), "order-1", "hello")
        .await
        .unwrap();
    assert!(!ack.duplicate);

    let got = next_within(&mut src, 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    let d = got.into_iter().next().unwrap();
    assert_eq!(d.payload(), b"hello");
    assert_eq!(d.header("Nats-Msg-Id").as_deref(), Some(&b"order-1"[..]));
    assert_eq!(
        src.default_id_source()
            .extract(&d)
            .map(|id| id.into_owned())
            .unwrap(),
        b"order-1"
    );
    assert_eq!(d.header("no-such-header"), None);
    assert_eq!(
        d.header("bad:name"),
        None,
        "an invalid name is absent, not a panic"
    );
    assert_eq!(d.previous_deliveries(), 0);
    assert_eq!(
        d.origin().to_string(),
        format!("stream {} seq {}", s.stream, ack.sequence)
    );
    d.ack().await.unwrap();

    assert_eq!(ack_pending(&s).await, (0, 0), "acked: nothing pending");
    assert!(
        next_within(&mut src, 10, Duration::from_secs(3))
            .await
            .is_none(),
        "an acked message does not come back"
    );
    src.close().await.unwrap();
    s.delete().await;
}

#[tokio::test]
async fn next_returns_at_most_max_and_loses_nothing() {
    let Some(s) = streams("next_returns_at_most_max").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(30)).await;
    for i in 0..7 {
        s.producer
            .publish(s.subject.clone(), format!("m-{i}"), "x")
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    while seen.len() < 7 {
        let got = next_within(&mut src, 3, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            !got.is_empty() && got.len() <= 3,
            "{} deliveries",
            got.len()
        );
        for d in got {
            seen.push(d.stream_sequence().unwrap());
            d.ack().await.unwrap();
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (1..=7).collect::<Vec<_>>());
    s.delete().await;
}

#[tokio::test]
async fn a_cancelled_next_loses_nothing() {
    let Some(s) = streams("a_cancelled_next_loses_nothing").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(30)).await;
    // Cancel a fetch while its pull request is open on the server...
    assert!(
        next_within(&mut src, 5, Duration::from_millis(300))
            .await
            .is_none()
    );
    // ...then publish: the message the open request receives is returned by the next call,
    // long before an ack wait could have brought it back.
    s.producer
        .publish(s.subject.clone(), "late", "x")
        .await
        .unwrap();
    let got = next_within(&mut src, 5, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].previous_deliveries(), 0);
    for d in got {
        d.ack().await.unwrap();
    }
    s.delete().await;
}

#[tokio::test]
async fn a_dropped_sources_open_pull_request_swallows_nothing() {
    let Some(s) = streams("dropped_source_swallows_nothing").await else {
        return;
    };
    // A long ack wait: a message delivered into the dropped source's pull request would only
    // come back after it, far beyond the deadline below.
    let mut gone = source(&s, Duration::from_secs(60)).await;
    assert!(
        next_within(&mut gone, 5, Duration::from_millis(300))
            .await
            .is_none()
    );
    drop(gone); // its pull request is still open on the server, nobody listens
    let mut fresh = source(&s, Duration::from_secs(60)).await;
    s.producer
        .publish(s.subject.clone(), "for-fresh", "x")
        .await
        .unwrap();
    let got = next_within(&mut fresh, 5, Duration::from_secs(5))
        .await
        .expect("the live source gets the message at once");
    assert_eq!(got[0].previous_deliveries(), 0);
    for d in got {
        d.ack().await.unwrap();
    }
    s.delete().await;
}

#[tokio::test]
async fn an_unacked_message_is_redelivered_after_the_ack_wait() {
    let Some(s) = streams("unacked_is_redelivered").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(1)).await;
    s.producer
        .publish(s.subject.clone(), "crashy", "payload")
        .await
        .unwrap();
    let first = next_within(&mut src, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(first[0].previous_deliveries(), 0);
    let seq = first[0].stream_sequence();
    drop(first); // neither acked nor nacked: a crashed consumer

    let again = next_within(&mut src, 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(again[0].stream_sequence(), seq);
    assert_eq!(again[0].previous_deliveries(), 1);
    assert_eq!(again[0].payload(), b"payload");
    for d in again {
        d.ack().await.unwrap();
    }
    s.delete().await;
}

#[tokio::test]
async fn abandon_redelivers_at_once() {
    let Some(s) = streams("abandon_redelivers_at_once").await else {
        return;
    };
    // A long ack wait: only the nak can bring the message back within the test's deadline.
    let mut src = source(&s, Duration::from_secs(60)).await;
    s.producer
        .publish(s.subject.clone(), "nak-me", "x")
        .await
        .unwrap();
    let first = next_within(&mut src, 1, Duration::from_secs(5))
        .await
        .unwrap();
    for d in first {
        d.abandon().await;
    }
    let again = next_within(&mut src, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(again[0].previous_deliveries(), 1);
    for d in again {
        d.ack().await.unwrap();
    }
    s.delete().await;
}

#[tokio::test]
async fn dead_letter_lands_in_the_dead_letter_stream_with_reason_and_original_payload() {
    let Some(s) = streams("dead_letter_lands").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(30)).await;
    assert_eq!(src.dead_letter_subject(), s.dead_letter_subject);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", "00-abc-def-01");
    let payload: &[u8] = b"\x00not json\xff";
    s.producer
        .publish_with_headers(s.subject.clone(), "poison-1", headers, payload)
        .await
        .unwrap();

    let got = next_within(&mut src, 1, Duration::from_secs(5))
        .await
        .unwrap();
    let reason = DeadLetter::new(DeadLetterReason::Undecodable, "line one\nline two")
        .with_context("billing", 3);
    for d in got {
        d.dead_letter(&reason).await.unwrap();
    }

    let dls = s.read(&s.dlq_stream, 1, Duration::from_secs(5)).await;
    assert_eq!(dls.len(), 1);
    let dl = &dls[0];
    assert_eq!(&dl.payload[..], payload, "payload byte for byte");
    let h = dl.headers.as_ref().unwrap();
    let get = |name: &str| h.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(
        get("idem-dead-letter-reason").as_deref(),
        Some("undecodable")
    );
    assert_eq!(
        get("idem-dead-letter-detail").as_deref(),
        Some("line one line two")
    );
    assert_eq!(get("idem-consumer").as_deref(), Some("billing"));
    assert_eq!(get("idem-attempts").as_deref(), Some("3"));
    assert_eq!(get("traceparent").as_deref(), Some("00-abc-def-01"));
    assert_eq!(
        get("idem-original-Nats-Msg-Id").as_deref(),
        Some("poison-1")
    );
    assert_eq!(
        get("idem-original-stream").as_deref(),
        Some(s.stream.as_str())
    );
    assert_eq!(get("idem-original-sequence").as_deref(), Some("1"));
    assert_eq!(
        get("idem-original-subject").as_deref(),
        Some(s.subject.as_str())
    );

    assert_eq!(
        ack_pending(&s).await,
        (0, 0),
        "the original was acknowledged"
    );
    s.delete().await;
}

#[tokio::test]
async fn one_message_dead_lettered_by_two_consumers_gives_two_dead_letters() {
    let Some(s) = streams("dead_lettered_by_two_consumers").await else {
        return;
    };
    let mut worker = source(&s, Duration::from_secs(30)).await;
    let mut audit = JetStreamSource::builder(&s.stream, "audit")
        .connect(&s.url)
        .await
        .unwrap();
    // A publish directive that holds for the original stream but would fail on the
    // dead-letter stream if it were copied as is.
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Expected-Stream", s.stream.as_str());
    s.producer
        .publish_with_headers(s.subject.clone(), "shared", h, "x")
        .await
        .unwrap();
    for src in [&mut worker, &mut audit] {
        let got = next_within(src, 1, Duration::from_secs(5)).await.unwrap();
        for d in got {
            let reason = DeadLetter::new(DeadLetterReason::Rejected, "test");
            d.dead_letter(&reason).await.unwrap();
        }
    }
    // Both land although they carry the same producer ID: the dead letter's own
    // Nats-Msg-Id is per (stream message, consumer).
    let dls = s.read(&s.dlq_stream, 2, Duration::from_secs(5)).await;
    assert_eq!(dls.len(), 2, "each consumer's dead letter is kept");
    for dl in &dls {
        let h = dl.headers.as_ref().unwrap();
        assert_eq!(
            h.get("idem-original-Nats-Msg-Id").map(|v| v.as_str()),
            Some("shared")
        );
        assert_eq!(
            h.get("idem-original-Nats-Expected-Stream")
                .map(|v| v.as_str()),
            Some(s.stream.as_str()),
            "publish directives are kept under a prefix, not applied to the dead letter"
        );
    }
    s.delete().await;
}

#[tokio::test]
async fn a_failed_dead_letter_publish_leaves_the_original_unacknowledged() {
    let Some(s) = streams("failed_dead_letter_publish").await else {
        return;
    };
    let mut src = source(&s, Duration::from_secs(1)).await;
    s.producer
        .publish(s.subject.clone(), "stuck", "x")
        .await
        .unwrap();
    // The dead-letter stream disappears after the source checked it.
    s.js.delete_stream(&s.dlq_stream).await.unwrap();
    let got = next_within(&mut src, 1, Duration::from_secs(5))
        .await
        .unwrap();
    let reason = DeadLetter::new(DeadLetterReason::Rejected, "no");
    for d in got {
        let err = d.dead_letter(&reason).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    }
    let again = next_within(&mut src, 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(again[0].previous_deliveries(), 1, "redelivered, not acked");
    for d in again {
        d.ack().await.unwrap();
    }
    s.js.delete_stream(&s.stream).await.unwrap();
}

#[tokio::test]
async fn misconfigurations_are_refused_at_build() {
    let Some(s) = streams("misconfigurations_are_refused").await else {
        return;
    };
    let build = |b: idem_nats::JetStreamSourceBuilder| {
        let url = s.url.clone();
        async move { b.connect(&url).await.unwrap_err() }
    };
    let err = build(JetStreamSource::builder("no_such_stream_x", "w")).await;
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");

    let err =
        build(JetStreamSource::builder(&s.stream, "w").dead_letter_subject("nobody.keeps.this"))
            .await;
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("no stream captures"), "{err}");

    // The consumed stream's own subject: dead letters would come straight back.
    let err =
        build(JetStreamSource::builder(&s.stream, "w").dead_letter_subject(s.subject.clone()))
            .await;
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("consumed again"), "{err}");

    let err = build(JetStreamSource::builder(&s.stream, "w").dead_letter_subject("bad.*")).await;
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");

    let err = s
        .producer
        .publish(s.subject.clone(), "", "x")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidMessageId);
    s.delete().await;
}
