//! Who holds the execution while the handler runs: the layer, or the handler's phases
//! ([`IdemPhases`](crate::IdemPhases)), which borrow it to commit recovery points and hand it
//! back ended (its last phase's writes uncommitted, for the layer to commit with the stored
//! response) or gone (a phase failed: the driver ended it, the record keeps its last point).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::Error;
use idem_core::store::RequestStore;
use idem_request::{Execution, Idempotency};

use crate::layer::Config;

/// Stores the response as **abandoned** with the last phase's writes: made by the phases
/// (which know the store keeps recovery points), called by the layer (which does not).
pub(crate) type Ender<S> = Box<
    dyn FnOnce(Execution<S>, Vec<u8>) -> Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>
        + Send,
>;

/// Where the execution is.
pub(crate) enum RunState<S: RequestStore + Clone + 'static> {
    /// With the layer; the handler has not run phases in it.
    Held(Execution<S>),
    /// The handler's phases hold it.
    Lent,
    /// The phases ended the operation: store the handler's response with the last phase's
    /// writes whatever its status — completed, or abandoned through the ender.
    Ended(Execution<S>, Option<Ender<S>>),
    /// The phases' driver ended the execution itself (a phase failed, the lease was lost, the
    /// store failed): nothing is stored; a record with a recovery point keeps it.
    Gone,
}

/// The execution while the handler runs; in the request's extensions (cloned, one state).
pub(crate) struct RunSlot<S: RequestStore + Clone + 'static> {
    state: Arc<Mutex<RunState<S>>>,
    idem: Idempotency<S>,
    config: Arc<Config>,
}

impl<S: RequestStore + Clone + 'static> Clone for RunSlot<S> {
    fn clone(&self) -> Self {
        Self {
            state: Arc::clone(&self.state),
            idem: self.idem.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: RequestStore + Clone + 'static> RunSlot<S> {
    pub(crate) fn new(execution: Execution<S>, idem: Idempotency<S>, config: Arc<Config>) -> Self {
        Self {
            state: Arc::new(Mutex::new(RunState::Held(execution))),
            idem,
            config,
        }
    }

    fn lock(&self) -> MutexGuard<'_, RunState<S>> {
        // Only ever held for a swap: a panic cannot leave it half-written.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn idempotency(&self) -> &Idempotency<S> {
        &self.idem
    }

    pub(crate) fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The execution, for the handler's phases; `None` when the layer no longer holds it.
    pub(crate) fn lend(&self) -> Option<Execution<S>> {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, RunState::Lent) {
            RunState::Held(execution) => Some(execution),
            other => {
                *state = other;
                None
            }
        }
    }

    /// Gives a lent execution back untouched.
    pub(crate) fn give_back(&self, execution: Execution<S>) {
        *self.lock() = RunState::Held(execution);
    }

    /// The phases ended the operation; `ender` when it is abandoned.
    pub(crate) fn ended(&self, execution: Execution<S>, ender: Option<Ender<S>>) {
        *self.lock() = RunState::Ended(execution, ender);
    }

    /// The phases' driver ended the execution itself.
    pub(crate) fn gone(&self) {
        *self.lock() = RunState::Gone;
    }

    /// The state, for the layer after the handler; the slot is left [`RunState::Gone`].
    pub(crate) fn take_back(&self) -> RunState<S> {
        std::mem::replace(&mut *self.lock(), RunState::Gone)
    }
}
