//! The user's handler as the runner runs it: the decorator that carries what the runner adds
//! around every call — panics caught, handler time measured, crash points reached — so the
//! processor's own paths (`process`, `process_batch`, `process_batch_set`) are the ones that run in production.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use futures_util::FutureExt;
use idem_core::{BoxError, Error, Handler, Message, SetHandler};

use crate::crash::{self, CrashPoint};
use crate::metrics::Instruments;

/// One transaction's view of the user's handler. Made per transaction (per message, or per
/// batch), so it can tell the first call from the later ones of a batch.
pub(crate) struct Instrumented<'a, H> {
    inner: &'a H,
    instruments: &'a Instruments,
    /// Calls so far in this transaction: the in-batch crash point lies between two.
    calls: AtomicUsize,
    /// When the last call returned: a commit's time is measured from there.
    last_done: Mutex<Option<Instant>>,
}

impl<'a, H> Instrumented<'a, H> {
    pub(crate) fn new(inner: &'a H, instruments: &'a Instruments) -> Self {
        Self {
            inner,
            instruments,
            calls: AtomicUsize::new(0),
            last_done: Mutex::new(None),
        }
    }

    /// When the last handler call of this transaction returned, if one ran.
    pub(crate) fn last_done(&self) -> Option<Instant> {
        *self.last_done.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<H> Instrumented<'_, H> {
    /// Runs one handler call: panics caught, time measured, the after-handler crash point.
    async fn call<T>(
        &self,
        call: impl Future<Output = Result<T, BoxError>>,
    ) -> Result<T, BoxError> {
        if self.calls.fetch_add(1, Ordering::Relaxed) > 0 {
            crash::reached(CrashPoint::InBatch);
        }
        let started = Instant::now();
        // A panic becomes a retryable error: the transaction then rolls back and the delivery
        // is settled like any failure (retried, then dead-lettered), instead of being dropped
        // unsettled where it would hold a prefetch slot until a reconnect.
        let r = match AssertUnwindSafe(call).catch_unwind().await {
            Ok(r) => r,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".to_owned());
                Err(Error::retry(format!("handler panicked: {what}")).into())
            }
        };
        self.instruments.handler_time(started.elapsed());
        *self.last_done.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        if r.is_ok() {
            // Its effects are written and not yet committed.
            crash::reached(CrashPoint::AfterHandler);
        }
        r
    }
}

impl<Tx, P, H> Handler<Tx, P> for Instrumented<'_, H>
where
    Tx: Send,
    P: Sync,
    H: Handler<Tx, P>,
{
    type Output = H::Output;

    async fn handle(&self, tx: &mut Tx, msg: &Message<P>) -> Result<H::Output, BoxError> {
        self.call(self.inner.handle(tx, msg)).await
    }
}

impl<Tx, P, H> SetHandler<Tx, P> for Instrumented<'_, H>
where
    Tx: Send,
    P: Sync,
    H: SetHandler<Tx, P>,
{
    type Output = H::Output;

    async fn handle_set(&self, tx: &mut Tx, msgs: &[&Message<P>]) -> Result<H::Output, BoxError> {
        self.call(self.inner.handle_set(tx, msgs)).await
    }
}
