//! idem-client against idem's own server side: an axum service behind idem-http's
//! `IdempotencyLayer` on SQLite, over TCP. Its replay marker, its `409` while a key runs, and
//! its stored answers are what the client reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::{Extension, Router, routing::post};
use http::StatusCode;
use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, Jitter, Outcome, RetryPolicy};
use idem_http::IdempotencyLayer;
use idem_request::Idempotency;
use idem_sql::{SqliteOptions, SqliteStore};

/// Charges made by the handler.
#[derive(Clone, Default)]
struct Effects(Arc<AtomicU64>);

async fn create_charge(
    Extension(effects): Extension<Effects>,
    body: String,
) -> (StatusCode, String) {
    if body.contains("slow") {
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let n = effects.0.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!(r#"{{"id":"ch_{n}"}}"#))
}

struct Service {
    url: String,
    effects: Effects,
    _dir: tempfile::TempDir,
}

async fn service() -> Service {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
        .await
        .expect("sqlite");
    idem_core::Migrate::migrate(&store).await.expect("migrate");
    let idem = Idempotency::builder(store).build().expect("idempotency");
    let effects = Effects::default();
    let app = Router::new()
        .route("/charges", post(create_charge))
        .layer(IdempotencyLayer::shared_scope(idem))
        .layer(Extension(effects.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/charges", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Service {
        url,
        effects,
        _dir: dir,
    }
}

fn client() -> reqwest_middleware::ClientWithMiddleware {
    let policy = RetryPolicy::default()
        .backoff(Duration::from_millis(1), Duration::from_millis(10))
        .jitter(Jitter::None);
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new(policy))
        .build()
}

#[tokio::test]
async fn idem_http_replays_are_reported_as_replays() {
    let s = service().await;
    let c = client();
    let first = c
        .post(&s.url)
        .idempotency_key("order-1")
        .body("1250")
        .send()
        .await
        .expect("first");
    let again = c
        .post(&s.url)
        .idempotency_key("order-1")
        .body("1250")
        .send()
        .await
        .expect("again");
    assert_eq!(
        (first.status(), again.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    let (o1, o2) = (Outcome::of(&first).cloned(), Outcome::of(&again).cloned());
    assert!(!o1.expect("outcome").replayed);
    assert!(
        o2.expect("outcome").replayed,
        "idem-http's Idempotent-Replayed is read"
    );
    assert_eq!(again.text().await.expect("body"), r#"{"id":"ch_1"}"#);
    assert_eq!(s.effects.0.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn idem_https_in_progress_conflict_is_waited_out() {
    let s = service().await;
    let c = client();
    let first = c
        .post(&s.url)
        .idempotency_key("order-2")
        .body("slow")
        .send();
    let second = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.post(&s.url)
            .idempotency_key("order-2")
            .body("slow")
            .send()
            .await
    };
    let (first, second) = tokio::join!(first, second);
    let (first, second) = (first.expect("first"), second.expect("second"));
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(second.status(), StatusCode::CREATED, "the 409 was retried");
    let o = Outcome::of(&second).expect("outcome");
    assert!(o.attempts >= 2 && o.replayed, "{o:?}");
    assert_eq!(s.effects.0.load(Ordering::SeqCst), 1);
}
