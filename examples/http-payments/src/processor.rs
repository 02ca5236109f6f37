//! `--card-processor URL`: `POST /charges` charges a card processor, then writes the charge
//! row, as two recovery points of [`Idempotency::run_phases`].
//!
//! The processor call cannot join the database's transaction, so the request runs as phases,
//! each boundary one commit of the request's record:
//!
//! 1. `Charge` (foreign): `POST URL/v1/charges` with the key [`PhaseCtx::foreign_key`] derives
//!    from the request's scope, its `Idempotency-Key` and the phase — the same on every
//!    attempt, a retry after a crash included — sent through idem-client's middleware, which
//!    retries lost answers, `5xx` and `429` with that same key. The processor's charge ID
//!    becomes the next phase's state.
//! 2. `Record` (local): the `charges` row with the processor's ID, committed with the stored
//!    response.
//!
//! A crash after the processor charged and before `Record`'s point committed resumes at
//! `Charge`: the call is repeated with the same key and the processor answers the charge it
//! already made. A crash after it resumes at `Record` without calling the processor again.
//!
//! This route does not run behind idem-http's layer: the layer hands a handler one
//! transaction and has no recovery points yet, so the handler reads `Idempotency-Key` itself
//! (idem-http's parser) and calls the function-level [`Idempotency::run_phases`] with a scope
//! of its own (principal and route). Replays answer the stored charge without the
//! `Idempotent-Replayed` header.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, RetryPolicy};
use idem_core::store::RecoveryStore;
use idem_core::{BoxError, DerivedKey, ErrorKind, RequestErrorKind, RequestScope};
use idem_request::{Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};

use crate::ServeArgs;
use crate::app::{self, AppState, Principal, problem};
use crate::ledger::{Charge, Ledger, WriteCharge};

/// The `Idempotency-Key` request header.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, as idem-http's layer.
const MAX_KEY_LEN: usize = 255;

/// How long one attempt of the processor call may take before it is retried.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The card processor's charges endpoint and the client that calls it.
#[derive(Clone)]
pub(crate) struct Processor {
    client: reqwest_middleware::ClientWithMiddleware,
    charges_url: String,
}

/// The URL may hold credentials: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("charges_url", &idem_redact::redact_url(&self.charges_url))
            .finish_non_exhaustive()
    }
}

/// Why the processor call failed: the phase fails, its record keeps the `Charge` point, and
/// the client's retry with the same `Idempotency-Key` calls again with the same derived key.
#[derive(Debug)]
pub(crate) enum ProcessorError {
    /// No answer after the middleware's retries (connection refused, timeouts, lost answers).
    Unreachable(reqwest_middleware::Error),
    /// The processor answered a status that is not a charge.
    Refused(StatusCode),
    /// The processor's `2xx` answer is not a charge.
    BadAnswer(String),
}

impl std::fmt::Display for ProcessorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(e) => write!(f, "the card processor did not answer: {e}"),
            Self::Refused(status) => write!(f, "the card processor answered {status}"),
            Self::BadAnswer(e) => write!(f, "the card processor's answer is not a charge: {e}"),
        }
    }
}

impl std::error::Error for ProcessorError {}

/// The processor's answer, as far as this service reads it.
#[derive(Debug, Deserialize)]
struct ProcessorCharge {
    id: String,
}

impl Processor {
    /// A client for the processor at `url` (its base: `/v1/charges` is appended).
    pub(crate) fn new(url: &str) -> Result<Self> {
        let parsed = url::Url::parse(url)
            .with_context(|| format!("--card-processor {}", idem_redact::redact_url(url)))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            anyhow::bail!("--card-processor must be an http:// or https:// URL");
        }
        let http = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            .build()
            .context("building the card processor's client")?;
        let client = reqwest_middleware::ClientBuilder::new(http)
            .with(IdempotencyMiddleware::new(RetryPolicy::default()))
            .build();
        Ok(Self {
            client,
            charges_url: format!("{}/v1/charges", url.trim_end_matches('/')),
        })
    }

    /// Charges `amount_cents` to `account` under `key`; the processor's charge ID.
    async fn charge(
        &self,
        key: DerivedKey,
        account: &str,
        amount_cents: i64,
    ) -> Result<String, ProcessorError> {
        let body = serde_json::json!({ "account": account, "amount_cents": amount_cents });
        let response = self
            .client
            .post(&self.charges_url)
            .derived_key(key)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(ProcessorError::Unreachable)?;
        let status = response.status();
        if !status.is_success() {
            return Err(ProcessorError::Refused(status));
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ProcessorError::Unreachable(e.into()))?;
        let charge: ProcessorCharge =
            serde_json::from_slice(&bytes).map_err(|e| ProcessorError::BadAnswer(e.to_string()))?;
        Ok(charge.id)
    }
}

/// The phases of a charge: the variant is the recovery point, its fields the state kept.
#[derive(Debug, Serialize, Deserialize)]
enum Phase {
    /// Call the processor (foreign).
    Charge,
    /// Write the row (local), with what the processor answered.
    Record {
        /// The processor's charge ID.
        processor_charge_id: String,
    },
}

/// One phase's run, boxed so that the handler's future is provably `Send` (an `async`
/// closure borrowing its captures is not, to axum's `Handler` bound).
type StepFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Step<Phase, Charge>, BoxError>> + Send + 'a>>;

/// Pins the step closure's signature: the future borrows the phase's context.
fn stepper<S, F>(f: F) -> F
where
    S: RecoveryStore,
    F: for<'a> FnMut(Phase, &'a mut PhaseCtx<S>) -> StepFuture<'a>,
{
    f
}

/// What the handler needs besides [`AppState`].
struct Phased<S> {
    idem: Idempotency<S>,
    processor: Processor,
}

/// The service on a SQL store with `--card-processor`.
pub(crate) fn sql<S>(store: S, ledger: Ledger, args: &ServeArgs) -> Result<Router>
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let url = args
        .card_processor
        .as_deref()
        .context("--card-processor URL is required here")?;
    let phased = Arc::new(Phased {
        idem: crate::layer::engine(store, args)?,
        processor: Processor::new(url)?,
    });
    let state = AppState {
        ledger,
        test_hooks: args.test_hooks,
        ttl: args.ttl,
    };
    let route = post(post_charge_phased::<S>).layer(Extension(phased));
    Ok(app::router(state, route))
}

/// `POST /charges` with `--card-processor`: the processor call, then the row, as recovery
/// points. `X-Test-Sleep-Ms` (with `--test-hooks`) sleeps after the processor answered and
/// before the `Record` point commits — where the crash test kills the server.
async fn post_charge_phased<S>(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Extension(phased): Extension<Arc<Phased<S>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let key = match idem_http::parse_key_header(&headers, &IDEMPOTENCY_KEY, MAX_KEY_LEN) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency-Key is required",
                "send an Idempotency-Key header with POST /charges",
            );
        }
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "idempotency-key-invalid",
                "The Idempotency-Key header is not valid",
                &e.to_string(),
            );
        }
    };
    let charge = match app::parse_charge(&body) {
        Ok(c) => c,
        Err(problem) => return problem.into_response(),
    };
    let scope = RequestScope::new(["http-payments/charges", principal.0.as_str()]);
    let input = (charge.account.clone(), charge.amount_cents);
    let sleep = app::test_sleep(&state, &headers);
    let processor = phased.processor.clone();
    let step = stepper::<S, _>(move |phase, ctx| {
        let (processor, charge, principal) = (processor.clone(), charge.clone(), principal.clone());
        Box::pin(async move {
            Ok(match phase {
                Phase::Charge => {
                    let key = ctx.foreign_key("card-charge");
                    let id = processor
                        .charge(key, &charge.account, charge.amount_cents)
                        .await?;
                    if let Some(d) = sleep {
                        tracing::info!(
                            ms = d.as_millis() as u64,
                            "test hook: processor charged, sleeping before the point commits"
                        );
                        tokio::time::sleep(d).await;
                    }
                    Step::Next(Phase::Record {
                        processor_charge_id: id,
                    })
                }
                Phase::Record {
                    processor_charge_id,
                } => {
                    let row = Charge {
                        processor_charge_id: Some(processor_charge_id),
                        ..charge
                    };
                    ctx.tx().insert_charge(&principal.0, &row).await?;
                    Step::Done(row)
                }
            })
        })
    });
    let result = phased
        .idem
        .run_phases(scope, &key, &input, Phase::Charge, step)
        .await;
    match result {
        Ok(row) => app::created(&row),
        Err(e) => phases_error(&e),
    }
}

/// A `run_phases` failure as a problem response. A failed phase keeps the record's last
/// recovery point: the retry with the same key resumes there.
fn phases_error(e: &idem_core::Error) -> Response {
    let retry_soon = |mut response: Response| {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    };
    match e.kind() {
        ErrorKind::Request(RequestErrorKind::InProgress) => retry_soon(problem(
            StatusCode::CONFLICT,
            "request-in-progress",
            "A request with this Idempotency-Key is in progress",
            "retry after 1 s with the same Idempotency-Key",
        )),
        ErrorKind::Request(RequestErrorKind::KeyReused) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "This Idempotency-Key was used with another charge",
            "use a new Idempotency-Key for a new charge",
        ),
        ErrorKind::Handler => {
            tracing::warn!(error = %e, "charging through the card processor failed");
            retry_soon(problem(
                StatusCode::BAD_GATEWAY,
                "card-processor-failed",
                "The card processor did not confirm the charge",
                "retry with the same Idempotency-Key: the charge resumes where it stopped and is made at most once",
            ))
        }
        ErrorKind::Transient | ErrorKind::Unavailable | ErrorKind::ConnectionLost => {
            tracing::info!(error = %e, "charging refused for now");
            retry_soon(problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "database-busy",
                "The database is busy",
                "retry after 1 s with the same Idempotency-Key",
            ))
        }
        _ => {
            tracing::warn!(error = %e, "charging failed");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "charge-failed",
                "The charge could not be completed",
                "retry with the same Idempotency-Key",
            )
        }
    }
}
