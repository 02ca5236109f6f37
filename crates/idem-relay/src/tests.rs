//! The relay's behaviour against the in-memory `FakeRelayStore` and a scripted fake
//! publisher, in paused tokio time.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::outbox::Outgoing;
use idem_core::{Error, ErrorKind, MessageId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::testing::{FakeRelayStore, FakeRowState};
use crate::{Publish, Relay, RelayBuilder, RelayStats};

/// What the fake publisher does for one publish of an ID.
#[derive(Debug, Clone, Copy)]
enum Step {
    Fail(ErrorKind),
    /// Takes this long, then confirms.
    Slow(Duration),
}

/// A fake broker: confirms everything unless scripted otherwise; logs every publish.
#[derive(Debug, Clone, Default)]
struct FakePublisher {
    script: Arc<Mutex<HashMap<String, VecDeque<Step>>>>,
    log: Arc<Mutex<Vec<(String, Instant, bool)>>>,
}

impl FakePublisher {
    fn script(&self, id: &str, steps: impl IntoIterator<Item = Step>) {
        self.script
            .lock()
            .unwrap()
            .entry(id.to_owned())
            .or_default()
            .extend(steps);
    }

    /// (id, confirmed) in publish order.
    fn log(&self) -> Vec<(String, bool)> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _, ok)| (id.clone(), *ok))
            .collect()
    }

    fn first_publish_at(&self) -> Option<Instant> {
        self.log.lock().unwrap().first().map(|(_, at, _)| *at)
    }
}

impl Publish for FakePublisher {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        let id = String::from_utf8_lossy(msg.id().as_bytes()).into_owned();
        let step = self
            .script
            .lock()
            .unwrap()
            .get_mut(&id)
            .and_then(VecDeque::pop_front);
        let result = match step {
            Some(Step::Fail(kind)) => Err(Error::new(kind, format!("fake broker refuses {id}"))),
            Some(Step::Slow(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            None => Ok(()),
        };
        self.log
            .lock()
            .unwrap()
            .push((id, Instant::now(), result.is_ok()));
        result
    }
}

fn msg(id: &str, key: Option<&str>) -> Outgoing {
    let m = Outgoing::new(
        MessageId::new(id).unwrap(),
        "orders",
        id.as_bytes().to_vec(),
    )
    .unwrap();
    match key {
        Some(k) => m.ordering_key(k).unwrap(),
        None => m,
    }
}

fn builder() -> RelayBuilder {
    Relay::builder("test-relay")
        .poll_interval(Duration::from_millis(100))
        .retry_backoff(Duration::from_secs(1), Duration::from_secs(30))
}

/// Runs the relay until `done` holds (checked every 10 ms of paused time, for at most 10
/// minutes of it), then stops it and returns its stats.
async fn run_until(
    relay: Relay<FakeRelayStore, FakePublisher>,
    done: impl Fn() -> bool,
) -> RelayStats {
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(600);
    while !done() {
        assert!(Instant::now() < deadline, "condition never held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await.unwrap().unwrap()
}

fn all_settled(store: &FakeRelayStore) -> bool {
    store
        .rows()
        .iter()
        .all(|r| matches!(r.state, FakeRowState::Sent | FakeRowState::DeadLettered(_)))
}

#[tokio::test(start_paused = true)]
async fn publishes_then_marks_sent() {
    let store = FakeRelayStore::new();
    let seqs = store.enqueue([msg("a", None), msg("b", Some("k")), msg("c", Some("k"))]);
    let publisher = FakePublisher::default();
    let relay = builder().build(store.clone(), publisher.clone()).unwrap();
    let check = store.clone();
    let stats = run_until(relay, move || all_settled(&check)).await;
    for seq in seqs {
        assert_eq!(store.state_of(seq), Some(FakeRowState::Sent));
    }
    let mut ids: Vec<_> = publisher.log().into_iter().map(|(id, _)| id).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "c"]);
    assert_eq!(stats.published, 3);
    assert_eq!(stats.failed, 0);
}

#[tokio::test(start_paused = true)]
async fn transient_failures_release_with_growing_backoff_and_nothing_is_lost() {
    let store = FakeRelayStore::new();
    let seq = store.enqueue([msg("flaky", None)])[0];
    let publisher = FakePublisher::default();
    publisher.script("flaky", [Step::Fail(ErrorKind::Unavailable); 3]);
    let relay = builder().build(store.clone(), publisher.clone()).unwrap();
    let check = store.clone();
    let stats = run_until(relay, move || all_settled(&check)).await;
    assert_eq!(store.state_of(seq), Some(FakeRowState::Sent));
    let waits: Vec<Duration> = store.releases().iter().map(|(_, _, d)| *d).collect();
    assert_eq!(waits.len(), 3, "{waits:?}");
    // Equal jitter: attempt n waits within [c/2, c], c = 1 s · 2^(n-1).
    assert!(waits[0] <= Duration::from_secs(1), "{waits:?}");
    assert!(waits[1] >= Duration::from_secs(1) && waits[1] <= Duration::from_secs(2));
    assert!(waits[2] >= Duration::from_secs(2) && waits[2] <= Duration::from_secs(4));
    assert!(store.releases()[0].1.contains("fake broker refuses flaky"));
    assert_eq!(
        (stats.failed, stats.published, stats.dead_lettered),
        (3, 1, 0)
    );
    assert_eq!(publisher.log().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn permanent_refusals_are_dead_lettered_with_their_reason() {
    let store = FakeRelayStore::new();
    let seqs = store.enqueue([msg("too-big", None), msg("bad-id", None), msg("fine", None)]);
    let publisher = FakePublisher::default();
    publisher.script("too-big", [Step::Fail(ErrorKind::Rejected)]);
    publisher.script("bad-id", [Step::Fail(ErrorKind::InvalidMessageId)]);
    let relay = builder().build(store.clone(), publisher.clone()).unwrap();
    let check = store.clone();
    let stats = run_until(relay, move || all_settled(&check)).await;
    let reason = |seq| match store.state_of(seq) {
        Some(FakeRowState::DeadLettered(r)) => r,
        other => panic!("seq {seq}: {other:?}"),
    };
    assert!(
        reason(seqs[0]).starts_with("rejected: "),
        "{}",
        reason(seqs[0])
    );
    assert!(reason(seqs[0]).contains("fake broker refuses too-big"));
    assert!(reason(seqs[1]).starts_with("invalid-id: "));
    assert_eq!(store.state_of(seqs[2]), Some(FakeRowState::Sent));
    assert_eq!((stats.dead_lettered, stats.published), (2, 1));
    assert!(store.releases().is_empty(), "{:?}", store.releases());
}

#[tokio::test(start_paused = true)]
async fn retries_exhausted_after_max_attempts() {
    let store = FakeRelayStore::new();
    let seq = store.enqueue([msg("never", None)])[0];
    let publisher = FakePublisher::default();
    publisher.script("never", [Step::Fail(ErrorKind::Unavailable); 10]);
    let relay = builder()
        .max_attempts(3)
        .build(store.clone(), publisher.clone())
        .unwrap();
    let check = store.clone();
    let stats = run_until(relay, move || all_settled(&check)).await;
    match store.state_of(seq) {
        Some(FakeRowState::DeadLettered(r)) => {
            assert!(r.starts_with("retries-exhausted after 3 attempts: "), "{r}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(publisher.log().len(), 3);
    assert_eq!((stats.failed, stats.dead_lettered), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn a_failing_middle_row_keeps_its_key_in_order() {
    let store = FakeRelayStore::new();
    store.enqueue([
        msg("k1", Some("account-7")),
        msg("k2", Some("account-7")),
        msg("k3", Some("account-7")),
        msg("other", Some("account-8")),
    ]);
    let publisher = FakePublisher::default();
    publisher.script("k2", [Step::Fail(ErrorKind::Unavailable)]);
    let relay = builder().build(store.clone(), publisher.clone()).unwrap();
    let check = store.clone();
    run_until(relay, move || all_settled(&check)).await;
    let key7: Vec<_> = publisher
        .log()
        .into_iter()
        .filter(|(id, _)| id.starts_with('k'))
        .collect();
    assert_eq!(
        key7,
        [
            ("k1".to_owned(), true),
            ("k2".to_owned(), false),
            ("k2".to_owned(), true),
            ("k3".to_owned(), true),
        ]
    );
    // The other key was not held up by account-7's failure.
    assert_eq!(
        publisher.log()[..3]
            .iter()
            .filter(|(id, _)| id == "other")
            .count(),
        1
    );
    let releases = store.releases();
    assert!(
        releases
            .iter()
            .any(|(_, why, _)| why.contains("held behind")),
        "{releases:?}"
    );
    // The held row waits at least as long as the failed one.
    assert!(releases[1].2 >= releases[0].2, "{releases:?}");
}

#[tokio::test(start_paused = true)]
async fn stopping_finishes_the_publish_in_flight_and_releases_the_rest() {
    let store = FakeRelayStore::new();
    // `next` waits behind `slow` in its key; `unkeyed` waits for the one permit.
    let seqs = store.enqueue([
        msg("slow", Some("k")),
        msg("next", Some("k")),
        msg("unkeyed", None),
    ]);
    let publisher = FakePublisher::default();
    publisher.script("slow", [Step::Slow(Duration::from_secs(10))]);
    let relay = builder()
        .concurrency(1)
        .build(store.clone(), publisher.clone())
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(store.state_of(seqs[0]), Some(FakeRowState::Sent));
    for seq in &seqs[1..] {
        assert!(
            matches!(store.state_of(*seq), Some(FakeRowState::Unsent { .. })),
            "{:?}",
            store.state_of(*seq)
        );
    }
    assert_eq!(publisher.log(), [("slow".to_owned(), true)]);
    assert_eq!((stats.published, stats.released_unpublished), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn the_waker_wakes_the_relay_before_its_poll() {
    let store = FakeRelayStore::new();
    let publisher = FakePublisher::default();
    let relay = builder()
        .poll_interval(Duration::from_secs(60))
        .build(store.clone(), publisher.clone())
        .unwrap();
    let waker = relay.waker();
    let stop = CancellationToken::new();
    let start = Instant::now();
    let task = tokio::spawn(relay.run(stop.clone()));
    // Let the first (empty) round pass, then commit and wake.
    tokio::time::sleep(Duration::from_secs(1)).await;
    store.enqueue([msg("woken", None)]);
    waker.wake();
    while publisher.log().is_empty() && Instant::now() - start < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at = publisher.first_publish_at().expect("never published") - start;
    assert!(at < Duration::from_secs(2), "published after {at:?}");
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_wake_stream_wakes_it_too_and_polling_goes_on_after_it_ends() {
    let store = FakeRelayStore::new();
    let publisher = FakePublisher::default();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let stream =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|()| ((), rx)) },
        );
    let relay = builder()
        .poll_interval(Duration::from_secs(60))
        .build(store.clone(), publisher.clone())
        .unwrap()
        .wake_on(stream);
    let stop = CancellationToken::new();
    let start = Instant::now();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    store.enqueue([msg("notified", None)]);
    tx.send(()).unwrap();
    while publisher.log().is_empty() && Instant::now() - start < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at = publisher.first_publish_at().expect("never published") - start;
    assert!(at < Duration::from_secs(2), "published after {at:?}");
    drop(tx);
    // The stream's end is seen (and looked into) before this row commits.
    tokio::time::sleep(Duration::from_secs(1)).await;
    store.enqueue([msg("polled", None)]);
    // The backlog is read every 15 s meanwhile: those wake-ups must not push the poll back.
    while publisher.log().len() < 2 && Instant::now() - start < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Polling found it within its interval after the stream ended.
    assert!(Instant::now() - start < Duration::from_secs(2 + 62));
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_store_outage_pauses_the_relay_and_loses_nothing() {
    let store = FakeRelayStore::new();
    let seqs = store.enqueue([msg("a", None), msg("b", Some("k"))]);
    store.set_down(Some(ErrorKind::Unavailable));
    let publisher = FakePublisher::default();
    let relay = builder().build(store.clone(), publisher.clone()).unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(30)).await;
    let calls_while_down = store.calls();
    // Backed off: a 100 ms poll would have made ~300 calls in 30 s.
    assert!(
        calls_while_down < 40,
        "{calls_while_down} store calls in 30 s"
    );
    assert!(publisher.log().is_empty());
    store.set_down(None);
    while !all_settled(&store) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    for seq in seqs {
        assert_eq!(store.state_of(seq), Some(FakeRowState::Sent));
    }
    assert!(stats.store_errors > 0);
    assert_eq!(stats.dead_lettered, 0);
}

#[tokio::test(start_paused = true)]
async fn a_misconfigured_store_stops_the_relay_with_the_error() {
    let store = FakeRelayStore::new();
    store.set_down(Some(ErrorKind::Misconfigured));
    let relay = builder()
        .build(store.clone(), FakePublisher::default())
        .unwrap();
    let err = relay.run(CancellationToken::new()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misconfigured);
}

#[tokio::test(start_paused = true)]
async fn a_full_batch_is_followed_by_the_next_at_once_and_sent_rows_are_purged() {
    let store = FakeRelayStore::new();
    store.enqueue((0..25).map(|i| msg(&format!("m{i}"), None)));
    let publisher = FakePublisher::default();
    let relay = builder()
        .batch(10)
        .poll_interval(Duration::from_secs(60))
        .purge_interval(Duration::from_secs(120))
        .build(store.clone(), publisher.clone())
        .unwrap();
    let stop = CancellationToken::new();
    let start = Instant::now();
    let task = tokio::spawn(relay.run(stop.clone()));
    while publisher.log().len() < 25 && Instant::now() - start < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(Instant::now() - start < Duration::from_secs(1));
    tokio::time::sleep(Duration::from_secs(121)).await;
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!((stats.rounds, stats.purged), (3, 25));
    assert!(store.rows().is_empty());
    assert_eq!(stats.backlog.map(|b| b.unsent), Some(0));
}

#[tokio::test(start_paused = true)]
async fn metrics_count_published_failed_dead_lettered_and_the_backlog() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    // The test's runtime runs every task on this thread, so the local recorder sees them all.
    let _guard = metrics::set_default_local_recorder(&recorder);
    let store = FakeRelayStore::new();
    store.enqueue([msg("ok", None), msg("flaky", None), msg("refused", None)]);
    let publisher = FakePublisher::default();
    publisher.script("flaky", [Step::Fail(ErrorKind::Unavailable)]);
    publisher.script("refused", [Step::Fail(ErrorKind::Rejected)]);
    let relay = builder()
        .backlog_interval(Duration::from_secs(1))
        .build(store.clone(), publisher)
        .unwrap();
    let check = store.clone();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    while !all_settled(&check) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // One more backlog read after the last row settled.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    let text = handle.render();
    for line in [
        r#"idem_relay_published_total{relay="test-relay"} 2"#,
        r#"idem_relay_failed_total{relay="test-relay"} 1"#,
        r#"idem_relay_dead_lettered_total{relay="test-relay",reason="rejected"} 1"#,
        r#"idem_outbox_unsent{relay="test-relay"} 0"#,
        r#"idem_outbox_oldest_unsent_seconds{relay="test-relay"} 0"#,
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from:\n{text}"
        );
    }
    assert_eq!(
        stats.backlog.map(|b| (b.unsent, b.dead_lettered)),
        Some((0, 1))
    );
}

#[tokio::test(start_paused = true)]
async fn the_next_batch_is_leased_and_published_while_a_round_is_still_publishing() {
    let store = FakeRelayStore::new();
    let seqs = store.enqueue([msg("slow", None), msg("quick", None)]);
    let publisher = FakePublisher::default();
    publisher.script("slow", [Step::Slow(Duration::from_secs(10))]);
    let relay = builder()
        .batch(1)
        .pipeline(2)
        .build(store.clone(), publisher.clone())
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The second round went while the first still waits for its confirm.
    assert_eq!(store.state_of(seqs[1]), Some(FakeRowState::Sent));
    assert!(matches!(
        store.state_of(seqs[0]),
        Some(FakeRowState::Leased { .. })
    ));
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(store.state_of(seqs[0]), Some(FakeRowState::Sent));
    assert_eq!((stats.rounds, stats.published), (2, 2));
}

#[tokio::test(start_paused = true)]
async fn a_confirmed_row_is_marked_without_waiting_for_its_rounds_slowest_publish() {
    let store = FakeRelayStore::new();
    let seqs = store.enqueue([msg("slow", None), msg("quick", None)]);
    let publisher = FakePublisher::default();
    publisher.script("slow", [Step::Slow(Duration::from_secs(10))]);
    let relay = builder()
        .pipeline(1)
        .build(store.clone(), publisher.clone())
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // One round holds both; the quick one is marked while the slow one publishes.
    assert_eq!(store.state_of(seqs[1]), Some(FakeRowState::Sent));
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(store.state_of(seqs[0]), Some(FakeRowState::Sent));
    assert_eq!((stats.rounds, stats.published), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn a_purge_that_finds_more_than_a_turn_deletes_goes_on_without_waiting_an_interval() {
    let store = FakeRelayStore::new();
    store.enqueue((0..35).map(|i| msg(&format!("m{i}"), None)));
    let publisher = FakePublisher::default();
    // A turn deletes at most 10 statements of 1 row.
    let relay = builder()
        .batch(100)
        .purge_batch(1)
        .purge_interval(Duration::from_secs(60))
        .build(store.clone(), publisher.clone())
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_secs(61)).await;
    // All 35 in the first interval's turns, not 10 a minute.
    assert!(store.rows().is_empty(), "{} rows left", store.rows().len());
    stop.cancel();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.purged, 35);
}
