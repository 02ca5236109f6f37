//! The outbox conformance checks ([`OutboxStore`] and [`RelayStore`]). Each takes a fresh
//! fixture, asserts one property against the real store, and tears it down. Leases and retry
//! delays run on the store's own clock, so a few checks sleep for a second or less.

use std::collections::HashSet;
use std::time::Duration;

use idem_core::outbox::{Backlog, Emitter, OutboxRow, OutboxStore, Outgoing, RelayStore};
use idem_core::{ConsumerName, ErrorKind, MessageId, Migrate, TransactionalStore};

use crate::outbox_fixture::OutboxFixture;

const LONG: Duration = Duration::from_secs(30);

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => fx,
            None => return,
        }
    };
}

/// `n` messages of the handling of incoming message `incoming`, to `destination`, each with
/// `key` if given.
fn messages(incoming: &str, n: usize, destination: &str, key: Option<&str>) -> Vec<Outgoing> {
    let consumer = ConsumerName::new("outbox-suite").expect("consumer");
    let mut e = Emitter::for_message(&consumer, &MessageId::new(incoming).expect("id"));
    (0..n)
        .map(|i| {
            let m = e
                .message(destination, format!("{incoming}/{i}").into_bytes())
                .expect("message");
            match key {
                Some(k) => m.ordering_key(k).expect("key"),
                None => m,
            }
        })
        .collect()
}

/// Enqueues `msgs` in a transaction of their own and commits.
async fn enqueue<S: OutboxStore>(s: &S, msgs: &[Outgoing]) {
    let mut tx = s.begin().await.expect("begin");
    s.enqueue(&mut tx, msgs).await.expect("enqueue");
    s.commit(tx).await.expect("commit");
}

async fn lease<S: RelayStore>(s: &S, relay: &str, limit: usize, lease: Duration) -> Vec<OutboxRow> {
    s.lease(relay, limit, lease).await.expect("lease")
}

fn ids(rows: &[OutboxRow]) -> Vec<MessageId> {
    rows.iter().map(|r| r.message.id().clone()).collect()
}

fn seqs(rows: &[OutboxRow]) -> Vec<i64> {
    rows.iter().map(|r| r.seq).collect()
}

fn msg_ids(msgs: &[Outgoing]) -> Vec<MessageId> {
    msgs.iter().map(|m| m.id().clone()).collect()
}

/// A committed message comes back from a lease exactly as it was enqueued: ID, destination,
/// every payload byte, headers in order (any value), the ordering key; unkeyed too.
pub async fn committed_enqueue_is_leased_back_byte_exact<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let consumer = ConsumerName::new("billing").expect("consumer");
    let mut e = Emitter::for_message(&consumer, &MessageId::new("payment-7").expect("id"));
    let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let keyed = e
        .message("payments.charged", payload.clone())
        .and_then(|m| m.header("kind", "PaymentCharged"))
        .and_then(|m| m.header("note", "line\nbreak \"quoted\" ünïcødé 😀 [\"x\"]"))
        .and_then(|m| m.header("empty", ""))
        .and_then(|m| m.ordering_key("account-42"))
        .expect("message");
    let plain = e
        .message("receipts/émis", Vec::<u8>::new())
        .expect("message");
    enqueue(&s, &[keyed.clone(), plain.clone()]).await;
    let rows = lease(&s, "relay-a", 10, LONG).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(
        rows[0].message == keyed,
        "keyed message differs: {:?}",
        rows[0].message
    );
    assert_eq!(rows[0].message.payload(), &payload[..]);
    assert!(
        rows[1].message == plain,
        "plain message differs: {:?}",
        rows[1].message
    );
    assert_eq!(rows[1].message.key(), None);
    assert!(rows[0].seq < rows[1].seq);
    assert_eq!(rows[0].attempts, 0);
    fx.teardown().await;
}

/// A transaction that rolls back leaves no outbox row: nothing to lease, nothing counted.
pub async fn rolled_back_enqueue_never_appears<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let msgs = messages("rolled-back", 3, "orders", None);
    let mut tx = s.begin().await.expect("begin");
    s.enqueue(&mut tx, &msgs).await.expect("enqueue");
    s.rollback(tx).await.expect("rollback");
    // Dropped without commit (a handler that panicked, a cancelled future) too.
    {
        let mut tx = s.begin().await.expect("begin");
        s.enqueue(&mut tx, &messages("dropped", 2, "orders", None))
            .await
            .expect("enqueue");
    }
    assert!(lease(&s, "relay-a", 10, LONG).await.is_empty());
    assert_eq!(s.backlog().await.expect("backlog"), Backlog::default());
    fx.teardown().await;
}

/// A handler's re-run enqueues the same derived IDs: a second committed transaction with
/// them adds no row and leaves the first payloads; a new ID in it is added.
pub async fn enqueue_of_committed_ids_adds_no_row<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let first = messages("payment-1", 2, "orders", Some("k"));
    enqueue(&s, &first).await;
    let mut again = messages("payment-1", 3, "orders", Some("k"));
    again[0] = Outgoing::new(again[0].id().clone(), "orders", b"changed".to_vec()).expect("msg");
    enqueue(&s, &again).await;
    assert_eq!(s.backlog().await.expect("backlog").unsent, 3);
    let rows = lease(&s, "relay-a", 10, LONG).await;
    assert_eq!(ids(&rows), msg_ids(&again));
    assert_eq!(
        rows[0].message.payload(),
        first[0].payload(),
        "first run's row kept"
    );
    fx.teardown().await;
}

/// One enqueue of more messages than one statement inserts (stores insert in chunks) keeps
/// them in the given order, and an ID repeated within the call, or already committed, adds no
/// second row: the first one enqueued stays.
pub async fn a_large_enqueue_keeps_its_order_and_skips_repeats<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let all = messages("bulk", 251, "orders", None);
    enqueue(&s, &all[..1]).await;
    let mut call = all[1..].to_vec();
    // The committed one, at the start of a later chunk; one of this call's own, repeated in
    // the next chunk with another payload.
    call.insert(120, all[0].clone());
    call.insert(
        150,
        Outgoing::new(all[7].id().clone(), "orders", b"repeat".to_vec()).expect("msg"),
    );
    enqueue(&s, &call).await;
    assert_eq!(s.backlog().await.expect("backlog").unsent, 251);
    let rows = lease(&s, "relay-a", 1000, LONG).await;
    assert_eq!(ids(&rows), msg_ids(&all), "order kept, no repeated row");
    assert_eq!(
        rows[7].message.payload(),
        all[7].payload(),
        "the first one stays"
    );
    assert!(seqs(&rows).windows(2).all(|w| w[0] < w[1]));
    fx.teardown().await;
}

/// Rows are leased oldest first, in the order they were enqueued, across transactions; rows
/// leased to one relay are not leased to another.
pub async fn lease_order_is_seq_order<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let mut all = Vec::new();
    for tx in 0..3 {
        let msgs = messages(&format!("in-{tx}"), 4, "orders", None);
        enqueue(&s, &msgs).await;
        all.extend(msgs);
    }
    let a = lease(&s, "relay-a", 5, LONG).await;
    let b = lease(&s, "relay-b", 100, LONG).await;
    assert_eq!(ids(&a), msg_ids(&all[..5]));
    assert_eq!(ids(&b), msg_ids(&all[5..]));
    let order: Vec<i64> = seqs(&a).into_iter().chain(seqs(&b)).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    // A relay's own rows come back to it (renewed), still oldest first.
    assert_eq!(
        ids(&lease(&s, "relay-a", 2, LONG).await),
        msg_ids(&all[..2])
    );
    fx.teardown().await;
}

/// Eight relays leasing at once, each marking what it got: every row is leased exactly once.
pub async fn concurrent_relays_never_lease_the_same_row<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    const ROWS: usize = 160;
    for tx in 0..8 {
        enqueue(
            &s,
            &messages(&format!("burst-{tx}"), ROWS / 8, "orders", None),
        )
        .await;
    }
    let mut relays = Vec::new();
    for r in 0..8 {
        let s = s.clone();
        relays.push(tokio::spawn(async move {
            let name = format!("relay-{r}");
            let mut got = Vec::new();
            let mut empty = 0;
            while empty < 3 {
                let rows = lease(&s, &name, 7, LONG).await;
                if rows.is_empty() {
                    empty += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let leased = seqs(&rows);
                s.mark_sent(&name, &leased).await.expect("mark");
                got.extend(leased);
            }
            got
        }));
    }
    let mut all = Vec::new();
    for r in relays {
        all.extend(r.await.expect("relay task"));
    }
    let distinct: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "a row was leased twice");
    assert_eq!(all.len(), ROWS);
    let backlog = s.backlog().await.expect("backlog");
    assert_eq!((backlog.unsent, backlog.sent), (0, ROWS as u64));
    fx.teardown().await;
}

/// Eight relays leasing, publishing and marking at once, on rows of four ordering keys
/// enqueued in many transactions: each key's rows are published in the order they were
/// enqueued, and each exactly once — a relay never takes a key's row while another relay holds
/// an earlier one, even one whose lease has not committed yet.
pub async fn concurrent_relays_publish_each_key_in_order<F: OutboxFixture>(test: &str) {
    use std::sync::{Arc, Mutex};

    let fx = fixture!(test);
    let s = fx.store();
    const KEYS: usize = 4;
    const PER_KEY: usize = 24;
    let consumer = ConsumerName::new("outbox-suite").expect("consumer");
    for round in 0..PER_KEY / 4 {
        let mut e =
            Emitter::for_message(&consumer, &MessageId::new(format!("r{round}")).expect("id"));
        let mut msgs = Vec::new();
        for i in 0..4 {
            for k in 0..KEYS {
                let body = format!("{k}:{:03}", round * 4 + i);
                msgs.push(
                    e.message("orders", body.into_bytes())
                        .and_then(|m| m.ordering_key(format!("key-{k}")))
                        .expect("message"),
                );
            }
        }
        enqueue(&s, &msgs).await;
    }
    let published: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut relays = Vec::new();
    for r in 0..8 {
        let (s, published) = (s.clone(), published.clone());
        relays.push(tokio::spawn(async move {
            let name = format!("relay-{r}");
            let mut empty = 0;
            while empty < 5 {
                let rows = lease(&s, &name, 3, LONG).await;
                if rows.is_empty() {
                    empty += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                empty = 0;
                for row in &rows {
                    let body = String::from_utf8(row.message.payload().to_vec()).expect("utf8");
                    published.lock().expect("log").push(body);
                }
                s.mark_sent(&name, &seqs(&rows)).await.expect("mark");
            }
        }));
    }
    for r in relays {
        r.await.expect("relay task");
    }
    let log = published.lock().expect("log").clone();
    assert_eq!(log.len(), KEYS * PER_KEY, "published {} rows", log.len());
    for k in 0..KEYS {
        let of_key: Vec<&String> = log
            .iter()
            .filter(|b| b.starts_with(&format!("{k}:")))
            .collect();
        let mut sorted = of_key.clone();
        sorted.sort();
        assert_eq!(of_key, sorted, "key {k} published out of order");
    }
    fx.teardown().await;
}

/// A lease that lapses (its relay died) lets another relay take the row over; the first
/// relay's late `mark_sent` then marks nothing and is no error. Before it lapses nobody else
/// gets the row, and its own relay gets it back.
pub async fn a_lapsed_lease_is_taken_over_and_the_late_mark_marks_nothing<F: OutboxFixture>(
    test: &str,
) {
    let fx = fixture!(test);
    let s = fx.store();
    enqueue(&s, &messages("lapse", 1, "orders", None)).await;
    let short = Duration::from_millis(400);
    let a = lease(&s, "relay-a", 10, short).await;
    assert_eq!(a.len(), 1);
    assert!(
        lease(&s, "relay-b", 10, LONG).await.is_empty(),
        "taken while leased"
    );
    assert_eq!(seqs(&lease(&s, "relay-a", 10, short).await), seqs(&a));
    tokio::time::sleep(Duration::from_millis(900)).await;
    let b = lease(&s, "relay-b", 10, LONG).await;
    assert_eq!(seqs(&b), seqs(&a), "the lapsed row is not taken over");
    s.mark_sent("relay-a", &seqs(&a))
        .await
        .expect("a late mark is no error");
    let backlog = s.backlog().await.expect("backlog");
    assert_eq!(
        (backlog.unsent, backlog.sent),
        (1, 0),
        "the stale relay marked the row"
    );
    s.mark_sent("relay-b", &seqs(&b)).await.expect("mark");
    let backlog = s.backlog().await.expect("backlog");
    assert_eq!((backlog.unsent, backlog.sent), (0, 1));
    assert!(
        lease(&s, "relay-b", 10, LONG).await.is_empty(),
        "a sent row leased again"
    );
    fx.teardown().await;
}

/// One relay at a time per (destination, ordering key), in order: while relay A leases key
/// K's head, relay B takes none of K's later rows, but takes unkeyed rows, other keys and the
/// same key on another destination; A then gets K's later rows behind its head.
pub async fn one_relay_at_a_time_per_ordering_key<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = messages("key-k", 3, "orders", Some("K"));
    let free = messages("unkeyed", 1, "orders", None);
    let other = messages("key-l", 1, "orders", Some("L"));
    let elsewhere = messages("key-k-elsewhere", 1, "invoices", Some("K"));
    enqueue(&s, &[k[0].clone()]).await;
    enqueue(&s, &[k[1].clone(), free[0].clone()]).await;
    enqueue(&s, &[other[0].clone(), k[2].clone(), elsewhere[0].clone()]).await;
    let a = lease(&s, "relay-a", 1, LONG).await;
    assert_eq!(ids(&a), msg_ids(&k[..1]));
    let b = lease(&s, "relay-b", 10, LONG).await;
    let expected: Vec<MessageId> = [&free[0], &other[0], &elsewhere[0]]
        .iter()
        .map(|m| m.id().clone())
        .collect();
    assert_eq!(
        ids(&b),
        expected,
        "relay B took key K's later rows or missed free ones"
    );
    let a = lease(&s, "relay-a", 10, LONG).await;
    assert_eq!(
        ids(&a),
        msg_ids(&k),
        "relay A gets K's rows after its head, in order"
    );
    fx.teardown().await;
}

/// A row the per-key rule turns away is not left leased. While another transaction holds key
/// K's head locked (a lease or a mark in flight elsewhere), relay B's lease skips the head and
/// must turn K's later rows away — the rule sees their earlier row missing from its selection
/// — and takes the unkeyed row; relay C then gets all of K's rows, in order, as soon as the
/// lock is gone. A lease that locked or leased K's later rows without handing them out would
/// leave C only the head (the rest held for B until B's lease lapsed). On an engine without
/// row locks (SQLite) relay A's live lease on the head holds K instead, and C gets K's later
/// rows once A marks the head sent.
pub async fn a_row_the_key_rule_turns_away_is_not_leased<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = messages("turned-away", 3, "orders", Some("K"));
    let free = messages("free", 1, "orders", None);
    enqueue(&s, &k).await;
    enqueue(&s, &free).await;
    let lock = fx.lock_row(k[0].id()).await;
    let head = match lock {
        Some(_) => Vec::new(),
        None => {
            let a = lease(&s, "relay-a", 1, LONG).await;
            assert_eq!(ids(&a), msg_ids(&k[..1]));
            a
        }
    };
    let b = lease(&s, "relay-b", 10, LONG).await;
    assert_eq!(
        ids(&b),
        msg_ids(&free),
        "relay B took key K's rows behind a held head, or missed the free row"
    );
    let expected = match lock {
        Some(lock) => {
            fx.unlock_row(lock).await;
            msg_ids(&k)
        }
        None => {
            s.mark_sent("relay-a", &seqs(&head)).await.expect("mark");
            msg_ids(&k[1..])
        }
    };
    let c = lease(&s, "relay-c", 10, LONG).await;
    assert_eq!(
        ids(&c),
        expected,
        "K's rows turned away by relay B's lease were left leased to it"
    );
    fx.teardown().await;
}

/// A released row counts the attempt, keeps the error and waits out the delay — for every
/// relay — and holds its key's later rows back meanwhile; a relay that does not hold a row
/// cannot release it.
pub async fn release_delays_and_counts_attempts<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let k = messages("retry", 2, "orders", Some("K"));
    enqueue(&s, &k).await;
    let a = lease(&s, "relay-a", 1, LONG).await;
    assert_eq!(ids(&a), msg_ids(&k[..1]));
    s.release("relay-b", a[0].seq, "not mine", Duration::ZERO)
        .await
        .expect("a release by another relay is no error");
    assert!(
        lease(&s, "relay-b", 10, LONG).await.is_empty(),
        "released by a non-holder"
    );
    s.release(
        "relay-a",
        a[0].seq,
        &"broker said no ".repeat(1000),
        Duration::from_secs(1),
    )
    .await
    .expect("release");
    for relay in ["relay-a", "relay-b"] {
        assert!(
            lease(&s, relay, 10, LONG).await.is_empty(),
            "{relay} leased during the retry delay (or K's later row overtook its head)"
        );
    }
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let again = lease(&s, "relay-b", 10, LONG).await;
    assert_eq!(ids(&again), msg_ids(&k));
    assert_eq!((again[0].attempts, again[1].attempts), (1, 0));
    fx.teardown().await;
}

/// `dead_letter` moves the row, with its reason, to the dead-letter table; a relay that does
/// not hold a row cannot dead-letter it.
pub async fn dead_letter_moves_the_row_with_its_reason<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    enqueue(&s, &messages("poison", 2, "orders", None)).await;
    let rows = lease(&s, "relay-a", 10, LONG).await;
    assert_eq!(rows.len(), 2);
    let reason = "rejected: message too large for the destination";
    s.dead_letter("relay-a", rows[0].seq, reason)
        .await
        .expect("dead letter");
    s.dead_letter("relay-b", rows[1].seq, "not mine")
        .await
        .expect("a dead letter by another relay is no error");
    let backlog = s.backlog().await.expect("backlog");
    assert_eq!((backlog.unsent, backlog.dead_lettered), (1, 1));
    assert_eq!(
        fx.dead_letter_reason(rows[0].seq).await.as_deref(),
        Some(reason)
    );
    assert_eq!(fx.dead_letter_reason(rows[1].seq).await, None);
    assert_eq!(
        seqs(&lease(&s, "relay-a", 10, LONG).await),
        vec![rows[1].seq]
    );
    fx.teardown().await;
}

/// `purge_sent` deletes at most `limit` sent rows per call, and never an unsent one.
pub async fn purge_sent_deletes_at_most_limit<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    enqueue(&s, &messages("sent", 5, "orders", None)).await;
    let rows = lease(&s, "relay-a", 10, LONG).await;
    s.mark_sent("relay-a", &seqs(&rows)).await.expect("mark");
    enqueue(&s, &messages("unsent", 1, "orders", None)).await;
    assert_eq!(s.purge_sent(2).await.expect("purge"), 2);
    assert_eq!(s.backlog().await.expect("backlog").sent, 3);
    assert_eq!(s.purge_sent(0).await.expect("purge"), 0);
    assert_eq!(s.purge_sent(100).await.expect("purge"), 3);
    assert_eq!(s.purge_sent(100).await.expect("purge"), 0);
    let backlog = s.backlog().await.expect("backlog");
    assert_eq!((backlog.unsent, backlog.sent), (1, 0));
    fx.teardown().await;
}

/// `backlog` counts unsent, sent and dead-lettered rows, and the oldest unsent row's age.
pub async fn backlog_counts_and_oldest_age<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    assert_eq!(s.backlog().await.expect("backlog"), Backlog::default());
    enqueue(&s, &messages("aged", 3, "orders", None)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rows = lease(&s, "relay-a", 1, LONG).await;
    s.mark_sent("relay-a", &seqs(&rows)).await.expect("mark");
    let b = s.backlog().await.expect("backlog");
    assert_eq!((b.unsent, b.sent, b.dead_lettered), (2, 1, 0));
    let age = b.oldest_unsent.expect("an oldest unsent row");
    assert!(
        age >= Duration::from_millis(400) && age < Duration::from_secs(60),
        "oldest unsent age {age:?}"
    );
    fx.teardown().await;
}

/// `migrate` again (and concurrently) changes nothing and keeps the rows.
pub async fn migrate_twice_keeps_the_outbox<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.store();
    let msgs = messages("kept", 2, "orders", Some("k"));
    enqueue(&s, &msgs).await;
    s.migrate().await.expect("migrate again");
    let (a, b) = (s.clone(), s.clone());
    let (x, y) = tokio::join!(a.migrate(), b.migrate());
    x.expect("concurrent migrate");
    y.expect("concurrent migrate");
    assert_eq!(ids(&lease(&s, "relay-a", 10, LONG).await), msg_ids(&msgs));
    fx.teardown().await;
}

/// A store whose outbox table was never migrated fails with `Misconfigured` (an operator's
/// fix, not a message's fault), on every call; a bad relay name is `InvalidConfig`.
pub async fn a_missing_outbox_table_is_misconfigured<F: OutboxFixture>(test: &str) {
    let fx = fixture!(test);
    let s = fx.unmigrated();
    let kind = |r: Result<(), idem_core::Error>| r.expect_err("no outbox table").kind();
    let mut tx = s.begin().await.expect("begin");
    let enqueued = s.enqueue(&mut tx, &messages("m", 1, "orders", None)).await;
    assert_eq!(kind(enqueued), ErrorKind::Misconfigured);
    let _ = s.rollback(tx).await;
    assert_eq!(
        kind(s.lease("relay-a", 10, LONG).await.map(drop)),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        kind(s.mark_sent("relay-a", &[1]).await),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        kind(s.release("relay-a", 1, "e", Duration::ZERO).await),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        kind(s.dead_letter("relay-a", 1, "r").await),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        kind(s.purge_sent(10).await.map(drop)),
        ErrorKind::Misconfigured
    );
    assert_eq!(kind(s.backlog().await.map(drop)), ErrorKind::Misconfigured);
    let good = fx.store();
    for bad in ["", "relay\n1"] {
        assert_eq!(
            kind(good.lease(bad, 1, LONG).await.map(drop)),
            ErrorKind::InvalidConfig
        );
        assert_eq!(
            kind(good.mark_sent(bad, &[1]).await),
            ErrorKind::InvalidConfig
        );
    }
    fx.teardown().await;
}
