//! Adapter behaviour against the real Mosquitto: IDs, acks, persistent-session redelivery,
//! dead letters, abandon, and MQTT 3.1.1.

use crate::common;

use std::time::Duration;

use idem_consumer::{DeadLetter, DeadLetterReason, Delivery, IdSource, Source};
use idem_core::ErrorKind;
use idem_mqtt::{DeadLetterEnvelope, MqttProducer, MqttSource, Protocol};
use idem_testkit::unique_name;

const WAIT: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(700);

#[tokio::test]
async fn round_trip_reads_the_id_property_and_acks() {
    let Some(url) = common::url("round_trip_reads_the_id_property_and_acks") else {
        return;
    };
    let topic = unique_name("mqtt", "round_trip");
    let id = format!("{topic}-c");
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    assert_eq!(source.default_id_source(), IdSource::header("message-id"));
    assert_eq!(source.dead_letter_topic(), format!("{topic}/dead-letter"));
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    producer
        .publish(&topic, Some("order-1"), b"\x00binary\xff")
        .await
        .unwrap();

    let got = common::take(&mut source, 1, WAIT).await;
    assert_eq!(got.len(), 1);
    let d = &got[0];
    assert_eq!(d.payload(), b"\x00binary\xff");
    assert_eq!(d.header("message-id").as_deref(), Some(&b"order-1"[..]));
    assert_eq!(
        IdSource::header("message-id").extract(d).unwrap().as_ref(),
        b"order-1"
    );
    assert_eq!(d.previous_deliveries(), 0);
    assert!(
        d.origin()
            .to_string()
            .starts_with(&format!("topic {topic} pkid ")),
        "{}",
        d.origin()
    );
    common::ack_all(got).await;
    source.close().await.unwrap();

    // Acked: the resumed session has nothing to redeliver.
    let mut again = common::builder(&id, &topic).connect(&url).await.unwrap();
    assert!(common::take(&mut again, 1, QUIET).await.is_empty());
    again.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

/// Acks written just before the DISCONNECT of `close` all count. Mosquitto answers each PUBACK
/// with the next queued message; a client that closed its socket as soon as the DISCONNECT was
/// written reset the connection with those answers unread, and the reset discarded the PUBACKs
/// the broker had not read yet: 19 of 20 acknowledged messages came back.
#[tokio::test]
async fn acks_just_before_close_are_kept_while_the_broker_sends_more() {
    let Some(url) = common::url("acks_just_before_close_are_kept_while_the_broker_sends_more")
    else {
        return;
    };
    let topic = unique_name("mqtt", "acks_before_close");
    let id = format!("{topic}-c");
    // Creates the session, so what is published now queues in it.
    common::builder(&id, &topic)
        .connect(&url)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    // More than Mosquitto sends before the first acks (its default in-flight window is 20).
    let total = 60;
    for i in 0..total {
        producer
            .publish(&topic, Some(&format!("m-{i}")), b"{}")
            .await
            .unwrap();
    }
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    let got = common::take(&mut source, 20, WAIT).await;
    assert_eq!(got.len(), 20);
    let acked: std::collections::BTreeSet<String> = got
        .iter()
        .map(|d| String::from_utf8_lossy(&d.header("message-id").unwrap()).into_owned())
        .collect();
    common::ack_all(got).await;
    source.close().await.unwrap();

    let mut again = common::builder(&id, &topic).connect(&url).await.unwrap();
    let mut rest = common::take(&mut again, total - acked.len(), WAIT).await;
    rest.extend(common::take(&mut again, total, QUIET).await);
    let back: Vec<String> = rest
        .iter()
        .map(|d| String::from_utf8_lossy(&d.header("message-id").unwrap()).into_owned())
        .filter(|id| acked.contains(id))
        .collect();
    assert!(
        back.is_empty(),
        "acknowledged before close, yet redelivered: {back:?}"
    );
    assert_eq!(
        rest.len(),
        total - acked.len(),
        "every other message arrives"
    );
    common::ack_all(rest).await;
    again.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

#[tokio::test]
async fn unacked_message_is_redelivered_when_the_session_reconnects() {
    let Some(url) = common::url("unacked_message_is_redelivered_when_the_session_reconnects")
    else {
        return;
    };
    let topic = unique_name("mqtt", "redeliver");
    let id = format!("{topic}-c");
    let mut first = common::builder(&id, &topic).connect(&url).await.unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    producer.publish(&topic, Some("m-1"), b"one").await.unwrap();
    let got = common::take(&mut first, 1, WAIT).await;
    assert_eq!(got.len(), 1);
    // Killed: no ack, no DISCONNECT.
    drop(got);
    drop(first);

    let mut second = common::builder(&id, &topic).connect(&url).await.unwrap();
    let again = common::take(&mut second, 1, WAIT).await;
    assert_eq!(
        again.len(),
        1,
        "the unacknowledged message comes back to the same client ID"
    );
    assert_eq!(again[0].payload(), b"one");
    assert_eq!(again[0].header("message-id").as_deref(), Some(&b"m-1"[..]));
    assert_eq!(
        again[0].previous_deliveries(),
        1,
        "DUP flag set on redelivery"
    );
    common::ack_all(again).await;
    second.close().await.unwrap();

    let mut third = common::builder(&id, &topic).connect(&url).await.unwrap();
    assert!(
        common::take(&mut third, 1, QUIET).await.is_empty(),
        "acked for good"
    );
    third.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

#[tokio::test]
async fn messages_published_while_the_consumer_is_down_wait_in_its_session() {
    let Some(url) =
        common::url("messages_published_while_the_consumer_is_down_wait_in_its_session")
    else {
        return;
    };
    let topic = unique_name("mqtt", "offline");
    let id = format!("{topic}-c");
    common::builder(&id, &topic)
        .connect(&url)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    for i in 0..5 {
        producer
            .publish(&topic, Some(&format!("m-{i}")), b"{}")
            .await
            .unwrap();
    }
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    let got = common::take(&mut source, 5, WAIT).await;
    assert_eq!(got.len(), 5);
    common::ack_all(got).await;
    source.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

#[tokio::test]
async fn dead_letter_keeps_payload_and_properties_and_adds_the_reason() {
    let Some(url) = common::url("dead_letter_keeps_payload_and_properties_and_adds_the_reason")
    else {
        return;
    };
    let topic = unique_name("mqtt", "dead_letter");
    let (id, dlq_id) = (format!("{topic}-c"), format!("{topic}-d"));
    let dl_topic = format!("{topic}/dead-letter");
    let mut reader = common::builder(&dlq_id, &dl_topic)
        .dead_letter_topic(format!("{topic}/dl-of-dl"))
        .connect(&url)
        .await
        .unwrap();
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    producer
        .publish(&topic, Some("bad-1"), b"\xffpoison")
        .await
        .unwrap();

    let mut got = common::take(&mut source, 1, WAIT).await;
    let d = got.pop().expect("delivered");
    let reason =
        DeadLetter::new(DeadLetterReason::Rejected, "no such account").with_context("billing", 3);
    d.dead_letter(&reason).await.unwrap();

    let letters = common::take(&mut reader, 1, WAIT).await;
    assert_eq!(letters.len(), 1);
    let dl = &letters[0];
    assert_eq!(dl.payload(), b"\xffpoison");
    assert_eq!(dl.topic(), dl_topic);
    let h = |k: &str| {
        dl.header(k)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    assert_eq!(
        h("message-id").as_deref(),
        Some("bad-1"),
        "original properties kept"
    );
    assert_eq!(h(idem_consumer::REASON_HEADER).as_deref(), Some("rejected"));
    assert_eq!(
        h(idem_consumer::DETAIL_HEADER).as_deref(),
        Some("no such account")
    );
    assert_eq!(
        h(idem_consumer::CONSUMER_HEADER).as_deref(),
        Some("billing")
    );
    assert_eq!(h(idem_consumer::ATTEMPTS_HEADER).as_deref(), Some("3"));
    assert_eq!(h(idem_mqtt::ORIGINAL_TOPIC_PROPERTY), Some(topic.clone()));
    common::ack_all(letters).await;

    // The original was acked after the dead letter was accepted.
    source.close().await.unwrap();
    let mut again = common::builder(&id, &topic).connect(&url).await.unwrap();
    assert!(common::take(&mut again, 1, QUIET).await.is_empty());
    again.close().await.unwrap();
    reader.close().await.unwrap();
    common::purge_sessions(&url, &[id, dlq_id]).await;
}

#[tokio::test]
async fn dead_letter_to_a_topic_nobody_reads_fails_and_keeps_the_original() {
    let Some(url) = common::url("dead_letter_to_a_topic_nobody_reads_fails_and_keeps_the_original")
    else {
        return;
    };
    let topic = unique_name("mqtt", "dl_nobody");
    let id = format!("{topic}-c");
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    producer.publish(&topic, Some("x-1"), b"x").await.unwrap();
    let d = common::take(&mut source, 1, WAIT)
        .await
        .pop()
        .expect("delivered");
    let err = d
        .dead_letter(&DeadLetter::new(DeadLetterReason::Rejected, "nope"))
        .await
        .expect_err("nobody subscribes to the dead-letter topic");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert!(err.to_string().contains("no client subscribes"), "{err}");
    drop(source);

    let mut again = common::builder(&id, &topic).connect(&url).await.unwrap();
    let back = common::take(&mut again, 1, WAIT).await;
    assert_eq!(back.len(), 1, "not acked, so redelivered");
    common::ack_all(back).await;
    again.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

#[tokio::test]
async fn ensure_session_keeps_what_is_published_until_its_owner_connects() {
    let Some(url) = common::url("ensure_session_keeps_what_is_published") else {
        return;
    };
    let topic = unique_name("mqtt", "ensure_session");
    let keeper = format!("{topic}-keeper");
    idem_mqtt::ensure_session(&url, &keeper, &topic)
        .await
        .expect("create the session");
    idem_mqtt::ensure_session(&url, &keeper, &topic)
        .await
        .expect("an existing session is fine");
    // Refused unless some session subscribes: the keeper is offline but its session counts.
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap()
        .require_subscriber(true);
    producer
        .publish(&topic, Some("k-1"), b"kept")
        .await
        .unwrap();

    let mut owner = common::builder(&keeper, &topic)
        .dead_letter_topic(format!("{topic}/x"))
        .connect(&url)
        .await
        .unwrap();
    let got = common::take(&mut owner, 1, WAIT).await;
    assert_eq!(got.len(), 1, "the session kept the message");
    assert_eq!(got[0].payload(), b"kept");
    common::ack_all(got).await;
    owner.close().await.unwrap();

    let err = idem_mqtt::ensure_session(&url, "", &topic)
        .await
        .expect_err("no client ID");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    common::purge_sessions(&url, &[keeper]).await;
}

/// Replicas of one service start at once and each ensures the same dead-letter keeper
/// session: every connection with that client ID takes the session over from the one before,
/// and Mosquitto closes the older connection, often before its subscription was granted. Each
/// must still succeed (a replica failing here fails its start).
#[tokio::test]
async fn ensure_session_from_concurrent_replicas_all_succeed() {
    let Some(url) = common::url("ensure_session_from_concurrent_replicas_all_succeed") else {
        return;
    };
    let topic = unique_name("mqtt", "ensure_concurrent");
    let keeper = format!("{topic}-keeper");
    for round in 0..3 {
        let replicas: Vec<_> = (0..8)
            .map(|_| {
                let (url, keeper, topic) = (url.clone(), keeper.clone(), topic.clone());
                tokio::spawn(async move { idem_mqtt::ensure_session(&url, &keeper, &topic).await })
            })
            .collect();
        for (i, r) in replicas.into_iter().enumerate() {
            if let Err(e) = r.await.expect("task") {
                panic!("round {round}: replica {i} failed to ensure the session: {e}");
            }
        }
    }
    // The session exists and keeps what is published.
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap()
        .require_subscriber(true);
    producer
        .publish(&topic, Some("c-1"), b"kept")
        .await
        .unwrap();
    common::purge_sessions(&url, &[keeper]).await;
}

#[tokio::test]
async fn abandoned_message_comes_back_without_a_restart() {
    let Some(url) = common::url("abandoned_message_comes_back_without_a_restart") else {
        return;
    };
    let topic = unique_name("mqtt", "abandon");
    let id = format!("{topic}-c");
    let mut source = common::builder(&id, &topic).connect(&url).await.unwrap();
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap();
    producer.publish(&topic, Some("a-1"), b"a").await.unwrap();
    producer.publish(&topic, Some("a-2"), b"b").await.unwrap();
    let mut got = common::take(&mut source, 2, WAIT).await;
    assert_eq!(got.len(), 2);
    let kept = got.remove(1);
    got.remove(0).abandon().await;

    // The reconnect redelivers both unacknowledged messages; the one still held must not be
    // acked on the new connection with its old packet ID.
    let back = common::take(&mut source, 2, WAIT).await;
    let mut ids: Vec<String> = back
        .iter()
        .map(|d| String::from_utf8_lossy(&d.header("message-id").unwrap_or_default()).into_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, ["a-1", "a-2"]);
    assert!(back.iter().all(|d| d.previous_deliveries() == 1));
    kept.ack().await.unwrap(); // stale: skipped
    common::ack_all(back).await;
    source.close().await.unwrap();

    let mut again = common::builder(&id, &topic).connect(&url).await.unwrap();
    assert!(common::take(&mut again, 1, QUIET).await.is_empty());
    again.close().await.unwrap();
    common::purge_sessions(&url, &[id]).await;
}

#[tokio::test]
async fn mqtt_311_reads_the_id_from_json_and_dead_letters_an_envelope() {
    let Some(url) = common::url("mqtt_311_reads_the_id_from_json_and_dead_letters_an_envelope")
    else {
        return;
    };
    let topic = unique_name("mqtt", "v311");
    let (id, dlq_id) = (format!("{topic}-c"), format!("{topic}-d"));
    let dl_topic = format!("{topic}/dead-letter");
    let v311 =
        |client: &str, filter: &str| common::builder(client, filter).protocol(Protocol::V311);
    let mut reader = v311(&dlq_id, &dl_topic)
        .dead_letter_topic(format!("{topic}/x"))
        .connect(&url)
        .await
        .unwrap();
    let mut source = v311(&id, &topic).connect(&url).await.unwrap();
    assert_eq!(
        source.default_id_source(),
        IdSource::json_pointer("/message_id")
    );
    let producer = MqttProducer::connect(&url, format!("{topic}-p"))
        .await
        .unwrap()
        .protocol(Protocol::V311);
    producer
        .publish(&topic, Some("j-1"), br#"{"n":1}"#)
        .await
        .unwrap();
    let err = producer
        .publish(&topic, Some("j-2"), b"[1]")
        .await
        .expect_err("not an object");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    producer.publish(&topic, None, b"raw bytes").await.unwrap();

    let got = common::take(&mut source, 2, WAIT).await;
    assert_eq!(got.len(), 2);
    let pointer = source.default_id_source();
    assert_eq!(pointer.extract(&got[0]).unwrap().as_ref(), b"j-1");
    assert!(
        got[0].header("message-id").is_none(),
        "3.1.1 has no properties"
    );
    assert!(pointer.extract(&got[1]).is_err());
    let mut got = got.into_iter();
    got.next().unwrap().ack().await.unwrap();
    got.next()
        .unwrap()
        .dead_letter(&DeadLetter::new(DeadLetterReason::MissingId, "no id"))
        .await
        .unwrap();

    let letters = common::take(&mut reader, 1, WAIT).await;
    assert_eq!(letters.len(), 1);
    let envelope = DeadLetterEnvelope::from_json(letters[0].payload()).unwrap();
    assert_eq!(envelope.payload, b"raw bytes");
    assert_eq!(
        envelope
            .headers
            .get(idem_consumer::REASON_HEADER)
            .map(String::as_str),
        Some("missing-id")
    );
    assert_eq!(
        envelope.headers.get(idem_mqtt::ORIGINAL_TOPIC_PROPERTY),
        Some(&topic)
    );
    common::ack_all(letters).await;

    source.close().await.unwrap();
    let mut again = v311(&id, &topic).connect(&url).await.unwrap();
    assert!(common::take(&mut again, 1, QUIET).await.is_empty());
    again.close().await.unwrap();
    reader.close().await.unwrap();
    common::purge_sessions(&url, &[id, dlq_id]).await;
}

#[tokio::test]
async fn bad_configuration_is_refused_before_connecting() {
    let err = MqttSource::builder("t", "")
        .connect("mqtt://127.0.0.1:1883")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    let err = MqttSource::builder("orders/#", "c")
        .connect("mqtt://127.0.0.1:1883")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    let err = MqttSource::builder("t", "c")
        .connect("amqp://x")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
}

#[tokio::test]
async fn unreachable_broker_is_unavailable() {
    // Port 1 on localhost refuses connections.
    let err = MqttSource::builder("t", "c")
        .connect("mqtt://127.0.0.1:1")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}
