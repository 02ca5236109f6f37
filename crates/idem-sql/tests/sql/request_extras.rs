//! Request-store checks beyond the shared conformance suite that matter for SQL schemas: keys
//! compared byte for byte (no collation folding case), results of several MiB, and a migration
//! that runs twice. idem-postgres's test binary includes this file too (`#[path]`); both
//! declare it at their root, where the macro's `$crate::request_extras` paths find it.

use std::time::Duration;

use idem_core::store::RequestStore;
use idem_core::{Begin, Fingerprint, IdempotencyKey, Migrate, RequestKey, RequestScope};
use idem_testkit::RequestFixture;

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

fn key(key: &str) -> RequestKey {
    RequestKey::new(
        RequestScope::new(["alice"]),
        IdempotencyKey::with_limit(key, 4096).expect("valid key"),
    )
}

async fn complete<S: RequestStore>(s: &S, k: &RequestKey, body: &str, result: &[u8]) {
    let fp = Fingerprint::of(body.as_bytes());
    let Begin::Acquired { fence, .. } = s.begin_request(k, &fp, LONG, DAY).await.expect("begin")
    else {
        panic!("a fresh key {k:?} was not acquired");
    };
    let mut tx = s.begin().await.expect("tx");
    s.complete_in(&mut tx, k, fence, result, DAY)
        .await
        .expect("complete");
    s.commit(tx).await.expect("commit");
}

/// Keys that differ only in case, or in a trailing byte, are different records.
pub(crate) async fn keys_are_compared_byte_for_byte<F: RequestFixture>(test: &str) {
    let Some(fx) = F::setup(test).await else {
        return;
    };
    let s = fx.store();
    let longest = "k".repeat(s.max_key_len());
    for (k, result) in [
        ("Order-7", "upper"),
        ("order-7", "lower"),
        ("order-7_", "suffix"),
        (longest.as_str(), "longest"),
    ] {
        complete(&s, &key(k), "body", result.as_bytes()).await;
    }
    for (k, result) in [("Order-7", "upper"), ("order-7", "lower")] {
        let replay = s
            .begin_request(&key(k), &Fingerprint::of(b"body"), LONG, DAY)
            .await
            .expect("replay");
        assert_eq!(
            replay,
            Begin::Completed {
                result: result.as_bytes().to_vec()
            },
            "{k}"
        );
    }
    fx.teardown().await;
}

/// A result of several MiB (a large stored response) is stored and replayed intact.
pub(crate) async fn results_of_several_mib_round_trip<F: RequestFixture>(test: &str) {
    let Some(fx) = F::setup(test).await else {
        return;
    };
    let s = fx.store();
    let result: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    complete(&s, &key("big"), "body", &result).await;
    match s
        .begin_request(&key("big"), &Fingerprint::of(b"body"), LONG, DAY)
        .await
        .expect("replay")
    {
        Begin::Completed { result: stored } => assert!(stored == result, "replay differs"),
        other => panic!("expected the stored result, got {other:?}"),
    }
    fx.teardown().await;
}

/// Migrating a second time keeps the records.
pub(crate) async fn migrating_again_keeps_the_records<F>(test: &str)
where
    F: RequestFixture,
    F::Store: Migrate,
{
    let Some(fx) = F::setup(test).await else {
        return;
    };
    let s = fx.store();
    complete(&s, &key("kept"), "body", b"r").await;
    s.migrate().await.expect("migrate again");
    let replay = s
        .begin_request(&key("kept"), &Fingerprint::of(b"body"), LONG, DAY)
        .await
        .expect("replay");
    assert_eq!(
        replay,
        Begin::Completed {
            result: b"r".to_vec()
        }
    );
    fx.teardown().await;
}

/// One `#[tokio::test]` per check above for `$fixture`.
macro_rules! request_extras {
    ($fixture:ty) => {
        #[tokio::test]
        async fn keys_are_compared_byte_for_byte() {
            $crate::request_extras::keys_are_compared_byte_for_byte::<$fixture>(
                "keys_are_compared_byte_for_byte",
            )
            .await;
        }

        #[tokio::test]
        async fn results_of_several_mib_round_trip() {
            $crate::request_extras::results_of_several_mib_round_trip::<$fixture>(
                "results_of_several_mib_round_trip",
            )
            .await;
        }

        #[tokio::test]
        async fn migrating_again_keeps_the_records() {
            $crate::request_extras::migrating_again_keeps_the_records::<$fixture>(
                "migrating_again_keeps_the_records",
            )
            .await;
        }
    };
}
pub(crate) use request_extras;
