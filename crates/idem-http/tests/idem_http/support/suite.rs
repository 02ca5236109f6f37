//! The checks that are not black-box — they drive the layer as a tower service (a request
//! dropped at every await point, a tonic client) — generic over the store; `http_suite!` runs
//! each once per store. The black-box checks are `idem_testkit::http`'s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_testkit::http::{HttpFixture, Post, Server, SuiteApp, layer, serve};
use serde_json::json;
use tower::ServiceExt;

use super::app::Axum;
use super::grpc;
use super::hang::{Gate, Hang};
pub(crate) use super::write_lock::a_slow_request_that_never_writes_does_not_delay_another_key;

macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => Arc::new(fx),
            None => return,
        }
    };
}

async fn default_server<F: HttpFixture>(fx: &Arc<F>) -> Server<F> {
    serve::<Axum, F>(Arc::clone(fx), fx.store(), |b| b).await
}

async fn done<F: HttpFixture>(server: Server<F>, fx: Arc<F>) {
    drop(server);
    // The server task may still hold a clone for a moment after the abort.
    let mut fx = fx;
    for _ in 0..100 {
        match Arc::try_unwrap(fx) {
            Ok(fx) => return fx.teardown().await,
            Err(back) => fx = back,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 19, point 7: the request dropped at each await point in turn — every store call
/// before and after it returns, and inside the handler — never leaves its key in progress:
/// a retry runs (or replays) at once, not after the 30 s lease.
pub(crate) async fn a_request_dropped_at_any_await_point_frees_its_key<F: HttpFixture>(test: &str) {
    use axum::extract::State;
    use axum::routing::post;
    use idem_http::IdemTx;

    struct HangApp<F> {
        fx: Arc<F>,
        gate: Arc<Gate>,
    }
    async fn handler<F: HttpFixture>(
        State(app): State<Arc<HangApp<F>>>,
        tx: Option<IdemTx<Hang<F::Store>>>,
        body: bytes::Bytes,
    ) -> (http::StatusCode, String) {
        let order: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let effect = order["effect"].as_str().unwrap_or("none").to_owned();
        if let Some(mut tx) = tx {
            app.fx
                .record_effect(&mut tx, &effect)
                .await
                .expect("effect written");
        }
        app.gate.point().await;
        (
            http::StatusCode::CREATED,
            json!({ "effect": effect }).to_string(),
        )
    }

    let fx = fixture!(test);
    let check = default_server(&fx).await;
    let mut dropped = 0;
    for target in 1..=40 {
        let gate = Gate::new(target);
        let store = Hang {
            inner: fx.store(),
            gate: Arc::clone(&gate),
        };
        let idem = idem_request::Idempotency::builder(store)
            .build()
            .expect("engine");
        let app = axum::Router::new()
            .route("/charges", post(handler::<F>).layer(layer(idem)))
            .with_state(Arc::new(HangApp {
                fx: Arc::clone(&fx),
                gate: Arc::clone(&gate),
            }));
        let key = format!("k-drop-{target}");
        let effect = format!("drop-{target}");
        let request = http::Request::post("/charges")
            .header("content-type", "application/json")
            .header("x-principal", "alice")
            .header("idempotency-key", key.as_str())
            .body(axum::body::Body::from(
                json!({ "effect": effect }).to_string(),
            ))
            .expect("request");
        let mut call = tokio::spawn(app.oneshot(request));
        let finished = tokio::select! {
            r = &mut call => Some(r),
            () = gate.reached() => None,
            () = tokio::time::sleep(Duration::from_secs(20)) => panic!("point {target}: stuck"),
        };
        if let Some(r) = finished {
            let r = r.expect("task").expect("infallible");
            assert_eq!(r.status(), 201, "the request past every point");
            break;
        }
        // Dropped here, at the target point; whatever else waits on the gate goes on.
        call.abort();
        let _ = call.await;
        gate.resume();
        dropped += 1;
        let started = Instant::now();
        let retry = loop {
            let r = check.post(Post::new(&key, &effect)).await;
            if r.status != 409 {
                break r;
            }
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "dropped at await point {target}: the key is still in progress after {:?}: {r:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(retry.status, 201, "point {target}: {retry:?}");
        if F::SHARED_TRANSACTION {
            assert_eq!(
                fx.count_effects(&effect).await,
                1,
                "point {target}: one effect, the dropped one's or the retry's"
            );
        }
    }
    assert!(dropped >= 9, "only {dropped} await points were found");
    done(check, fx).await;
}

/// Issue 19, point 9: a tonic unary method behind the layer (key in the `idempotency-key`
/// metadata) replays its message and its status — trailers included — and a status that says
/// "not now" is not stored; a streaming method passes through untouched.
pub(crate) async fn a_grpc_unary_call_replays_its_message_and_status<F: HttpFixture>(test: &str) {
    use idem_http::{IdempotencyLayer, KeyRequirement};
    use tonic::Code;

    let fx = fixture!(test);
    let app = Arc::new(SuiteApp::new(Arc::clone(&fx)));
    let idem = idem_request::Idempotency::builder(fx.store())
        .build()
        .expect("engine");
    // Streaming methods are not idempotent requests: their bodies are never buffered.
    let layer: IdempotencyLayer<_, _> =
        layer(idem).key_requirement_by(|parts: &http::request::Parts| match parts.uri.path() {
            grpc::WATCH => KeyRequirement::Off,
            _ => KeyRequirement::Required,
        });
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .service(grpc::Charges {
            app: Arc::clone(&app),
        });
    let mut client =
        tonic::client::Grpc::with_origin(service, http::Uri::from_static("http://charges.test"));
    let executions = || app.executions.load(std::sync::atomic::Ordering::SeqCst);
    let mut call = async |key: &str, effect: &str, fail_with: i32| {
        client.ready().await.expect("ready");
        let order = grpc::ChargeRequest {
            effect: effect.to_owned(),
            fail_with,
        };
        client
            .unary(
                grpc::charge_request(key, "alice", order),
                grpc::charge_path(),
                grpc::client_codec(),
            )
            .await
    };

    // OK: the message, then `grpc-status: 0` in the trailers.
    let first = call("g-ok", "grpc-ok", 0).await.expect("the first call");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let replay = call("g-ok", "grpc-ok", 0).await.expect("the replay");
    assert_eq!(replay.get_ref(), first.get_ref(), "the stored message");
    assert_eq!(
        replay
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(executions(), 1);
    assert_eq!(fx.count_effects("grpc-ok").await, 1);

    // A status the handler decided on after acting (Trailers-Only): stored and replayed.
    let not_found = call("g-404", "grpc-404", Code::NotFound as i32)
        .await
        .expect_err("NOT_FOUND");
    assert_eq!(not_found.code(), Code::NotFound);
    let again = call("g-404", "grpc-404", Code::NotFound as i32)
        .await
        .expect_err("replayed NOT_FOUND");
    assert_eq!(again.code(), Code::NotFound);
    assert_eq!(again.message(), not_found.message());
    assert_eq!(
        again
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(executions(), 2);

    // UNAVAILABLE says "not now": not stored, the retry runs.
    let unavailable = call("g-503", "grpc-503", Code::Unavailable as i32)
        .await
        .expect_err("UNAVAILABLE");
    assert_eq!(unavailable.code(), Code::Unavailable);
    let retried = call("g-503", "grpc-503", 0).await.expect("the retry runs");
    assert_eq!(retried.get_ref().execution, 4);
    assert!(retried.metadata().get("idempotent-replayed").is_none());
    if F::SHARED_TRANSACTION {
        assert_eq!(
            fx.count_effects("grpc-503").await,
            1,
            "UNAVAILABLE rolled back"
        );
    }
    let records = fx.count_records().await;

    // Server streaming, even with a key: untouched, streamed, nothing recorded.
    client.ready().await.expect("ready");
    let order = grpc::ChargeRequest {
        effect: "watch".to_owned(),
        fail_with: 0,
    };
    let stream = client
        .server_streaming(
            grpc::charge_request("g-watch", "alice", order),
            grpc::watch_path(),
            grpc::client_codec(),
        )
        .await
        .expect("the stream starts");
    let mut stream = stream.into_inner();
    let mut seen = Vec::new();
    while let Some(reply) = stream.message().await.expect("a message") {
        seen.push((reply.execution, reply.effect));
    }
    let passed = "passed-through".to_owned();
    assert_eq!(
        seen,
        [(1, passed.clone()), (2, passed.clone()), (3, passed)]
    );
    assert_eq!(
        fx.count_records().await,
        records,
        "a stream records nothing"
    );
    drop(client);
    drop(app);
    let mut fx = fx;
    for _ in 0..100 {
        match Arc::try_unwrap(fx) {
            Ok(fx) => return fx.teardown().await,
            Err(back) => fx = back,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
