//! The HTTP surface: routes, bearer authentication, request validation, `problem+json`
//! errors, the request log, and the charge handlers that do not write through the idempotency
//! layer's transaction (reads, the Redis store, the benchmark's baselines).

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;

use crate::ledger::{Charge, Ledger};

/// The header that makes a handler sleep inside its transaction, honoured only with
/// `--test-hooks` (the crash tests kill the server while it sleeps).
pub(crate) const TEST_SLEEP_HEADER: &str = "x-test-sleep-ms";

/// The header that makes a handler sleep *before* it writes the charge — the work a real
/// handler does first (a call to a card processor) — honoured only with `--test-hooks` (the
/// benchmark's slow handler).
pub(crate) const TEST_WORK_HEADER: &str = "x-test-work-ms";

/// Where this service's own problem types point (the layer's point at idem-http's docs).
const PROBLEM_TYPE_BASE: &str = "https://github.com/idem-rs/idem/tree/main/examples/http-payments#";

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    /// Where charges are read (and, without a shared transaction, written).
    pub(crate) ledger: Ledger,
    /// Whether [`TEST_SLEEP_HEADER`] is honoured.
    pub(crate) test_hooks: bool,
    /// How long a completed request is replayed: a charge older than this cannot belong to a
    /// record that still exists (see `Ledger::insert_once`).
    pub(crate) ttl: Duration,
}

/// Who is asking: a digest of the bearer token, in this example (a real service would put
/// the account its authentication found). Records and charges are scoped to it; the token
/// itself is a credential and is never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Principal(pub(crate) String);

impl Principal {
    /// The principal of a bearer token: 64 hex digits of a SHA-256 over it.
    pub(crate) fn of_token(token: &str) -> Self {
        Self(idem_core::RequestScope::new(["http-payments/principal", token]).to_hex())
    }
}

/// The body of `POST /charges`. Unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct NewCharge {
    account: String,
    amount_cents: i64,
}

/// An RFC 9457 `application/problem+json` response with a short machine `code`.
pub(crate) fn problem(status: StatusCode, code: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("{PROBLEM_TYPE_BASE}{code}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
        "code": code,
    });
    let mut response = (status, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// A validation failure of a request body, as a problem response to be.
#[derive(Debug)]
pub(crate) struct Invalid {
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
}

impl Invalid {
    fn charge(detail: String) -> Self {
        Self {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            code: "invalid-charge",
            title: "The charge is not valid",
            detail,
        }
    }
}

impl IntoResponse for Invalid {
    fn into_response(self) -> Response {
        problem(self.status, self.code, self.title, &self.detail)
    }
}

/// The routes every mode shares; `post_charges` is the mode's `POST /charges`.
pub(crate) fn router(
    state: AppState,
    post_charges: axum::routing::MethodRouter<AppState>,
) -> Router {
    Router::new()
        .route("/charges", post_charges)
        .route("/charges/{id}", get(get_charge))
        .layer(axum::middleware::from_fn(authenticate))
        .route("/healthz", get(|| async { "ok" }))
        .layer(axum::middleware::from_fn(log_request))
        .with_state(state)
}

/// `Authorization: Bearer <token>` → [`Principal`]; anything else is 401 before any other
/// layer (the idempotency layer included) sees the request.
async fn authenticate(mut request: Request, next: Next) -> Response {
    match bearer_token(request.headers()) {
        Ok(token) => {
            request.extensions_mut().insert(Principal::of_token(&token));
            next.run(request).await
        }
        Err(detail) => {
            let mut response = problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Missing or malformed bearer token",
                detail,
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"http-payments\""),
            );
            response
        }
    }
}

/// The token of the one `Authorization: Bearer` header (RFC 6750's `b64token`, ≤ 255 bytes).
fn bearer_token(headers: &HeaderMap) -> Result<String, &'static str> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next().ok_or("send Authorization: Bearer <token>")?;
    if values.next().is_some() {
        return Err("send one Authorization header");
    }
    let value = value
        .to_str()
        .map_err(|_| "the Authorization header is not visible ASCII")?;
    let (scheme, token) = value
        .split_once(' ')
        .ok_or("expected Authorization: Bearer <token>")?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err("expected the Bearer scheme");
    }
    let token = token.trim_start_matches(' ');
    let body = token.trim_end_matches('=');
    let valid = !body.is_empty()
        && token.len() <= 255
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b));
    if !valid {
        return Err("the bearer token must be 1 to 255 characters of A-Z a-z 0-9 - . _ ~ + /");
    }
    Ok(token.to_owned())
}

/// One line per request at debug: method, path, status, whether it was a replay, latency.
async fn log_request(request: Request, next: Next) -> Response {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return next.run(request).await;
    }
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let replayed = response.headers().contains_key("idempotent-replayed");
    tracing::debug!(
        %method,
        path,
        status = response.status().as_u16(),
        replayed,
        micros = started.elapsed().as_micros() as u64,
        "request"
    );
    response
}

/// Parses and validates a `POST /charges` body into the charge to execute.
pub(crate) fn parse_charge(body: &[u8]) -> Result<Charge, Invalid> {
    let new: NewCharge = serde_json::from_slice(body).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => Invalid::charge(format!(
                "expected {{\"account\": string, \"amount_cents\": integer}}: {e}"
            )),
            _ => Invalid {
                status: StatusCode::BAD_REQUEST,
                code: "invalid-json",
                title: "The body is not JSON",
                detail: e.to_string(),
            },
        }
    })?;
    if new.account.trim().is_empty() || new.account.len() > 255 {
        return Err(Invalid::charge(
            "account must be 1 to 255 bytes and not blank".to_owned(),
        ));
    }
    if new.amount_cents <= 0 {
        return Err(Invalid::charge(format!(
            "amount_cents must be positive, got {}",
            new.amount_cents
        )));
    }
    Ok(Charge {
        id: format!("ch_{:024x}", rand::random::<u128>() >> 32),
        account: new.account,
        amount_cents: new.amount_cents,
        created_at: now_rfc3339(),
        processor_charge_id: None,
    })
}

fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let now = now
        .replace_nanosecond(now.nanosecond() / 1000 * 1000)
        .unwrap_or(now);
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| now.unix_timestamp().to_string())
}

/// 201 with the charge and its `Location`.
pub(crate) fn created(charge: &Charge) -> Response {
    let body = serde_json::to_vec(charge).unwrap_or_default();
    let mut response = (StatusCode::CREATED, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(location) = HeaderValue::try_from(format!("/charges/{}", charge.id)) {
        headers.insert(header::LOCATION, location);
    }
    response
}

/// A database error, answered so that the layer does not store it (the key is free and a
/// retry runs again; on a SQL store the charge written through the layer's transaction rolls
/// back): `503` with `Retry-After` when it is worth retrying soon — SQLite's write lock not
/// free within `--busy-timeout`, a deadlock, a serialization failure — else `500`.
pub(crate) fn database_error(state: &AppState, e: &sqlx::Error) -> Response {
    if state.ledger.transient(e) {
        tracing::info!(error = %e, "charging refused for now (database busy)");
        let mut response = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-busy",
            "The database is busy",
            "nothing was charged; retry after 1 s with the same Idempotency-Key",
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return response;
    }
    tracing::warn!(error = %e, "charging failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "database-error",
        "The charge could not be written",
        "nothing was charged; retry with the same Idempotency-Key",
    )
}

/// The test hook: how long to sleep inside the transaction, if asked and allowed.
pub(crate) fn test_sleep(state: &AppState, headers: &HeaderMap) -> Option<Duration> {
    test_hook(state, headers, TEST_SLEEP_HEADER)
}

/// The test hook: how long to work before writing the charge, if asked and allowed.
pub(crate) fn test_work(state: &AppState, headers: &HeaderMap) -> Option<Duration> {
    test_hook(state, headers, TEST_WORK_HEADER)
}

fn test_hook(state: &AppState, headers: &HeaderMap, name: &str) -> Option<Duration> {
    if !state.test_hooks {
        return None;
    }
    let ms: u64 = headers.get(name)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// The test hook itself, logged so a test knows when to kill the server.
pub(crate) async fn sleep_in_transaction(d: Duration) {
    tracing::info!(
        ms = d.as_millis() as u64,
        "test hook: charge written, sleeping in the transaction"
    );
    tokio::time::sleep(d).await;
}

/// `POST /charges` writing through the ledger's own transaction: with the Redis store (which
/// shares no transaction with the ledger) and in the benchmark's baseline without the layer.
pub(crate) async fn post_charge_own_tx(
    State(state): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let charge = match parse_charge(&body) {
        Ok(c) => c,
        Err(problem) => return problem.into_response(),
    };
    if let Some(d) = test_work(&state, &headers) {
        tokio::time::sleep(d).await;
    }
    let sleep = test_sleep(&state, &headers);
    let inside = async move {
        if let Some(d) = sleep {
            sleep_in_transaction(d).await;
        }
    };
    match state.ledger.insert(&principal.0, &charge, inside).await {
        Ok(()) => created(&charge),
        Err(e) => database_error(&state, &e),
    }
}

/// `POST /charges` without any database: the benchmark's HTTP floor.
pub(crate) async fn post_charge_static(body: Bytes) -> Response {
    match parse_charge(&body) {
        Ok(charge) => created(&charge),
        Err(problem) => problem.into_response(),
    }
}

/// `GET /charges/{id}`: the caller's own charge, or 404.
async fn get_charge(
    State(state): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    match state.ledger.get(&principal.0, &id).await {
        Ok(Some(charge)) => {
            let mut response = axum::Json(charge).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "No such charge",
            &format!("no charge {id} for this principal"),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "reading a charge failed");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "The ledger is unavailable",
                "retry later",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header"),
        );
        h
    }

    #[test]
    fn bearer_tokens_are_rfc6750_b64tokens() {
        assert_eq!(
            bearer_token(&auth("Bearer tok_alice")).as_deref(),
            Ok("tok_alice")
        );
        assert_eq!(
            bearer_token(&auth("bearer abc+/=")).as_deref(),
            Ok("abc+/=")
        );
        for bad in [
            "Bearer",
            "Bearer ",
            "Basic abc",
            "Bearer a b",
            "Bearer ===",
            "tok",
        ] {
            assert!(bearer_token(&auth(bad)).is_err(), "{bad:?}");
        }
        assert!(bearer_token(&HeaderMap::new()).is_err());
        assert!(bearer_token(&auth(&format!("Bearer {}", "t".repeat(256)))).is_err());
    }

    #[test]
    fn charges_are_validated() {
        let ok = parse_charge(br#"{"account":"alice","amount_cents":1250}"#).expect("valid");
        assert_eq!((ok.account.as_str(), ok.amount_cents), ("alice", 1250));
        assert!(ok.id.starts_with("ch_") && ok.id.len() == 27, "{}", ok.id);
        let status = |body: &[u8]| match parse_charge(body) {
            Ok(_) => StatusCode::OK,
            Err(invalid) => invalid.status,
        };
        assert_eq!(status(b"{not json"), StatusCode::BAD_REQUEST);
        assert_eq!(
            status(br#"{"account":"","amount_cents":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            status(br#"{"account":"a","amount_cents":0}"#),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            status(br#"{"account":"a","amount_cents":"1"}"#),
            StatusCode::UNPROCESSABLE_ENTITY
        );
    }
}
