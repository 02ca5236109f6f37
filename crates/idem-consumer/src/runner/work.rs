//! What one transaction of the runner does, per mode: the user's handler, wrapped in the
//! runner's decorator, on the processor's own paths. The settling code above it is the same
//! for every mode.

use std::future::Future;

use idem_core::{
    BatchClaimStore, ClaimStore, Clock, Error, Handler, Message, Outcome, Processor, SetHandler,
};

use crate::crash::{self, CrashPoint};
use crate::metrics::Instruments;

use super::instrumented::Instrumented;

/// One mode's transactions. `one` processes a message alone (per-message mode, and every
/// retry); `many` processes a fetched batch in one transaction.
pub(crate) trait Work<S: ClaimStore, C, P>: Send + Sync + 'static {
    /// One message in its own transaction.
    fn one(
        &self,
        processor: &Processor<S, C>,
        msg: &Message<P>,
        instruments: &Instruments,
    ) -> impl Future<Output = Result<Outcome<()>, Error>> + Send;

    /// Many messages in one transaction: one result per message, in order, or the batch's own
    /// error when nothing committed. By default (per-message mode, which never fetches a
    /// batch) each message in a transaction of its own.
    fn many(
        &self,
        processor: &Processor<S, C>,
        msgs: &[Message<P>],
        instruments: &Instruments,
    ) -> impl Future<Output = Result<Vec<Result<Outcome<()>, Error>>, Error>> + Send
    where
        S: Sync,
        C: Sync,
        Message<P>: Sync,
    {
        async move {
            let mut results = Vec::with_capacity(msgs.len());
            for msg in msgs {
                results.push(self.one(processor, msg, instruments).await);
            }
            Ok(results)
        }
    }
}

/// Per-message mode: a [`Handler`], one message per transaction.
pub(crate) struct OneByOne<H>(pub(crate) H);

/// Batch mode: a [`Handler`] per message, one claim statement and one commit per batch
/// ([`Processor::process_batch`]).
pub(crate) struct Batched<H>(pub(crate) H);

/// Set-batch mode: a [`SetHandler`] for the batch's new messages at once
/// ([`Processor::process_batch_set_with`]); a message on its own is a batch of one.
pub(crate) struct SetBatched<H>(pub(crate) H);

/// One message through [`Processor::process_with`], instrumented.
async fn alone<S, C, P, H>(
    processor: &Processor<S, C>,
    msg: &Message<P>,
    handler: &H,
    instruments: &Instruments,
) -> Result<Outcome<()>, Error>
where
    S: ClaimStore,
    C: Clock,
    P: Sync,
    H: Handler<S::Tx, P>,
{
    let handler = Instrumented::new(handler, instruments);
    crash::reached(CrashPoint::BeforeClaim);
    let outcome = processor.process_with(msg, &handler).await?;
    if let (Outcome::Processed(_), Some(t)) = (&outcome, handler.last_done()) {
        instruments.commit_time(t.elapsed());
    }
    Ok(outcome.map(drop))
}

impl<S, C, P, H> Work<S, C, P> for OneByOne<H>
where
    S: ClaimStore + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    P: Send + Sync,
    H: Handler<S::Tx, P> + 'static,
{
    async fn one(
        &self,
        processor: &Processor<S, C>,
        msg: &Message<P>,
        instruments: &Instruments,
    ) -> Result<Outcome<()>, Error> {
        alone(processor, msg, &self.0, instruments).await
    }
}

impl<S, C, P, H> Work<S, C, P> for Batched<H>
where
    S: BatchClaimStore + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    P: Send + Sync,
    H: Handler<S::Tx, P> + 'static,
{
    async fn one(
        &self,
        processor: &Processor<S, C>,
        msg: &Message<P>,
        instruments: &Instruments,
    ) -> Result<Outcome<()>, Error> {
        alone(processor, msg, &self.0, instruments).await
    }

    async fn many(
        &self,
        processor: &Processor<S, C>,
        msgs: &[Message<P>],
        instruments: &Instruments,
    ) -> Result<Vec<Result<Outcome<()>, Error>>, Error> {
        let handler = Instrumented::new(&self.0, instruments);
        crash::reached(CrashPoint::BeforeClaim);
        let results = processor.process_batch(msgs, &handler).await?;
        if let Some(t) = handler.last_done() {
            instruments.commit_time(t.elapsed());
        }
        Ok(results
            .into_iter()
            .map(|r| r.map(|o| o.map(drop)))
            .collect())
    }
}

impl<S, C, P, H> Work<S, C, P> for SetBatched<H>
where
    S: BatchClaimStore + 'static,
    S::Tx: Send,
    C: Clock + Send + Sync + 'static,
    P: Send + Sync,
    H: SetHandler<S::Tx, P> + 'static,
{
    async fn one(
        &self,
        processor: &Processor<S, C>,
        msg: &Message<P>,
        instruments: &Instruments,
    ) -> Result<Outcome<()>, Error> {
        let mut results = self
            .many(processor, std::slice::from_ref(msg), instruments)
            .await?;
        results.pop().unwrap_or_else(|| {
            Err(Error::new(
                idem_core::ErrorKind::Store,
                "a batch of one reported no result",
            ))
        })
    }

    async fn many(
        &self,
        processor: &Processor<S, C>,
        msgs: &[Message<P>],
        instruments: &Instruments,
    ) -> Result<Vec<Result<Outcome<()>, Error>>, Error> {
        let handler = Instrumented::new(&self.0, instruments);
        crash::reached(CrashPoint::BeforeClaim);
        let batch = processor.process_batch_set_with(msgs, &handler).await?;
        if let Some(t) = handler.last_done() {
            instruments.commit_time(t.elapsed());
        }
        Ok(batch.outcomes)
    }
}

/// Phased mode: each message an operation of recovery points over the request records
/// ([`crate::phased`]); the processor's claims are not used.
#[cfg(feature = "phases")]
pub(crate) struct Phases<R: idem_core::store::RecoveryStore + Clone + 'static, H>(
    pub(crate) crate::phased::Phased<R, H>,
);

#[cfg(feature = "phases")]
impl<S, C, P, R, H> Work<S, C, P> for Phases<R, H>
where
    S: ClaimStore + 'static,
    C: Clock + Send + Sync + 'static,
    P: Send + Sync,
    R: idem_core::store::RecoveryStore + Clone + Send + Sync + 'static,
    R::Tx: Send,
    H: crate::phased::PhasedHandler<R, P>,
{
    async fn one(
        &self,
        _processor: &Processor<S, C>,
        msg: &Message<P>,
        instruments: &Instruments,
    ) -> Result<Outcome<()>, Error> {
        use crate::phased::PhasedOutcome;
        crash::reached(CrashPoint::BeforeClaim);
        let started = std::time::Instant::now();
        let outcome = self.0.process(msg).await?;
        Ok(match outcome {
            PhasedOutcome::Done(_) => {
                instruments.handler_time(started.elapsed());
                Outcome::Processed(())
            }
            PhasedOutcome::Abandoned(_) => {
                instruments.handler_time(started.elapsed());
                instruments.operation_abandoned();
                tracing::debug!(
                    outcome = "abandoned",
                    "the operation gave up (Step::Abandon); its record is stored abandoned"
                );
                Outcome::Processed(())
            }
            PhasedOutcome::Duplicate => Outcome::Duplicate,
        })
    }
}
