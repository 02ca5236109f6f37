//! A store that stops at its n-th await point until told to go on, so a test can drop the
//! layer's future at each of them in turn: before and after every call into the real store
//! it wraps, and wherever the handler asks ([`Gate::point`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::store::RequestStore;
use idem_core::{Begin, Error, ErrorKind, Fence, Fingerprint, RequestKey, TransactionalStore};
use tokio::sync::watch;

/// Counts await points and holds the `target`-th one until [`resume`](Self::resume).
#[derive(Debug)]
pub(crate) struct Gate {
    target: usize,
    passed: AtomicUsize,
    reached: watch::Sender<bool>,
    resumed: watch::Sender<bool>,
}

impl Gate {
    pub(crate) fn new(target: usize) -> Arc<Self> {
        Arc::new(Self {
            target,
            passed: AtomicUsize::new(0),
            reached: watch::Sender::new(false),
            resumed: watch::Sender::new(false),
        })
    }

    /// One await point: the target one waits until the test resumes it.
    pub(crate) async fn point(&self) {
        let n = self.passed.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.target {
            let mut resumed = self.resumed.subscribe();
            self.reached.send_replace(true);
            let _ = resumed.wait_for(|r| *r).await;
        }
    }

    /// Waits until the target point is reached.
    pub(crate) async fn reached(&self) {
        let _ = self.reached.subscribe().wait_for(|r| *r).await;
    }

    pub(crate) fn resume(&self) {
        self.resumed.send_replace(true);
    }
}

/// `S`, with a [`Gate`] point before and after each of its calls.
#[derive(Debug, Clone)]
pub(crate) struct Hang<S> {
    pub(crate) inner: S,
    pub(crate) gate: Arc<Gate>,
}

impl<S: TransactionalStore> TransactionalStore for Hang<S> {
    type Tx = S::Tx;

    async fn begin(&self) -> Result<S::Tx, Error> {
        self.gate.point().await;
        let r = self.inner.begin().await;
        self.gate.point().await;
        r
    }

    async fn commit(&self, tx: S::Tx) -> Result<(), Error> {
        self.gate.point().await;
        let r = self.inner.commit(tx).await;
        self.gate.point().await;
        r
    }

    async fn rollback(&self, tx: S::Tx) -> Result<(), Error> {
        self.gate.point().await;
        let r = self.inner.rollback(tx).await;
        self.gate.point().await;
        r
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        self.inner.classify(error)
    }
}

impl<S: RequestStore> RequestStore for Hang<S> {
    fn max_key_len(&self) -> usize {
        self.inner.max_key_len()
    }

    async fn begin_execution(&self) -> Result<S::Tx, Error> {
        self.gate.point().await;
        let r = self.inner.begin_execution().await;
        self.gate.point().await;
        r
    }

    async fn begin_request(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Begin, Error> {
        self.gate.point().await;
        let r = self.inner.begin_request(key, fingerprint, lease, ttl).await;
        self.gate.point().await;
        r
    }

    async fn complete_in(
        &self,
        tx: &mut S::Tx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        self.gate.point().await;
        let r = self.inner.complete_in(tx, key, fence, result, ttl).await;
        self.gate.point().await;
        r
    }

    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        self.gate.point().await;
        let r = self.inner.release(key, fence).await;
        self.gate.point().await;
        r
    }

    async fn extend_lease(
        &self,
        key: &RequestKey,
        fence: Fence,
        lease: Duration,
    ) -> Result<bool, Error> {
        self.gate.point().await;
        let r = self.inner.extend_lease(key, fence, lease).await;
        self.gate.point().await;
        r
    }
}
