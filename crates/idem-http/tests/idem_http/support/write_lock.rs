//! Keyed requests and a database with one writer at a time (SQLite; issue 19, point 4): a
//! request takes the write lock only when its handler writes, waits for it no longer than the
//! store's busy timeout (then `503` with `Retry-After`, and its key is free), and its heartbeat
//! renews the lease without queueing behind its own transaction.
//!
//! The handler here stops at named barriers the test opens, so "while the first request is
//! still running" is an order of events, never a guess about timing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::HeaderMap;
use idem_core::{ErrorKind, TransactionalStore};
use idem_http::IdemTx;
use idem_request::{Idempotency, IdempotencyBuilder};
use idem_sql::SqliteOptions;
use idem_testkit::RequestFixture;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use idem_testkit::http::HttpFixture;
use idem_testkit::http::fixtures::SqliteFx;
use idem_testkit::http::{Reply, layer};

/// Named points a handler stops at until the test opens them.
#[derive(Default)]
pub(crate) struct Barriers {
    named: Mutex<HashMap<String, Arc<Barrier>>>,
}

struct Barrier {
    reached: watch::Sender<bool>,
    open: watch::Sender<bool>,
}

impl Barriers {
    fn get(&self, name: &str) -> Arc<Barrier> {
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(named.entry(name.to_owned()).or_insert_with(|| {
            Arc::new(Barrier {
                reached: watch::Sender::new(false),
                open: watch::Sender::new(false),
            })
        }))
    }

    /// A handler stops here until the test opens `name`.
    async fn stop(&self, name: &str) {
        let barrier = self.get(name);
        let mut open = barrier.open.subscribe();
        barrier.reached.send_replace(true);
        let _ = open.wait_for(|o| *o).await;
    }

    pub(crate) fn open(&self, name: &str) {
        self.get(name).open.send_replace(true);
    }
}

struct HoldApp<F: HttpFixture> {
    fx: Arc<F>,
    store: F::Store,
    barriers: Barriers,
    executions: AtomicU64,
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `POST /hold`: through the execution's transaction, reads the effects table if `x-read`,
/// stops at barrier `x-before-write`, writes effect `x-write`, stops at barrier `x-hold` (the
/// transaction open, holding what it wrote), then answers `201` with the execution's number.
/// A write refused as transient (SQLite's busy write lock) is answered as a handler should:
/// `503` with `Retry-After`, not stored; any other failure is a `500`.
async fn hold<F: HttpFixture>(
    State(app): State<Arc<HoldApp<F>>>,
    mut tx: IdemTx<F::Store>,
    headers: HeaderMap,
) -> Response {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    if headers.contains_key("x-read") {
        app.fx.read_through(&mut tx).await.expect("read through tx");
    }
    if let Some(name) = header(&headers, "x-before-write") {
        app.barriers.stop(name).await;
    }
    if let Some(effect) = header(&headers, "x-write")
        && let Err(e) = app.fx.record_effect(&mut tx, effect).await
    {
        let busy = app.store.classify(&*e) == Some(ErrorKind::Transient);
        let status = if busy { 503 } else { 500 };
        let mut response = (
            http::StatusCode::from_u16(status).expect("status"),
            e.to_string(),
        )
            .into_response();
        if busy {
            response
                .headers_mut()
                .insert("retry-after", http::HeaderValue::from_static("1"));
        }
        return response;
    }
    if let Some(name) = header(&headers, "x-hold") {
        app.barriers.stop(name).await;
    }
    (
        http::StatusCode::CREATED,
        axum::Json(json!({ "execution": n })),
    )
        .into_response()
}

/// The `/hold` route behind the suite's layer, served on 127.0.0.1:0; aborted when dropped.
pub(crate) struct HoldServer<F: HttpFixture> {
    base: String,
    client: reqwest::Client,
    app: Arc<HoldApp<F>>,
    task: JoinHandle<()>,
}

impl<F: HttpFixture> Drop for HoldServer<F> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<F: HttpFixture> HoldServer<F> {
    pub(crate) async fn start(
        fx: Arc<F>,
        store: F::Store,
        configure: impl FnOnce(IdempotencyBuilder<F::Store>) -> IdempotencyBuilder<F::Store>,
    ) -> Arc<Self> {
        let idem = configure(Idempotency::builder(store.clone()))
            .build()
            .expect("engine configuration");
        let app = Arc::new(HoldApp {
            fx,
            store,
            barriers: Barriers::default(),
            executions: AtomicU64::new(0),
        });
        let router = Router::new()
            .route("/hold", post(hold::<F>).layer(layer(idem)))
            .with_state(Arc::clone(&app));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        Arc::new(Self {
            base: format!("http://{addr}"),
            client,
            app,
            task,
        })
    }

    pub(crate) fn executions(&self) -> u64 {
        self.app.executions.load(Ordering::SeqCst)
    }

    pub(crate) fn open(&self, barrier: &str) {
        self.app.barriers.open(barrier);
    }

    /// `POST /hold` as alice with `key` and the handler's instructions in `headers`.
    pub(crate) async fn post(&self, key: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self
            .client
            .post(format!("{}/hold", self.base))
            .header("content-type", "application/json")
            .header("x-principal", "alice")
            .header("idempotency-key", format!("\"{key}\""))
            .body("{}");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let response = req.send().await.expect("a response");
        Reply {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.bytes().await.expect("body"),
        }
    }

    /// Sends the request in a task of its own.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        key: &str,
        headers: &[(&'static str, &'static str)],
    ) -> JoinHandle<Reply> {
        let (server, key, headers) = (Arc::clone(self), key.to_owned(), headers.to_vec());
        tokio::spawn(async move { server.post(&key, &headers).await })
    }

    /// Waits until `request`'s handler stops at `barrier`; fails with its answer if it
    /// answers first.
    pub(crate) async fn held(&self, barrier: &str, request: &mut JoinHandle<Reply>) {
        let mut reached = self.app.barriers.get(barrier).reached.subscribe();
        tokio::select! {
            _ = reached.wait_for(|r| *r) => {}
            reply = request => panic!(
                "the request answered before its handler reached {barrier:?}: {:?}",
                reply.expect("request task")
            ),
            () = tokio::time::sleep(Duration::from_secs(30)) => {
                panic!("the request did not reach {barrier:?} within 30 s")
            }
        }
    }
}

/// Tears the fixture down once the server is gone.
async fn done<F: HttpFixture>(server: Arc<HoldServer<F>>, fx: Arc<F>) {
    drop(server);
    let mut fx = fx;
    for _ in 0..100 {
        match Arc::try_unwrap(fx) {
            Ok(fx) => return fx.teardown().await,
            Err(back) => fx = back,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `Retry-After` of a `503`, in whole seconds (at least 1).
fn retry_after(reply: &Reply) -> u64 {
    let value = reply
        .headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("a 503 without Retry-After: {reply:?}"));
    let secs: u64 = value
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After is not whole seconds: {value:?}"));
    assert!(secs >= 1, "{reply:?}");
    secs
}

/// Every store: a slow request that reads through its transaction but never writes does not
/// keep another key's request from writing and completing. The other request answers while
/// the first is still held on its barrier. (On SQLite the first request held the database's
/// write lock from its `BEGIN IMMEDIATE` on, and the other key waited out the busy timeout.)
pub(crate) async fn a_slow_request_that_never_writes_does_not_delay_another_key<F: HttpFixture>(
    test: &str,
) {
    let Some(fx) = F::setup(test).await else {
        return;
    };
    let fx = Arc::new(fx);
    let server = HoldServer::start(Arc::clone(&fx), fx.store(), |b| b).await;
    let mut slow = server.spawn("k-slow", &[("x-read", "1"), ("x-hold", "slow")]);
    server.held("slow", &mut slow).await;
    let other = tokio::time::timeout(
        Duration::from_secs(5),
        server.post("k-other", &[("x-write", "other")]),
    )
    .await
    .expect("another key's request waited for the slow one (5 s and counting)");
    assert_eq!((other.status, other.replayed()), (201, false), "{other:?}");
    assert!(!slow.is_finished(), "the slow request is still held");
    server.open("slow");
    let slow = slow.await.expect("slow request");
    assert_eq!((slow.status, slow.replayed()), (201, false), "{slow:?}");
    for (key, first) in [("k-slow", &slow), ("k-other", &other)] {
        let replay = server.post(key, &[]).await;
        assert!(replay.replayed(), "{key}: {replay:?}");
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(server.executions(), 2);
    assert_eq!(fx.count_effects("other").await, 1);
    done(server, fx).await;
}

/// The bound every test below waits for SQLite's write lock: the store's busy timeout.
const BOUND: Duration = Duration::from_millis(300);

async fn sqlite(test: &str) -> Arc<SqliteFx> {
    Arc::new(SqliteFx::setup(test).await.expect("sqlite"))
}

/// A request whose record cannot be taken because another request holds the write lock past
/// the bound is `503` with `Retry-After`; nothing is recorded, and once the lock is free the
/// same key runs.
pub(crate) async fn a_take_that_waits_past_the_bound_is_503_with_retry_after(test: &str) {
    let fx = sqlite(test).await;
    let store = fx
        .store_with(SqliteOptions::default().busy_timeout(BOUND))
        .await;
    let server = HoldServer::start(Arc::clone(&fx), store, |b| b).await;
    let mut holder = server.spawn("k-holder", &[("x-write", "holder"), ("x-hold", "holder")]);
    server.held("holder", &mut holder).await;

    let refused = server.post("k-waiting", &[("x-write", "waiting")]).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.code(), "store-unavailable");
    retry_after(&refused);
    assert_eq!(fx.count_records().await, 1, "only the holder's record");

    server.open("holder");
    assert_eq!(holder.await.expect("holder").status, 201);
    let again = server.post("k-waiting", &[("x-write", "waiting")]).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(fx.count_effects("waiting").await, 1);
    done(server, fx).await;
}

/// A handler that never wrote needs the write lock only to complete its record. When another
/// request holds it past the bound, the answer is `503` with `Retry-After` (not stored), and
/// the key is free: the retry runs, never `409`.
pub(crate) async fn a_completion_that_waits_past_the_bound_is_503_and_frees_the_key(test: &str) {
    let fx = sqlite(test).await;
    let store = fx
        .store_with(SqliteOptions::default().busy_timeout(BOUND))
        .await;
    let server = HoldServer::start(Arc::clone(&fx), store, |b| b).await;
    let mut late = server.spawn("k-late", &[("x-read", "1"), ("x-hold", "late")]);
    server.held("late", &mut late).await;
    let mut holder = server.spawn("k-holder", &[("x-write", "holder"), ("x-hold", "holder")]);
    server.held("holder", &mut holder).await;

    server.open("late");
    let refused = late.await.expect("late request");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.code(), "store-unavailable");
    retry_after(&refused);

    server.open("holder");
    assert_eq!(holder.await.expect("holder").status, 201);
    let again = server.post("k-late", &[]).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(server.executions(), 3, "late, holder, late again");
    done(server, fx).await;
}

/// A handler whose own write waits for the lock past the bound gets SQLite's busy error
/// (classified transient) and answers `503` with `Retry-After`; its key is freed even though
/// freeing it needs the lock the other request still holds: the retry runs, never `409`.
pub(crate) async fn a_write_that_waits_past_the_bound_frees_the_key(test: &str) {
    let fx = sqlite(test).await;
    let store = fx
        .store_with(SqliteOptions::default().busy_timeout(BOUND))
        .await;
    let server = HoldServer::start(Arc::clone(&fx), store, |b| b).await;
    let mut blocked = server.spawn(
        "k-blocked",
        &[("x-before-write", "blocked"), ("x-write", "blocked")],
    );
    server.held("blocked", &mut blocked).await;
    let mut holder = server.spawn("k-holder", &[("x-write", "holder"), ("x-hold", "holder")]);
    server.held("holder", &mut holder).await;

    server.open("blocked");
    let refused = blocked.await.expect("blocked request");
    assert_eq!(refused.status, 503, "{refused:?}");
    retry_after(&refused);

    server.open("holder");
    assert_eq!(holder.await.expect("holder").status, 201);
    let again = server.post("k-blocked", &[("x-write", "blocked")]).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(fx.count_effects("blocked").await, 1);
    done(server, fx).await;
}

/// A request running longer than its lease, without writing, keeps the lease by its
/// heartbeat: the lease in the database lies ahead while it runs, and a retry is `409`, not
/// a takeover. (Each renewal waited for the write lock the request's own `BEGIN IMMEDIATE`
/// held, and failed at the busy timeout; the lease was never renewed.)
pub(crate) async fn a_request_longer_than_its_lease_keeps_it_by_heartbeat(test: &str) {
    let fx = sqlite(test).await;
    let server = HoldServer::start(Arc::clone(&fx), fx.store(), |b| {
        b.lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(200))
    })
    .await;
    let mut long = server.spawn("k-long", &[("x-hold", "long")]);
    server.held("long", &mut long).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    let lease = fx.lease_until("k-long").await;
    assert!(
        lease > now,
        "the lease ran out {} ms ago: never renewed",
        (now - lease) / 1000
    );
    let retry = server.post("k-long", &[]).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.code(), "conflict");

    server.open("long");
    let long = long.await.expect("long request");
    assert_eq!((long.status, long.replayed()), (201, false), "{long:?}");
    let replay = server.post("k-long", &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, long.body);
    assert_eq!(server.executions(), 1);
    done(server, fx).await;
}

/// While a request's own transaction holds the write lock, its heartbeat's renewals do not
/// queue behind it: on a pool of two connections (one is the transaction's) a lookup of
/// another key is answered at once, and a retry of the running key is `409`, not a takeover.
/// (Each renewal waited on the pool's other connection for the busy timeout, 10 s, and
/// every lookup waited for that connection.)
pub(crate) async fn the_heartbeat_does_not_queue_behind_its_own_write_lock(test: &str) {
    let fx = sqlite(test).await;
    let store = fx
        .store_with(SqliteOptions::default().max_connections(2))
        .await;
    let server = HoldServer::start(Arc::clone(&fx), store, |b| {
        b.lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(100))
    })
    .await;
    let done_first = server.post("k-done", &[("x-write", "done")]).await;
    assert_eq!(done_first.status, 201);
    let mut writer = server.spawn("k-writer", &[("x-write", "writer"), ("x-hold", "writer")]);
    server.held("writer", &mut writer).await;
    // Several renewals, and past the lease.
    tokio::time::sleep(Duration::from_millis(1300)).await;

    let replay = tokio::time::timeout(Duration::from_secs(3), server.post("k-done", &[]))
        .await
        .expect("a lookup waited behind the heartbeat (3 s and counting)");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, done_first.body);
    let retry = tokio::time::timeout(Duration::from_secs(3), server.post("k-writer", &[]))
        .await
        .expect("a retry waited behind the heartbeat (3 s and counting)");
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.code(), "conflict");

    server.open("writer");
    let writer = writer.await.expect("writer");
    assert_eq!(
        (writer.status, writer.replayed()),
        (201, false),
        "{writer:?}"
    );
    assert_eq!(server.executions(), 2);
    assert_eq!(fx.count_effects("writer").await, 1);
    done(server, fx).await;
}
