//! `--emit NAME --broker URL`: a `PaymentCharged` event per charge, written into the outbox in
//! the request's transaction — so the charge row, the stored response and the event commit
//! together or not at all — and the relay in this process that publishes it to `NAME`.
//!
//! The event's message ID comes from [`IdemRequest::emitter`]: derived from the request's
//! scoped key, so a retry or a takeover that runs the handler again enqueues the same ID (and
//! the enqueue keeps the first row of an ID), and a consumer downstream deduplicates on it.

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use idem_any::BrokerUrl;
use idem_core::outbox::OutboxStore;
use idem_http::IdemRequest;
use idem_relay::{BrokerPublisher, CancellationToken, Relay, RelayWaker};
use idem_sql::AnyStore;
use tokio::task::JoinHandle;

use crate::ServeArgs;
use crate::app::problem;
use crate::ledger::Charge;

/// The outbox `--emit` writes to: the request store's own (its transaction is the handler's).
#[derive(Debug, Clone)]
pub(crate) struct Emit<S> {
    pub(crate) store: S,
    pub(crate) destination: String,
}

/// The event: the charge's ID is the payment's, so a consumer can tie the event to the charge
/// the client was answered with (`GET /charges/{id}`).
pub(crate) fn payment_charged(charge: &Charge) -> Vec<u8> {
    serde_json::json!({
        "payment_id": charge.id,
        "account": charge.account,
        "amount_cents": charge.amount_cents,
    })
    .to_string()
    .into_bytes()
}

impl<S: OutboxStore> Emit<S> {
    /// Enqueues `charge`'s `PaymentCharged` in `tx`, the request's transaction.
    pub(crate) async fn charged(
        &self,
        tx: &mut S::Tx,
        request: &IdemRequest,
        charge: &Charge,
    ) -> Result<(), idem_core::Error> {
        // A new emitter per handler run: a re-run derives the same ID for the same position.
        let event = request
            .emitter()
            .message(self.destination.as_str(), payment_charged(charge))?
            .header("type", "PaymentCharged")?;
        self.store.enqueue(tx, &[event]).await
    }
}

/// The enqueue failed: answered `5xx`, which the layer does not store, so the charge written
/// in the same transaction rolls back and the key is free for the retry.
pub(crate) fn outbox_error(e: &idem_core::Error) -> Response {
    if e.kind() == idem_core::ErrorKind::Transient {
        tracing::info!(error = %e, "enqueueing the event refused for now (database busy)");
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
    tracing::warn!(error = %e, kind = ?e.kind(), "enqueueing the PaymentCharged event failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "outbox-error",
        "The charge's event could not be written",
        "nothing was charged; retry with the same Idempotency-Key",
    )
}

/// Refuses `--emit` where it cannot keep its promise, before anything connects; the broker
/// URL parsed.
pub(crate) fn check(args: &ServeArgs, scheme: &str) -> Result<Option<BrokerUrl>> {
    let (Some(_), Some(broker)) = (&args.emit, &args.broker) else {
        return Ok(None);
    };
    if scheme == "redis" || scheme == "rediss" {
        anyhow::bail!(
            "--emit needs a SQL --database (sqlite:, postgres://, mysql://): with redis://… the charges commit in the --ledger's transaction, not the request's, so an event could not commit with the charge and the stored response"
        );
    }
    if args.mode != crate::Mode::Idempotent {
        anyhow::bail!("--emit needs the idempotency layer's transaction (--mode idempotent)");
    }
    Ok(Some(BrokerUrl::parse(broker)?))
}

/// The relay, built over the store's outbox, not yet running.
pub(crate) struct Relaying {
    relay: Relay<AnyStore, BrokerPublisher>,
    destination: String,
    broker: String,
}

impl Relaying {
    /// The relay named `--relay-name` over `store`, publishing to `broker`.
    pub(crate) fn new(store: AnyStore, broker: BrokerUrl, args: &ServeArgs) -> Result<Self> {
        let shown = broker.redacted();
        let publisher = BrokerPublisher::new(broker, args.relay_name.as_str());
        let relay = Relay::builder(args.relay_name.as_str())
            .build(store, publisher)
            .context("--relay-name")?;
        Ok(Self {
            relay,
            destination: args.emit.clone().unwrap_or_default(),
            broker: shown,
        })
    }

    /// What the router wakes after each request's commit.
    pub(crate) fn waker(&self) -> RelayWaker {
        self.relay.waker()
    }

    /// Starts relaying. A broker that is down is waited out by the relay, with backoff: the
    /// events wait in the outbox meanwhile, and charging goes on.
    pub(crate) fn spawn(self) -> Running {
        tracing::info!(destination = %self.destination, broker = %self.broker, "relaying PaymentCharged events");
        let stop = CancellationToken::new();
        let task = tokio::spawn(self.relay.run(stop.clone()));
        Running { stop, task }
    }
}

/// The relay task.
pub(crate) struct Running {
    stop: CancellationToken,
    task: JoinHandle<Result<idem_relay::RelayStats, idem_core::Error>>,
}

impl Running {
    /// Stops it once the server has finished its requests: the publishes in flight finish and
    /// are marked sent; anything left waits in the outbox for the next start (or another
    /// replica's relay).
    pub(crate) async fn stop(self) {
        self.stop.cancel();
        match self.task.await {
            Ok(Ok(_)) => {} // the relay logs its own stop, with its count
            Ok(Err(e)) => tracing::error!(error = %e, "the relay stopped on an error"),
            Err(e) => tracing::error!(error = %e, "the relay task failed"),
        }
    }
}

/// Wakes the relay once the layer has answered: by then the request's transaction has
/// committed (the layer stores the response, and commits, before it returns it), so the
/// relay finds the event at once instead of at its next poll.
pub(crate) async fn wake_after(
    State(waker): State<RelayWaker>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    waker.wake();
    response
}
