//! What a handler knows of the idempotent request it executes: [`IdemRequest`] (the record's
//! scope and key, keys derived from them for external calls) and whether the handler *started
//! executing* — Stripe's rule, "results are only saved if an API endpoint started executing".
//!
//! A client error (4xx) is stored only when the handler started: an extractor that rejected
//! the request (axum's `Json` answering `415` to a `text/plain` body, `422` to a missing
//! field) ran before the handler, and storing its answer would replay a mistake the client
//! has since corrected. The layer cannot see inside axum's handler, so the handler marks the
//! start itself, mostly without saying so:
//!
//! - using [`IdemTx`](crate::IdemTx) (any read or write through it: the first `Deref`) marks it;
//! - deriving a key for an external call ([`IdemRequest::derive_key`]) marks it;
//! - [`IdemRequest::mark_started`], or the [`Executed`] marker in the response, marks it for a
//!   handler that does neither (a `404` it looked up elsewhere, a refusal it decided on).
//!
//! Taking an extractor does not mark it: axum runs every extractor before the handler, so
//! `IdemTx` is already taken when `Json` rejects the body. A 2xx or 3xx is stored either way
//! (no extractor answers with one); see
//! [`store_client_errors_before_start`](crate::IdempotencyLayer::store_client_errors_before_start)
//! for the old rule of storing every 4xx.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::Extensions;
use idem_core::{DerivedKey, IdempotencyKey, RequestKey};

/// Whether the handler of one execution started; shared by its [`IdemRequest`], its
/// transaction slot and the layer.
#[derive(Clone, Default)]
pub(crate) struct StartMark(Arc<AtomicBool>);

impl StartMark {
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub(crate) fn is_marked(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The idempotent request a handler is executing: its record's scope (principal, method and
/// the path the client sent) and the client's key. In the request's extensions; an axum
/// extractor (feature `axum`; `Option<IdemRequest>` where the key is optional).
///
/// Derive the idempotency key of every external call from it ([`derive_key`](Self::derive_key)),
/// never from the client's key alone: two tenants that both send `Idempotency-Key: order-42`
/// must not send the same key to the card processor, which would deduplicate one tenant's
/// charge into the other's.
///
/// ```
/// use idem_http::IdemRequest;
///
/// async fn charge(req: IdemRequest /* , Json(order): Json<Order> */) -> String {
///     // The same for every retry and takeover of this record; another principal, method
///     // or path derives another one.
///     let key = req.derive_key("card-processor/charge").to_uuid_string();
///     // processor.charge(&order).idempotency_key(&key).send().await …
///     key
/// }
/// ```
#[derive(Clone)]
pub struct IdemRequest {
    key: RequestKey,
    started: StartMark,
}

impl IdemRequest {
    pub(crate) fn new(key: RequestKey, started: StartMark) -> Self {
        Self { key, started }
    }

    pub(crate) fn started(&self) -> &StartMark {
        &self.started
    }

    /// The request of an idempotent execution, from the request's extensions (hyper, a plain
    /// tower stack); `None` when the layer let the request through without a record.
    pub fn from_extensions(extensions: &Extensions) -> Option<Self> {
        extensions.get::<Self>().cloned()
    }

    /// The record's key: its scope and the client's key.
    pub fn request_key(&self) -> &RequestKey {
        &self.key
    }

    /// The client's `Idempotency-Key`, as sent. Not a key for third parties: it is the same
    /// for every principal that chose it; use [`derive_key`](Self::derive_key).
    pub fn client_key(&self) -> &IdempotencyKey {
        &self.key.key
    }

    /// The idempotency key of the external call named `call` (`"stripe/charge"`,
    /// `"mailer/receipt"`): distinct per principal, method, path, client key and call, stable
    /// across retries and takeovers. `.to_uuid_string()` is the shape most APIs accept.
    ///
    /// Marks the execution started: the handler is about to act, so even a 4xx it answers
    /// afterwards is stored.
    pub fn derive_key(&self, call: &str) -> DerivedKey {
        self.mark_started();
        DerivedKey::for_request(&self.key, call)
    }

    /// The [`Emitter`](idem_core::outbox::Emitter) of this execution's outbox messages: their
    /// IDs derive from the request's scoped key (principal, method, path, client key) and their
    /// position, so a retry or a takeover that runs the handler again enqueues the same IDs,
    /// and tenants sending the same key get different ones. Make one per handler run and
    /// enqueue in a fixed order, through the store's
    /// [`OutboxStore::enqueue`](idem_core::outbox::OutboxStore::enqueue) on the request's
    /// transaction.
    ///
    /// Outside the request, [`Principal::emitter`](crate::Principal::emitter) recomputes the
    /// same IDs from (principal, method, path, key).
    ///
    /// Marks the execution started, as [`derive_key`](Self::derive_key) does.
    pub fn emitter(&self) -> idem_core::outbox::Emitter {
        self.mark_started();
        idem_core::outbox::Emitter::for_request(&self.key)
    }

    /// Says the handler started executing, so its response is stored even when it is a 4xx
    /// (see the [module docs](crate::execution)). Using the transaction or deriving a key does
    /// this already.
    pub fn mark_started(&self) {
        self.started.mark();
    }
}

impl fmt::Debug for IdemRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is the client's secret in a shared scope: show its digest.
        f.debug_struct("IdemRequest")
            .field("key", &idem_request::KeyDigest(&self.key))
            .field("started", &self.started.is_marked())
            .finish()
    }
}

/// A response marker: the handler started executing, so this response is stored even when it
/// is a 4xx. The layer removes it from the response.
///
/// In axum, put it in a response tuple, after the status: `(StatusCode::NOT_FOUND, Executed,
/// "no such account")`. Elsewhere, insert it in the response's extensions.
#[derive(Debug, Clone, Copy, Default)]
pub struct Executed;
