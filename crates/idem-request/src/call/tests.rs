//! `call` against a real (SQLite) store: what the input's fingerprint depends on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use idem_core::{IdempotencyKey, RequestAction, RequestErrorKind, RequestScope};
use idem_sql::{SqliteOptions, SqliteStore};

use crate::Idempotency;

async fn engine(dir: &tempfile::TempDir) -> Idempotency<SqliteStore> {
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
        .await
        .expect("open sqlite");
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    Idempotency::builder(store).build().expect("engine")
}

/// 100 entries, built afresh: every `HashMap` gets its own random hasher keys, so two of them
/// with the same entries iterate (and serialize) in different orders.
fn hundred_entries() -> HashMap<String, u32> {
    (0..100).map(|i| (format!("item-{i}"), i * 7)).collect()
}

#[tokio::test(flavor = "current_thread")]
async fn a_rebuilt_hash_map_input_replays_instead_of_key_reused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let idem = engine(&dir).await;
    let scope = RequestScope::new(["call", "hash-map"]);
    let key = IdempotencyKey::new("k-hash-map").expect("key");
    let runs = AtomicU32::new(0);

    let first = hundred_entries();
    let mut orders = vec![first.keys().cloned().collect::<Vec<_>>()];
    let total: u32 = idem
        .call(scope, &key, &first, async |_tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(first.values().sum())
        })
        .await
        .expect("first call");
    for attempt in 0..5 {
        let rebuilt = hundred_entries();
        orders.push(rebuilt.keys().cloned().collect());
        let replayed: u32 = idem
            .call(scope, &key, &rebuilt, async |_tx| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(0)
            })
            .await
            .unwrap_or_else(|e| panic!("repeat {attempt} with a rebuilt map: {e}"));
        assert_eq!(replayed, total, "repeat {attempt}: not the stored result");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the function ran again");
    // The test means something only if the maps really iterated in different orders.
    orders.dedup();
    assert!(
        orders.len() > 1,
        "every rebuilt map iterated in the same order"
    );

    // A different input under the same key is still refused.
    let mut changed = hundred_entries();
    changed.insert("item-0".to_owned(), 1);
    let err = idem
        .call(scope, &key, &changed, async |_tx| {
            Ok::<_, std::io::Error>(0u32)
        })
        .await
        .expect_err("another input under the same key");
    assert_eq!(
        err.request_kind(),
        Some(RequestErrorKind::KeyReused),
        "{err}"
    );
    assert_eq!(RequestAction::of(&err), RequestAction::GiveUp);
}

mod canonical_encoding {
    use std::collections::{BTreeMap, HashMap};

    use serde::Serialize;

    use crate::call::canonical::to_vec;

    #[derive(Serialize)]
    struct Charge<'a> {
        // Not alphabetical: a struct keeps its declaration order.
        to: &'a str,
        cents: i64,
        memo: Option<&'a str>,
        tags: Vec<&'a str>,
        rate: f64,
        kind: Kind,
        extra: Meta,
    }

    #[derive(Serialize)]
    enum Kind {
        Card,
        Wire(u8),
        Split(u8, u8),
        Held { until: u64, why: char },
    }

    #[derive(Serialize)]
    struct Meta(
        u128,
        (),
        Unit,
        #[serde(with = "serde_bytes_like")] Vec<u8>,
        f32,
    );

    #[derive(Serialize)]
    struct Unit;

    /// `serialize_bytes`, as `serde_bytes` would.
    mod serde_bytes_like {
        pub(super) fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(v)
        }
    }

    fn same_as_serde_json<T: Serialize + ?Sized>(value: &T) {
        let plain = serde_json::to_vec(value).expect("serde_json");
        let canonical = to_vec(value).expect("canonical");
        assert_eq!(
            String::from_utf8_lossy(&canonical),
            String::from_utf8_lossy(&plain)
        );
    }

    /// Records stored by earlier versions hashed `serde_json::to_vec(input)`: every input
    /// without a map must encode to exactly those bytes, so its fingerprint still matches.
    #[test]
    fn inputs_without_maps_encode_exactly_as_serde_json() {
        for kind in [
            Kind::Card,
            Kind::Wire(3),
            Kind::Split(1, 2),
            Kind::Held {
                until: u64::MAX,
                why: '"',
            },
        ] {
            same_as_serde_json(&Charge {
                to: "bob \u{1F600} \"quoted\" \\ \n\t\u{7}",
                cents: -1250,
                memo: None,
                tags: vec!["a", "b", ""],
                rate: 0.1 + 0.2,
                kind,
                extra: Meta(u128::MAX, (), Unit, vec![0, 255], f32::NAN),
            });
        }
        same_as_serde_json(&("alice", 1250, Some(f64::INFINITY), [1u8; 3]));
        same_as_serde_json("just a string");
        same_as_serde_json(&Vec::<i32>::new());
        same_as_serde_json(&((), -0.0f64, 1e300, i128::MIN, 'x', true));
        // Maps already in key order (as strings) keep their bytes too.
        let sorted: BTreeMap<String, Vec<u32>> =
            [("a".into(), vec![1]), ("b".into(), vec![])].into();
        same_as_serde_json(&sorted);
        same_as_serde_json(&serde_json::json!({"z": {"y": [1, {"b": 2, "a": 1}]}, "a": null}));
        same_as_serde_json(&BTreeMap::<String, u8>::new());
    }

    #[test]
    fn maps_are_sorted_by_key_at_every_depth() {
        #[derive(Serialize)]
        struct Order {
            lines: Vec<HashMap<&'static str, u32>>,
            by_id: BTreeMap<i32, &'static str>,
            #[serde(flatten)]
            rest: HashMap<&'static str, bool>,
        }
        let order = Order {
            lines: vec![[("b", 2), ("a", 1), ("c", 3)].into()],
            by_id: [(10, "ten"), (2, "two"), (-1, "minus one")].into(),
            rest: [("zeta", true), ("alpha", false)].into(),
        };
        // `flatten` makes the struct a map in serde's model, so its fields sort too.
        assert_eq!(
            String::from_utf8(to_vec(&order).expect("canonical")).expect("utf-8"),
            r#"{"alpha":false,"by_id":{"-1":"minus one","10":"ten","2":"two"},"lines":[{"a":1,"b":2,"c":3}],"zeta":true}"#
        );
        let wrapped: HashMap<bool, Option<HashMap<char, ()>>> =
            [(true, Some([('y', ()), ('x', ())].into())), (false, None)].into();
        assert_eq!(
            to_vec(&wrapped).expect("canonical"),
            br#"{"false":null,"true":{"x":null,"y":null}}"#
        );
        assert_eq!(to_vec(&HashMap::<u8, u8>::new()).expect("empty"), b"{}");
    }

    #[test]
    fn equal_hash_maps_encode_equally_whatever_their_order() {
        let build = || -> HashMap<String, Vec<HashMap<u16, String>>> {
            (0..100)
                .map(|i| {
                    let inner = (0..5).map(|j| (j * i, format!("{i}/{j}"))).collect();
                    (format!("k{i}"), vec![inner])
                })
                .collect()
        };
        let first = to_vec(&build()).expect("canonical");
        for _ in 0..10 {
            assert_eq!(to_vec(&build()).expect("canonical"), first);
        }
        let as_value: serde_json::Value = serde_json::from_slice(&first).expect("valid JSON");
        assert_eq!(as_value, serde_json::to_value(build()).expect("to_value"));
    }

    #[test]
    fn keys_serde_json_refuses_are_refused() {
        let map: HashMap<Vec<u8>, u8> = [(vec![1], 1)].into();
        let plain = serde_json::to_vec(&map).expect_err("serde_json refuses sequence keys");
        let canonical = to_vec(&map).expect_err("so does the canonical encoding");
        assert_eq!(canonical.to_string(), plain.to_string());
    }

    /// serde_json's `RawValue` (feature `raw_value`, on in some builds, not in this crate's)
    /// serializes as a marker struct holding the JSON text; this is that shape.
    #[test]
    fn raw_json_values_are_canonical_too() {
        struct Raw(&'static str);
        impl Serialize for Raw {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                const TOKEN: &str = "$serde_json::private::RawValue";
                let mut raw = s.serialize_struct(TOKEN, 1)?;
                raw.serialize_field(TOKEN, self.0)?;
                raw.end()
            }
        }
        /// A `Number` under `arbitrary_precision`: a marker struct holding the digits.
        struct Digits(&'static str);
        impl Serialize for Digits {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                const TOKEN: &str = "$serde_json::private::Number";
                let mut n = s.serialize_struct(TOKEN, 1)?;
                n.serialize_field(TOKEN, self.0)?;
                n.end()
            }
        }
        let input = (
            Raw(r#"{ "b" : 1, "a" : [2] }"#),
            Digits("123456789012345678901234"),
        );
        assert_eq!(
            to_vec(&input).expect("canonical"),
            br#"[{"a":[2],"b":1},123456789012345678901234]"#
        );
    }
}
