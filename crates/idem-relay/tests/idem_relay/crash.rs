//! The relay's crash points on a real process: a child relay armed with
//! `IDEM_CRASH_AT=relay-after-publish:<n>` aborts after the broker confirmed a row and before
//! the row is marked sent; the next relay publishes that row again, with the same message ID,
//! so the next idem consumer's claim makes the repeat a duplicate.
//!
//! The "broker" is a file of published IDs, appended before the publish returns: it outlives
//! the child's abort as a broker's log would.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idem_core::outbox::{Emitter, Outgoing};
use idem_core::{ConsumerName, Error, MessageId};
use idem_relay::{Publish, Relay};
use idem_sql::{SqliteOptions, SqliteStore};

use crate::outbox::{Outbox, drain};

/// Set on the child: the directory of the outbox it relays and of the broker's log.
const CHILD_DIR_ENV: &str = "IDEM_RELAY_CRASH_CHILD_DIR";
const RELAY: &str = "crash-relay";

/// Appends each published message's ID to a file, one a line, before confirming.
struct FileBroker(PathBuf);

impl Publish for FileBroker {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        let mut line = msg.id().as_bytes().to_vec();
        line.push(b'\n');
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.0)
            .and_then(|mut f| f.write_all(&line))
            .map_err(|e| Error::new(idem_core::ErrorKind::Unavailable, e.to_string()))
    }
}

fn published(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("published"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Relays `store` into the file broker in `dir` until nothing is left unsent.
async fn relay_all(store: SqliteStore, dir: &Path) {
    let relay = Relay::builder(RELAY)
        .concurrency(1)
        .poll_interval(Duration::from_millis(20))
        .build(store.clone(), FileBroker(dir.join("published")))
        .expect("relay settings");
    drain(relay, &store).await;
}

/// The child's half: does nothing in an ordinary test run (no directory set).
#[tokio::test]
async fn child_relay() {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV).map(PathBuf::from) else {
        return;
    };
    let store = SqliteStore::open(dir.join("outbox.db"), SqliteOptions::default())
        .await
        .expect("open the outbox");
    relay_all(store, &dir).await;
}

fn messages() -> Vec<Outgoing> {
    let consumer = ConsumerName::new("orders-service").expect("test setup");
    let mut emitter = Emitter::for_message(&consumer, &MessageId::new("order-7").expect("id"));
    (0..3)
        .map(|i| {
            emitter
                .message("orders.shipped", format!("{i}").into_bytes())
                .expect("message")
                .ordering_key("order-7")
                .expect("key")
        })
        .collect()
}

#[tokio::test]
async fn a_row_published_and_not_marked_is_published_again_with_its_id() {
    let outbox = Outbox::new("crash_after_publish").await;
    let sent = messages();
    outbox.enqueue(&sent).await;
    // The second confirmed publish aborts the child before its row is marked sent.
    // Blocking: nothing else runs on this test's runtime meanwhile.
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["crash::child_relay", "--exact", "--nocapture"])
        .env(CHILD_DIR_ENV, &outbox.dir)
        .env(idem_consumer::crash::CRASH_AT_ENV, "relay-after-publish:2")
        .status()
        .expect("start the child relay");
    assert!(
        !status.success(),
        "the child relay ran to the end: the crash point did not fire"
    );
    let ids = |m: &[Outgoing]| -> Vec<String> {
        m.iter()
            .map(|m| String::from_utf8(m.id().as_bytes().to_vec()).expect("utf-8 id"))
            .collect()
    };
    let want = ids(&sent);
    assert_eq!(published(&outbox.dir), want[..2], "before the crash");
    // The second row was confirmed and not marked: still unsent, with the third.
    assert!(outbox.backlog().await.unsent >= 2);

    relay_all(outbox.store.clone(), &outbox.dir).await;
    let after = published(&outbox.dir);
    // The second row again (the same ID), then the third; one key's rows stay in order.
    let resent = &after[2..];
    assert!(
        resent == &want[1..] || resent == &want[..],
        "published after the crash: {resent:?}"
    );
    // The next consumer claims by ID: three effects for the three messages.
    let mut distinct = after.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{after:?}");
    outbox.remove().await;
}
