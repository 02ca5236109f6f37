//! The idempotency layer (`idem-http`) in front of `POST /charges`, on each store, and the
//! handlers that write the charge.
//!
//! On the SQL stores the handler writes through the layer's transaction ([`IdemTx`]), which
//! commits together with the stored response: a charge exists exactly when its response is
//! stored. Redis shares no transaction with the ledger, so there the charge's ID is derived
//! from the request's record ([`IdemRequest::derive_key`]: principal, route and key) and the
//! insert keeps the first row of that ID — a re-execution after a crash between the charge
//! and the completion, or a late one after a takeover, then finds the charge instead of
//! making a second. A key reused after its record expired is a new request (as on the SQL
//! stores): the charge it finds is older than the records live, so it makes the next one.

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, post};
use idem_core::outbox::OutboxStore;
use idem_core::store::RequestStore;
use idem_http::{IdemRequest, IdemTx, IdempotencyLayer};
use idem_redis::RedisRequestStore;
use idem_relay::RelayWaker;
use idem_request::Idempotency;

use crate::app::{self, AppState, Principal};
use crate::emit::Emit;
use crate::ledger::{Ledger, WriteCharge};
use crate::{Heartbeat, ServeArgs};

/// The engine with the service's lease, heartbeat and TTL.
pub(crate) fn engine<S: RequestStore + Clone + 'static>(
    store: S,
    args: &ServeArgs,
) -> Result<Idempotency<S>> {
    let mut builder = Idempotency::builder(store).lease(args.lease).ttl(args.ttl);
    builder = match args.heartbeat {
        Some(Heartbeat::Off) => builder.without_heartbeat(),
        Some(Heartbeat::Every(every)) => builder.heartbeat(every),
        None => builder,
    };
    if args.leased_only {
        builder = builder.leased_only();
    }
    Ok(builder.build()?)
}

/// How the layer finds a request's principal.
pub(crate) type PrincipalOf = fn(&Parts) -> Option<String>;

/// The principal the authentication middleware established: records are scoped to it.
fn principal_of(parts: &Parts) -> Option<String> {
    parts.extensions.get::<Principal>().map(|p| p.0.clone())
}

/// The layer: records per principal, and `POST /charges` requires a key.
pub(crate) fn layer<S: RequestStore + Clone + 'static>(
    idem: Idempotency<S>,
) -> IdempotencyLayer<S, idem_http::PrincipalFn<PrincipalOf>> {
    IdempotencyLayer::per_principal(idem, principal_of as PrincipalOf).require_key()
}

/// The service on a SQL store: the charge (and with `--emit` its event, in `emit`'s outbox) is
/// written through the layer's transaction; `waker`, the relay's, is woken once the layer
/// has answered, which is after the transaction committed.
pub(crate) fn sql<S>(
    store: S,
    ledger: Ledger,
    emit: Option<Emit<S>>,
    waker: Option<RelayWaker>,
    args: &ServeArgs,
) -> Result<Router>
where
    S: RequestStore + OutboxStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let idem = engine(store, args)?;
    let state = AppState {
        ledger,
        test_hooks: args.test_hooks,
        ttl: args.ttl,
    };
    let route: MethodRouter<AppState> = post(post_charge_in_tx::<S>).layer(layer(idem));
    let mut route = route.layer(Extension(emit));
    if let Some(waker) = waker {
        route = route.layer(axum::middleware::from_fn_with_state(
            waker,
            crate::emit::wake_after,
        ));
    }
    Ok(app::router(state, route))
}

/// The service on Redis, the charges in the SQL ledger.
pub(crate) async fn redis(url: &str, ledger: Ledger, args: &ServeArgs) -> Result<Router> {
    let store = RedisRequestStore::connect(url)
        .await
        .with_context(|| format!("connecting to {}", idem_redact::redact_url(url)))?;
    let idem = engine(store, args)?;
    let state = AppState {
        ledger,
        test_hooks: args.test_hooks,
        ttl: args.ttl,
    };
    Ok(app::router(
        state,
        post(post_charge_keyed).layer(layer(idem)),
    ))
}

/// `POST /charges` on a SQL store: the row (and with `--emit` its event) commits with the
/// stored response or not at all.
///
/// A body that does not validate is answered before the transaction is used, so the layer
/// does not store the answer (the handler had not started) and the corrected retry runs.
async fn post_charge_in_tx<S>(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Extension(emit): Extension<Option<Emit<S>>>,
    request: IdemRequest,
    mut tx: IdemTx<S>,
    headers: HeaderMap,
    body: Bytes,
) -> Response
where
    S: RequestStore + OutboxStore + 'static,
    S::Tx: WriteCharge + 'static,
{
    let charge = match app::parse_charge(&body) {
        Ok(c) => c,
        Err(problem) => return problem.into_response(),
    };
    if let Some(d) = app::test_work(&state, &headers) {
        tokio::time::sleep(d).await;
    }
    // On SQLite this first write takes the database's write lock (the layer's transaction
    // begins deferred), waiting up to `--busy-timeout` for it.
    if let Err(e) = tx.insert_charge(&principal.0, &charge).await {
        return app::database_error(&state, &e);
    }
    if let Some(emit) = &emit
        && let Err(e) = emit.charged(&mut tx, &request, &charge).await
    {
        return crate::emit::outbox_error(&e);
    }
    if let Some(d) = app::test_sleep(&state, &headers) {
        app::sleep_in_transaction(d).await;
    }
    app::created(&charge)
}

/// `POST /charges` on Redis: the charge's ID is derived from the request's record, so only
/// the first execution of a record inserts a row; any later one answers with that row.
async fn post_charge_keyed(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    request: IdemRequest,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let charge = match app::parse_charge(&body) {
        Ok(c) => c,
        Err(problem) => return problem.into_response(),
    };
    if let Some(d) = app::test_work(&state, &headers) {
        tokio::time::sleep(d).await;
    }
    let sleep = app::test_sleep(&state, &headers);
    let inside = async move {
        if let Some(d) = sleep {
            app::sleep_in_transaction(d).await;
        }
    };
    // Deriving the ID marks the execution started: from here even a 4xx would be stored.
    let id = |generation: u32| charge_id(&request, generation);
    match state
        .ledger
        .insert_once(&principal.0, &charge, id, state.ttl, inside)
        .await
    {
        Ok(stored) => app::created(&stored),
        Err(e) => app::database_error(&state, &e),
    }
}

/// `ch_` and 24 hex digits of the key the record derives for its charge; `generation` counts
/// the earlier records of the same key that expired (see `Ledger::insert_once`).
fn charge_id(request: &IdemRequest, generation: u32) -> String {
    let call = if generation == 0 {
        "ledger/charge".to_owned()
    } else {
        format!("ledger/charge#{generation}")
    };
    let derived = request.derive_key(&call).to_uuid_string();
    let hex: String = derived
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(24)
        .collect();
    format!("ch_{hex}")
}
