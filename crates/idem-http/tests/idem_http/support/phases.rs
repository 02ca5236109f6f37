//! Recovery points behind the layer ([`IdemPhases`]) on the SQL stores: a two-phase payment —
//! `Charge` (a "foreign" call, counted, plus an effect row) then `Record` (an effect row and
//! the response) — driven as a tower service, per principal, with the completer finishing
//! what a handler left stuck.
//!
//! The request body picks what `Record` does on the record's first attempt (`mode`): `ok`,
//! `fail-once` (write, then fail: rolled back), `block` (wait until the test releases it: a
//! server that hangs or died) or `abandon` (store a 402 as abandoned, with a refund row).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::StatusCode;
use http::request::Parts;
use http_body_util::BodyExt;
use idem_core::store::RecoveryStore;
use idem_core::{BoxError, Migrate};
use idem_http::IdempotencyLayer;
use idem_http::phases::{IdemPhases, PhaseResponse, Phases, PhasesError};
use idem_request::{Completer, Idempotency, PhaseCtx, Step};
use idem_testkit::http::HttpFixture;
use serde_json::json;
use tokio::sync::Notify;
use tower::ServiceExt;

/// The phases of a payment; each carries the request's data, as the completer needs it.
#[derive(serde::Serialize, serde::Deserialize)]
enum Pay {
    Charge {
        tag: String,
        cents: i64,
        mode: String,
    },
    Record {
        tag: String,
        cents: i64,
        mode: String,
        processor_id: String,
    },
}

/// What the test observes and controls.
#[derive(Default)]
struct Shared {
    /// Foreign keys sent per tag, one entry per call.
    calls: Mutex<HashMap<String, Vec<String>>>,
    entered: Notify,
    release: Notify,
}

struct Payments<F> {
    fx: Arc<F>,
    shared: Arc<Shared>,
}

impl<F> Clone for Payments<F> {
    fn clone(&self) -> Self {
        Self {
            fx: Arc::clone(&self.fx),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<F> Phases<F::Store> for Payments<F>
where
    F: HttpFixture,
    F::Store: RecoveryStore,
{
    type Phase = Pay;
    type Error = BoxError;

    async fn step(
        &self,
        phase: Pay,
        ctx: &mut PhaseCtx<F::Store>,
    ) -> Result<Step<Pay, PhaseResponse>, BoxError> {
        Ok(match phase {
            Pay::Charge { tag, cents, mode } => {
                let key = ctx.foreign_key("charge").to_uuid_string();
                self.shared
                    .calls
                    .lock()
                    .expect("the test's lock")
                    .entry(tag.clone())
                    .or_default()
                    .push(key);
                self.fx
                    .record_effect(ctx.tx(), &format!("{tag}:charge"))
                    .await?;
                let processor_id = format!("pr_{tag}");
                Step::Next(Pay::Record {
                    tag,
                    cents,
                    mode,
                    processor_id,
                })
            }
            Pay::Record {
                tag,
                cents,
                mode,
                processor_id,
            } => {
                let first = ctx.attempt() == 1;
                match mode.as_str() {
                    "fail-once" if first => {
                        self.fx
                            .record_effect(ctx.tx(), &format!("{tag}:record"))
                            .await?;
                        return Err("the ledger refused the row".into());
                    }
                    "block" if first => {
                        self.shared.entered.notify_one();
                        self.shared.release.notified().await;
                    }
                    "abandon" => {
                        self.fx
                            .record_effect(ctx.tx(), &format!("{tag}:refund"))
                            .await?;
                        let body = json!({ "tag": tag, "declined": true });
                        return Ok(Step::Abandon(PhaseResponse::json(
                            StatusCode::PAYMENT_REQUIRED,
                            &body,
                        )?));
                    }
                    _ => {}
                }
                self.fx
                    .record_effect(ctx.tx(), &format!("{tag}:record"))
                    .await?;
                let body = json!({ "tag": tag, "cents": cents, "processor_id": processor_id });
                Step::Done(PhaseResponse::json(StatusCode::CREATED, &body)?.header(
                    http::header::LOCATION,
                    http::HeaderValue::from_str(&format!("/payments/{tag}"))?,
                ))
            }
        })
    }
}

async fn pay<F>(
    State(op): State<Payments<F>>,
    phases: IdemPhases<F::Store>,
    body: Bytes,
) -> Result<PhaseResponse, PhasesError>
where
    F: HttpFixture,
    F::Store: RecoveryStore,
{
    let order: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let first = Pay::Charge {
        tag: order["tag"].as_str().unwrap_or("none").to_owned(),
        cents: order["cents"].as_i64().unwrap_or(0),
        mode: order["mode"].as_str().unwrap_or("ok").to_owned(),
    };
    phases.run(first, op).await
}

fn account(parts: &Parts) -> Option<Vec<u8>> {
    parts
        .headers
        .get("x-account")
        .map(|v| v.as_bytes().to_vec())
}

struct Bench<F: HttpFixture> {
    fx: Arc<F>,
    idem: Idempotency<F::Store>,
    op: Payments<F>,
    app: Router,
}

impl<F> Bench<F>
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    /// `lease` without a heartbeat, so a blocked request's lease runs out.
    async fn new(test: &str, lease: Duration) -> Option<Self> {
        let fx = Arc::new(F::setup(test).await?);
        let idem = Idempotency::builder(fx.store())
            .lease(lease)
            .without_heartbeat()
            .build()
            .expect("engine");
        let op = Payments {
            fx: Arc::clone(&fx),
            shared: Arc::default(),
        };
        let layer = IdempotencyLayer::per_principal(idem.clone(), account).require_key();
        let app = Router::new()
            .route("/payments", post(pay::<F>).layer(layer))
            .with_state(op.clone());
        Some(Self { fx, idem, op, app })
    }

    async fn post(&self, key: &str, tag: &str, mode: &str) -> Answer {
        let body = json!({ "tag": tag, "cents": 1250, "mode": mode }).to_string();
        let request = http::Request::post("/payments")
            .header("x-account", "acct_1")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .expect("request");
        let response = self.app.clone().oneshot(request).await.expect("infallible");
        let (head, body) = response.into_parts();
        Answer {
            status: head.status,
            replayed: head.headers.get("idempotent-replayed").is_some(),
            location: head
                .headers
                .get(http::header::LOCATION)
                .map(|v| v.to_str().unwrap_or_default().to_owned()),
            content_type: head
                .headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap_or_default().to_owned()),
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    fn calls(&self, tag: &str) -> Vec<String> {
        self.op
            .shared
            .calls
            .lock()
            .expect("the test's lock")
            .get(tag)
            .cloned()
            .unwrap_or_default()
    }

    async fn effects(&self, tag: &str, what: &str) -> i64 {
        self.fx.count_effects(&format!("{tag}:{what}")).await
    }

    fn completer(&self, max_attempts: u32) -> Completer<F::Store> {
        let op = self.op.clone();
        Completer::builder(self.idem.clone())
            .max_attempts(max_attempts)
            .any_scope_operation(
                "payments",
                move |idem, stuck| {
                    let op = op.clone();
                    async move { idem_http::phases::resume(&idem, stuck, op).await.map(drop) }
                },
                |execution, _recovery| async move {
                    let gone = PhaseResponse::json(
                        StatusCode::GONE,
                        &json!({ "error": "given up after its attempts" }),
                    )
                    .map_err(|e| {
                        idem_core::Error::new(idem_core::ErrorKind::Store, e.to_string())
                    })?;
                    idem_http::phases::give_up(execution, &gone).await
                },
            )
            .build()
            .expect("completer")
    }

    async fn done(self) {
        let Self { fx, op, app, .. } = self;
        drop((op, app));
        let mut fx = fx;
        for _ in 0..100 {
            match Arc::try_unwrap(fx) {
                Ok(fx) => return fx.teardown().await,
                Err(back) => fx = back,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    location: Option<String>,
    content_type: Option<String>,
    body: Bytes,
}

macro_rules! bench {
    ($test:expr, $lease:expr) => {
        match Bench::<F>::new($test, $lease).await {
            Some(bench) => bench,
            None => return,
        }
    };
}

const LONG: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(400);

/// Waits out a blocked request's lease (no heartbeat renews it).
async fn lease_runs_out() {
    tokio::time::sleep(SHORT + Duration::from_millis(250)).await;
}

/// The first execution runs each phase once, commits the first phase before the second, and
/// stores the last phase's response; the retry replays it with `Idempotent-Replayed`.
pub(crate) async fn a_first_execution_runs_each_phase_once_and_replays<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = bench!(test, LONG);
    let first = bench.post("k-1", "p1", "ok").await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed);
    assert_eq!(first.location.as_deref(), Some("/payments/p1"));
    let body: serde_json::Value = serde_json::from_slice(&first.body).expect("a JSON body");
    assert_eq!(body["processor_id"], "pr_p1");
    let retry = bench.post("k-1", "p1", "ok").await;
    assert!(retry.replayed);
    assert_eq!(
        (
            retry.status,
            &retry.location,
            &retry.content_type,
            &retry.body
        ),
        (
            first.status,
            &first.location,
            &first.content_type,
            &first.body
        )
    );
    assert_eq!(bench.calls("p1").len(), 1);
    assert_eq!(bench.effects("p1", "charge").await, 1);
    assert_eq!(bench.effects("p1", "record").await, 1);
    bench.done().await;
}

/// A phase that fails is rolled back alone: the answer is `503 phase-failed` (not stored),
/// the record keeps the committed `Charge`, and the retry resumes at `Record` — the foreign
/// call and its row happened once.
pub(crate) async fn a_retry_after_a_failed_phase_resumes_at_its_point<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = bench!(test, LONG);
    let failed = bench.post("k-2", "p2", "fail-once").await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!failed.replayed);
    let problem: serde_json::Value = serde_json::from_slice(&failed.body).expect("a JSON body");
    assert_eq!(problem["code"], "phase-failed");
    // The failed phase's row rolled back; the committed phase's stands.
    assert_eq!(bench.effects("p2", "record").await, 0);
    assert_eq!(bench.effects("p2", "charge").await, 1);

    let resumed = bench.post("k-2", "p2", "fail-once").await;
    assert_eq!(resumed.status, StatusCode::CREATED, "{:?}", resumed.body);
    assert!(!resumed.replayed);
    let replay = bench.post("k-2", "p2", "fail-once").await;
    assert!(replay.replayed);
    assert_eq!(replay.body, resumed.body);
    assert_eq!(bench.calls("p2").len(), 1, "the foreign call ran again");
    assert_eq!(bench.effects("p2", "charge").await, 1);
    assert_eq!(bench.effects("p2", "record").await, 1);
    bench.done().await;
}

/// While a request runs its phases a duplicate is `409 conflict`; once its lease ran out (its
/// server hung) the retry takes the record over and resumes at the last point; the old
/// holder's late finish is refused (`409 lease-lost`) and rolled back.
pub(crate) async fn a_takeover_after_the_lease_resumes_at_the_last_point<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = Arc::new(bench!(test, SHORT));
    let holder = {
        let bench = Arc::clone(&bench);
        tokio::spawn(async move { bench.post("k-3", "p3", "block").await })
    };
    bench.op.shared.entered.notified().await;
    let duplicate = bench.post("k-3", "p3", "block").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    let problem: serde_json::Value = serde_json::from_slice(&duplicate.body).expect("a JSON body");
    assert_eq!(problem["code"], "conflict");

    lease_runs_out().await;
    let taken = bench.post("k-3", "p3", "block").await;
    assert_eq!(taken.status, StatusCode::CREATED, "{:?}", taken.body);
    assert!(!taken.replayed);
    bench.op.shared.release.notify_one();
    let late = holder.await.expect("the holder's request");
    assert_eq!(late.status, StatusCode::CONFLICT, "{:?}", late.body);
    let problem: serde_json::Value = serde_json::from_slice(&late.body).expect("a JSON body");
    assert_eq!(problem["code"], "lease-lost");

    let replay = bench.post("k-3", "p3", "block").await;
    assert!(replay.replayed);
    assert_eq!(replay.body, taken.body);
    let calls = bench.calls("p3");
    assert_eq!(calls.len(), 1, "the committed Charge ran again: {calls:?}");
    assert_eq!(bench.effects("p3", "charge").await, 1);
    assert_eq!(bench.effects("p3", "record").await, 1);
    match Arc::try_unwrap(bench) {
        Ok(bench) => bench.done().await,
        Err(_) => panic!("the bench is still shared"),
    }
}

/// The completer finishes a request its handler left stuck mid-phase, with the same phases,
/// and stores its response in the layer's format: the client's retry gets it replayed, as
/// a normal finish of the same request would answer.
pub(crate) async fn the_completer_finishes_a_layer_record_and_the_retry_replays_it<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = Arc::new(bench!(test, SHORT));
    let normal = bench.post("k-normal", "p4", "ok").await;
    assert_eq!(normal.status, StatusCode::CREATED);
    let holder = {
        let bench = Arc::clone(&bench);
        tokio::spawn(async move { bench.post("k-4", "p4", "block").await })
    };
    bench.op.shared.entered.notified().await;
    lease_runs_out().await;
    let completer = bench.completer(5);
    assert_eq!(completer.pass().await.expect("a pass"), 1);
    assert_eq!(completer.stats().resumed, 1, "{:?}", completer.stats());

    let retry = bench.post("k-4", "p4", "block").await;
    assert!(retry.replayed, "{retry:?}");
    assert_eq!(
        (
            retry.status,
            &retry.location,
            &retry.content_type,
            &retry.body
        ),
        (
            normal.status,
            &normal.location,
            &normal.content_type,
            &normal.body
        ),
        "the completer's stored response differs from a normal finish"
    );
    bench.op.shared.release.notify_one();
    let late = holder.await.expect("the holder's request");
    assert_eq!(late.status, StatusCode::CONFLICT, "{:?}", late.body);
    // p4: one charge each for the two keys; the stuck one's foreign key was sent once.
    assert_eq!(bench.calls("p4").len(), 2);
    assert_eq!(bench.effects("p4", "charge").await, 2);
    assert_eq!(bench.effects("p4", "record").await, 2);
    match Arc::try_unwrap(bench) {
        Ok(bench) => bench.done().await,
        Err(_) => panic!("the bench is still shared"),
    }
}

/// Out of attempts, the completer gives a stuck request up with the response of its choice,
/// stored as abandoned in the layer's format; the client's retry gets it replayed.
pub(crate) async fn the_completer_gives_a_layer_record_up_with_a_replayed_response<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = Arc::new(bench!(test, SHORT));
    let holder = {
        let bench = Arc::clone(&bench);
        tokio::spawn(async move { bench.post("k-5", "p5", "block").await })
    };
    bench.op.shared.entered.notified().await;
    lease_runs_out().await;
    let completer = bench.completer(1);
    assert_eq!(completer.pass().await.expect("a pass"), 1);
    assert_eq!(completer.stats().abandoned, 1, "{:?}", completer.stats());
    let retry = bench.post("k-5", "p5", "block").await;
    assert!(retry.replayed);
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.content_type.as_deref(), Some("application/json"));
    bench.op.shared.release.notify_one();
    let _ = holder.await;
    assert_eq!(bench.effects("p5", "record").await, 0);
    match Arc::try_unwrap(bench) {
        Ok(bench) => bench.done().await,
        Err(_) => panic!("the bench is still shared"),
    }
}

/// `Step::Abandon` stores the response as abandoned with the phase's writes (a refund row);
/// every retry replays it.
pub(crate) async fn an_abandoned_operation_replays_its_response<F>(test: &str)
where
    F: HttpFixture,
    F::Store: RecoveryStore + Migrate,
{
    let bench = bench!(test, LONG);
    let first = bench.post("k-6", "p6", "abandon").await;
    assert_eq!(
        first.status,
        StatusCode::PAYMENT_REQUIRED,
        "{:?}",
        first.body
    );
    assert!(!first.replayed);
    let retry = bench.post("k-6", "p6", "abandon").await;
    assert!(retry.replayed);
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(bench.effects("p6", "charge").await, 1);
    assert_eq!(bench.effects("p6", "refund").await, 1);
    assert_eq!(bench.calls("p6").len(), 1);
    bench.done().await;
}
