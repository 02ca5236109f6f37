//! `--card-processor URL`: `POST /charges` charges a card processor, then writes the charge
//! row, as two recovery points of idem-http's layer ([`IdemPhases`]).
//!
//! The processor call cannot join the database's transaction, so the request runs as phases
//! in the layer's own execution, each boundary one commit of the request's record:
//!
//! 1. `Charge` (foreign): `POST URL/v1/charges` with the key [`PhaseCtx::foreign_key`] derives
//!    from the request's scope (principal, route), its `Idempotency-Key` and the phase — the
//!    same on every attempt, a retry after a crash included — sent through idem-client's
//!    middleware, which retries lost answers, `5xx` and `429` with that same key. The
//!    processor's charge ID becomes the next phase's state.
//! 2. `Record` (local): the `charges` row with the processor's ID, committed with the stored
//!    response (the layer completes the record as for any handler), so a retry gets the
//!    charge replayed with `Idempotent-Replayed: true`.
//!
//! A crash after the processor charged and before `Record`'s point committed resumes at
//! `Charge`: the call is repeated with the same key and the processor answers the charge it
//! already made. A crash after it resumes at `Record` without calling the processor again.
//! A phase that fails (the processor unreachable) answers `503 phase-failed`; the record
//! keeps its point and the retry resumes there.
//!
//! Each phase carries the whole charge (its ID, the principal, the amount), so the
//! [`Completer`] running in this process finishes a request whose client gave up — after its
//! lease ran out — from the record alone, and stores the same response the handler would
//! have; after `--completer-max-attempts` executions it gives the request up with a
//! `charge-abandoned` problem, which every retry then gets.

use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, RetryPolicy};
use idem_core::store::RecoveryStore;
use idem_core::{BoxError, DerivedKey};
use idem_http::phases::{IdemPhases, PhaseResponse, Phases, PhasesError};
use idem_request::{Completer, Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};

use crate::ServeArgs;
use crate::app::{self, AppState, Principal};
use crate::ledger::{Charge, Ledger, WriteCharge};

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

/// The phases of a charge: the variant is the recovery point, its fields the state kept —
/// all the completer needs to finish the charge without its request.
#[derive(Debug, Serialize, Deserialize)]
enum Phase {
    /// Call the processor (foreign).
    Charge {
        /// Whose charge (the digest of the bearer token).
        principal: String,
        /// The charge to make, its ID and time fixed at the first attempt.
        charge: Charge,
        /// `X-Test-Sleep-Ms` (with `--test-hooks`): sleep after the processor answered, on
        /// the first attempt only — where the crash test kills the server.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        test_sleep_ms: Option<u64>,
    },
    /// Write the row (local), with what the processor answered.
    Record {
        /// Whose charge.
        principal: String,
        /// The charge, with the processor's charge ID.
        charge: Charge,
    },
}

/// The charge's phases: the handler and the completer run the same.
struct Charging<S> {
    processor: Processor,
    _store: std::marker::PhantomData<fn() -> S>,
}

impl<S> Clone for Charging<S> {
    fn clone(&self) -> Self {
        Self {
            processor: self.processor.clone(),
            _store: std::marker::PhantomData,
        }
    }
}

impl<S> Phases<S> for Charging<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    type Phase = Phase;
    type Error = BoxError;

    async fn step(
        &self,
        phase: Phase,
        ctx: &mut PhaseCtx<S>,
    ) -> Result<Step<Phase, PhaseResponse>, BoxError> {
        Ok(match phase {
            Phase::Charge {
                principal,
                charge,
                test_sleep_ms,
            } => {
                let key = ctx.foreign_key("card-charge");
                let id = self
                    .processor
                    .charge(key, &charge.account, charge.amount_cents)
                    .await?;
                if let Some(ms) = test_sleep_ms.filter(|_| ctx.attempt() == 1) {
                    tracing::info!(
                        ms,
                        "test hook: processor charged, sleeping before the point commits"
                    );
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Step::Next(Phase::Record {
                    principal,
                    charge: Charge {
                        processor_charge_id: Some(id),
                        ..charge
                    },
                })
            }
            Phase::Record { principal, charge } => {
                ctx.tx().insert_charge(&principal, &charge).await?;
                Step::Done(created(&charge)?)
            }
        })
    }
}

/// `201 Created` with the charge, as the other modes answer it ([`app::created`]).
fn created(charge: &Charge) -> Result<PhaseResponse, BoxError> {
    let location = HeaderValue::try_from(format!("/charges/{}", charge.id))?;
    Ok(PhaseResponse::json(StatusCode::CREATED, charge)?.header(header::LOCATION, location))
}

/// What the handler needs besides [`AppState`].
struct Phased<S> {
    charging: Charging<S>,
}

/// How the in-process completer runs (`--completer-*`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CompleterArgs {
    /// Time between its passes.
    pub(crate) interval: Duration,
    /// Executions a charge gets before it is given up.
    pub(crate) max_attempts: u32,
    /// The status of the problem a given-up charge answers.
    pub(crate) abandon_status: StatusCode,
}

/// The service on a SQL store with `--card-processor`, and its completer, started here.
pub(crate) fn sql<S>(store: S, ledger: Ledger, args: &ServeArgs) -> Result<Router>
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let url = args
        .card_processor
        .as_deref()
        .context("--card-processor URL is required here")?;
    let charging = Charging {
        processor: Processor::new(url)?,
        _store: std::marker::PhantomData,
    };
    let idem = crate::layer::engine(store, args)?;
    if let Some(completer) = args.completer() {
        let completer = completer_for(idem.clone(), charging.clone(), completer)?;
        tokio::spawn(completer.run(tokio_util::sync::CancellationToken::new()));
    }
    let state = AppState {
        ledger,
        test_hooks: args.test_hooks,
        ttl: args.ttl,
    };
    let route: axum::routing::MethodRouter<AppState> =
        post(post_charge_phased::<S>).layer(crate::layer::layer(idem));
    let route = route.layer(Extension(std::sync::Arc::new(Phased { charging })));
    Ok(app::router(state, route))
}

/// The completer of charges left stuck: the layer's records are one scope per principal, so
/// it takes every stuck record of the store (only this route keeps recovery points).
fn completer_for<S>(
    idem: Idempotency<S>,
    charging: Charging<S>,
    args: CompleterArgs,
) -> Result<Completer<S>>
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let max_attempts = args.max_attempts;
    let completer = Completer::builder(idem)
        .interval(args.interval)
        .max_attempts(max_attempts)
        .any_scope_operation(
            "card charge",
            move |idem, stuck| {
                let charging = charging.clone();
                async move {
                    idem_http::phases::resume(&idem, stuck, charging)
                        .await
                        .map(drop)
                }
            },
            move |execution, recovery| async move {
                let body = serde_json::json!({
                    "type": "https://github.com/idem-rs/idem/tree/main/examples/http-payments#charge-abandoned",
                    "title": "The charge was given up",
                    "status": args.abandon_status.as_u16(),
                    "detail": format!(
                        "the charge did not complete in {} attempts and was given up; if the card processor charged the card, the charge must be refunded (ask support); use a new Idempotency-Key to charge again",
                        recovery.attempts.saturating_sub(1)
                    ),
                    "code": "charge-abandoned",
                });
                let response = PhaseResponse::new(args.abandon_status, body.to_string()).header(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/problem+json"),
                );
                tracing::warn!(attempts = recovery.attempts, "a stuck charge was given up");
                idem_http::phases::give_up(execution, &response).await
            },
        )
        .build()?;
    Ok(completer)
}

/// `POST /charges` with `--card-processor`, behind the layer: the processor call, then the
/// row, as recovery points. A body that does not validate is answered before any phase runs,
/// so the layer does not store it and the corrected retry runs.
async fn post_charge_phased<S>(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Extension(phased): Extension<std::sync::Arc<Phased<S>>>,
    phases: IdemPhases<S>,
    headers: HeaderMap,
    body: Bytes,
) -> Response
where
    S: RecoveryStore + Clone + Send + Sync + 'static,
    S::Tx: WriteCharge + Send + 'static,
{
    let charge = match app::parse_charge(&body) {
        Ok(c) => c,
        Err(problem) => return problem.into_response(),
    };
    let first = Phase::Charge {
        principal: principal.0,
        charge,
        test_sleep_ms: app::test_sleep(&state, &headers).map(|d| d.as_millis() as u64),
    };
    match phases.run(first, phased.charging.clone()).await {
        Ok(response) => response.into_response(),
        Err(e) => phases_error(e),
    }
}

/// A failed phase, a lost lease or a store failure: the layer's problem response (`503
/// phase-failed`, `409 lease-lost`, `503 store-unavailable`), logged. The record keeps its
/// last recovery point: the retry with the same key resumes there.
fn phases_error(e: PhasesError) -> Response {
    tracing::warn!(error = %e.error(), "charging through the card processor stopped; the retry resumes at the last recovery point");
    e.into_response()
}
