//! `--card-processor URL`: each `PaymentRequested` charges a card processor, then writes the
//! charge row, as two recovery points of a phased consumer handler
//! ([`idem_consumer::phased`]).
//!
//! The processor call cannot join the database's transaction, so the message runs as phases,
//! its idempotency the request record keyed by its message ID:
//!
//! 1. `Charge` (foreign): `POST URL/v1/charges` (`account`, `amount_cents`) with
//!    `Idempotency-Key:` the key [`PhaseCtx::foreign_key`] derives from the consumer's scope,
//!    the message ID and the phase — the same on every attempt, a redelivery after a crash
//!    and the completer included — through idem-client's middleware, which retries lost
//!    answers, `5xx` and `429` with that same key. The processor's charge ID is the next
//!    phase's state.
//! 2. `Record` (local): the `charges` row with the processor's ID and the balance, committed
//!    with the record's response.
//!
//! A crash after the processor charged and before `Record`'s point committed resumes at
//! `Charge` (the redelivery, once the dead process's lease ran out, or the completer): the call
//! repeats with the same key and the processor answers the charge it made. A crash after it
//! resumes at `Record` without calling the processor again.

use std::future::Future;
use std::time::Duration;

use anyhow::{Context, Result};
use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, RetryPolicy};
use idem_consumer::phased::PhasedHandler;
use idem_core::store::RecoveryStore;
use idem_core::{BoxError, DerivedKey, Message, Recovery};
use idem_request::{PhaseCtx, Step};
use idem_sql::{PostgresTx, Tx};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Sqlite};

use crate::ledger::PaymentRequested;

/// How long one attempt of the processor call may take before it is retried.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The card processor's charges endpoint and the client that calls it.
#[derive(Clone)]
pub(crate) struct CardProcessor {
    client: reqwest_middleware::ClientWithMiddleware,
    charges_url: String,
}

/// The URL may hold credentials: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for CardProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CardProcessor")
            .field("charges_url", &idem_redact::redact_url(&self.charges_url))
            .finish_non_exhaustive()
    }
}

/// The processor's answer, as far as this service reads it.
#[derive(Debug, Deserialize)]
struct ProcessorCharge {
    id: String,
}

impl CardProcessor {
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

    /// Charges `amount_cents` to `account` under `key`; the processor's charge ID. Every
    /// failure is a phase failure: retried by the runner, resumed at `Charge` with the same
    /// key.
    async fn charge(
        &self,
        key: DerivedKey,
        account: &str,
        amount_cents: i64,
    ) -> Result<String, BoxError> {
        let body = serde_json::json!({ "account": account, "amount_cents": amount_cents });
        let response = self
            .client
            .post(&self.charges_url)
            .derived_key(key)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| format!("the card processor did not answer: {e}"))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("the card processor answered {status}").into());
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("the card processor's answer was cut: {e}"))?;
        let charge: ProcessorCharge = serde_json::from_slice(&bytes)
            .map_err(|e| format!("the card processor's answer is not a charge: {e}"))?;
        Ok(charge.id)
    }
}

/// The phases of a card charge: the variant is the recovery point, its fields what the phase
/// needs (the completer resumes without the message).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Phase {
    /// Call the processor (foreign).
    Charge {
        message_id: String,
        account: String,
        amount_cents: i64,
    },
    /// Write the row and the balance (local), with what the processor answered.
    Record {
        message_id: String,
        account: String,
        amount_cents: i64,
        processor_charge_id: String,
    },
}

/// What a card charge ends with, stored with its record.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CardCharged {
    /// The processor's charge ID; `None` when the completer gave the charge up.
    pub(crate) processor_charge_id: Option<String>,
}

/// The `charges` row and balance of a charge the processor made, in the phase's transaction.
pub(crate) trait RecordCharge: Send {
    fn record_charge<'a>(
        &'a mut self,
        message_id: &'a str,
        account: &'a str,
        amount_cents: i64,
        processor_charge_id: &'a str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send + 'a;
}

impl RecordCharge for Tx<Sqlite> {
    async fn record_charge(
        &mut self,
        message_id: &str,
        account: &str,
        amount_cents: i64,
        processor_charge_id: &str,
    ) -> Result<(), BoxError> {
        sqlx::query(
            "INSERT INTO charges (message_id, account, amount_cents, processor_charge_id) VALUES (?, ?, ?, ?)",
        )
        .bind(message_id)
        .bind(account)
        .bind(amount_cents)
        .bind(processor_charge_id)
        .execute(&mut **self)
        .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES (?, ?)
             ON CONFLICT (account) DO UPDATE SET balance_cents = balance_cents + excluded.balance_cents",
        )
        .bind(account)
        .bind(amount_cents)
        .execute(&mut **self)
        .await?;
        Ok(())
    }
}

impl RecordCharge for PostgresTx {
    async fn record_charge(
        &mut self,
        message_id: &str,
        account: &str,
        amount_cents: i64,
        processor_charge_id: &str,
    ) -> Result<(), BoxError> {
        sqlx::query(
            "INSERT INTO charges (message_id, account, amount_cents, processor_charge_id) VALUES ($1, $2, $3, $4)",
        )
        .bind(message_id)
        .bind(account)
        .bind(amount_cents)
        .bind(processor_charge_id)
        .execute(&mut **self)
        .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)
             ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
        )
        .bind(account)
        .bind(amount_cents)
        .execute(&mut **self)
        .await?;
        Ok(())
    }
}

impl RecordCharge for Tx<MySql> {
    async fn record_charge(
        &mut self,
        message_id: &str,
        account: &str,
        amount_cents: i64,
        processor_charge_id: &str,
    ) -> Result<(), BoxError> {
        // Bytes for the VARBINARY columns, as the plain handler writes them.
        sqlx::query(
            "INSERT INTO charges (message_id, account, amount_cents, processor_charge_id) VALUES (?, ?, ?, ?)",
        )
        .bind(message_id.as_bytes())
        .bind(account.as_bytes())
        .bind(amount_cents)
        .bind(processor_charge_id.as_bytes())
        .execute(&mut **self)
        .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)",
        )
        .bind(account.as_bytes())
        .bind(amount_cents)
        .execute(&mut **self)
        .await?;
        Ok(())
    }
}

/// The phased handler of `--card-processor`.
#[derive(Debug, Clone)]
pub(crate) struct CardCharge {
    pub(crate) processor: CardProcessor,
    /// `--test-pause-after-charge`: on a record's first execution, wait this long after the
    /// processor answered, before `Record`'s point commits (where the crash test kills the
    /// process).
    pub(crate) pause_after_charge: Option<Duration>,
}

impl<S> PhasedHandler<S, PaymentRequested> for CardCharge
where
    S: RecoveryStore,
    S::Tx: RecordCharge,
{
    type Phase = Phase;
    type Output = CardCharged;

    fn first(&self, msg: &Message<PaymentRequested>) -> Result<Phase, BoxError> {
        let p = msg.payload();
        p.validate()?;
        Ok(Phase::Charge {
            message_id: idem_core::Identified::message_id(msg).to_string(),
            account: p.account.clone(),
            amount_cents: p.amount_cents,
        })
    }

    async fn step(
        &self,
        phase: Phase,
        ctx: &mut PhaseCtx<S>,
    ) -> Result<Step<Phase, CardCharged>, BoxError> {
        Ok(match phase {
            Phase::Charge {
                message_id,
                account,
                amount_cents,
            } => {
                let key = ctx.foreign_key("card-charge");
                let processor_charge_id =
                    self.processor.charge(key, &account, amount_cents).await?;
                if let Some(pause) = self.pause_after_charge.filter(|_| ctx.attempt() == 1) {
                    tracing::info!(
                        ms = pause.as_millis() as u64,
                        "test hook: the processor charged; pausing before the point commits"
                    );
                    tokio::time::sleep(pause).await;
                }
                Step::Next(Phase::Record {
                    message_id,
                    account,
                    amount_cents,
                    processor_charge_id,
                })
            }
            Phase::Record {
                message_id,
                account,
                amount_cents,
                processor_charge_id,
            } => {
                ctx.tx()
                    .record_charge(&message_id, &account, amount_cents, &processor_charge_id)
                    .await?;
                Step::Done(CardCharged {
                    processor_charge_id: Some(processor_charge_id),
                })
            }
        })
    }

    fn abandoned(&self, recovery: &Recovery) -> CardCharged {
        // The processor may have charged (the record stopped at `Charge` or `Record`): an
        // operator reconciles it with the processor by the derived key.
        tracing::warn!(
            point = recovery.resume.as_ref().map(|r| r.point.as_str()),
            attempts = recovery.attempts,
            "a card charge was given up after its last attempt; reconcile it with the processor"
        );
        CardCharged {
            processor_charge_id: None,
        }
    }
}
