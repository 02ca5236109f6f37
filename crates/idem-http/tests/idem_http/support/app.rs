//! The axum adapter of the black-box suite (`idem_testkit::http`): the suite's routes on axum,
//! each behind an `IdempotencyLayer` configured per route, served on 127.0.0.1:0.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::HeaderMap;
use idem_http::{IdemRequest, IdemTx, KeyRequirement};
use idem_request::Idempotency;
use idem_testkit::http::{HttpFixture, HttpFramework, Order, Running, SuiteApp, layer};

/// The tower layer under axum.
pub(crate) struct Axum;

type App<F> = State<Arc<SuiteApp<F>>>;

async fn charge<F: HttpFixture>(
    State(app): App<F>,
    mut tx: Option<IdemTx<F::Store>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    app.charge(tx.as_deref_mut(), &headers, &body)
        .await
        .map(axum::body::Body::from)
}

async fn json_charge<F: HttpFixture>(
    State(app): App<F>,
    mut tx: Option<IdemTx<F::Store>>,
    headers: HeaderMap,
    Json(order): Json<Order>,
) -> Response {
    app.json_charge(tx.as_deref_mut(), &headers, order)
        .await
        .map(axum::body::Body::from)
}

async fn plain<F: HttpFixture>(State(app): App<F>, headers: HeaderMap) -> Response {
    app.plain(&headers).map(axum::body::Body::from)
}

async fn derive<F: HttpFixture>(
    State(app): App<F>,
    req: IdemRequest,
    headers: HeaderMap,
) -> Response {
    app.derive(&req, &headers).map(axum::body::Body::from)
}

async fn emit<F: HttpFixture>(
    State(app): App<F>,
    req: IdemRequest,
    mut tx: IdemTx<F::Store>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    app.emit(&mut tx, &req, &headers, &body)
        .await
        .map(axum::body::Body::from)
}

async fn list<F: HttpFixture>(State(app): App<F>) -> Response {
    app.list().map(axum::body::Body::from).into_response()
}

fn versioned<F: HttpFixture>(idem: &Idempotency<F::Store>) -> Router<Arc<SuiteApp<F>>> {
    Router::new()
        .route("/charges", post(charge::<F>).layer(layer(idem.clone())))
        .route("/derive", post(derive::<F>).layer(layer(idem.clone())))
        .route("/emit", post(emit::<F>).layer(layer(idem.clone())))
}

/// The suite's routes on axum, one layer per route, configured per route (the whole-router
/// form is in the crate docs).
pub(crate) fn router<F: HttpFixture>(app: Arc<SuiteApp<F>>, idem: Idempotency<F::Store>) -> Router {
    Router::new()
        .route(
            "/charges",
            post(charge::<F>).get(list::<F>).layer(layer(idem.clone())),
        )
        .route(
            "/optional",
            post(charge::<F>).layer(layer(idem.clone()).optional_key()),
        )
        .route(
            "/off",
            post(charge::<F>).layer(layer(idem.clone()).key_requirement(KeyRequirement::Off)),
        )
        .route("/json", post(json_charge::<F>).layer(layer(idem.clone())))
        .route("/plain", post(plain::<F>).layer(layer(idem.clone())))
        .route("/derive", post(derive::<F>).layer(layer(idem.clone())))
        .route("/emit", post(emit::<F>).layer(layer(idem.clone())))
        // The same routes under two prefixes: the layer sits inside the nested router, where
        // the request's URI has lost its prefix.
        .nest("/v1", versioned::<F>(&idem))
        .nest("/v2", versioned::<F>(&idem))
        .with_state(app)
}

impl HttpFramework for Axum {
    async fn serve<F: HttpFixture>(app: Arc<SuiteApp<F>>, idem: Idempotency<F::Store>) -> Running {
        let router = router(app, idem);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Running::new(format!("http://{addr}"), move || task.abort())
    }
}
