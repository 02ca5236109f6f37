//! The black-box HTTP suite (`idem_testkit::http`) against actix-web: the same checks, over
//! real TCP, as the tower layer under axum, on SQLite always and on PostgreSQL, MySQL/MariaDB
//! and Redis through `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL` and `IDEM_TEST_REDIS_URL`.
//! This is the crate's one integration-test binary.

use std::sync::Arc;

use actix_web::error::{InternalError, JsonPayloadError};
use actix_web::http::StatusCode as ActixStatus;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use bytes::Bytes;
use idem_actix::{Executed, IdemRequest, IdemTx, IdempotencyMiddleware};
use idem_http::KeyRequirement;
use idem_request::Idempotency;
use idem_testkit::http::{HttpFixture, HttpFramework, Order, Running, SuiteApp, layer};

/// actix-web 4 with [`IdempotencyMiddleware`] on each resource.
struct Actix;

type Data<F> = web::Data<SuiteApp<F>>;

fn headers(req: &HttpRequest) -> http::HeaderMap {
    let mut out = http::HeaderMap::new();
    for (name, value) in req.headers() {
        out.append(
            http::HeaderName::from_bytes(name.as_str().as_bytes()).expect("a header name"),
            http::HeaderValue::from_bytes(value.as_bytes()).expect("a header value"),
        );
    }
    out
}

/// The suite's framework-free response as actix-web's, the [`Executed`] marker included.
fn respond(response: http::Response<Bytes>) -> HttpResponse {
    let (parts, body) = response.into_parts();
    let status = ActixStatus::from_u16(parts.status.as_u16()).expect("a status");
    let mut out = HttpResponse::with_body(status, body).map_into_boxed_body();
    for (name, value) in &parts.headers {
        out.headers_mut().append(
            actix_web::http::header::HeaderName::from_bytes(name.as_str().as_bytes())
                .expect("a header name"),
            actix_web::http::header::HeaderValue::from_bytes(value.as_bytes())
                .expect("a header value"),
        );
    }
    if parts.extensions.get::<Executed>().is_some() {
        out.extensions_mut().insert(Executed);
    }
    out
}

async fn charge<F: HttpFixture>(
    app: Data<F>,
    mut tx: Option<IdemTx<F::Store>>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    respond(app.charge(tx.as_deref_mut(), &headers(&req), &body).await)
}

async fn json_charge<F: HttpFixture>(
    app: Data<F>,
    mut tx: Option<IdemTx<F::Store>>,
    req: HttpRequest,
    order: web::Json<Order>,
) -> HttpResponse {
    respond(
        app.json_charge(tx.as_deref_mut(), &headers(&req), order.into_inner())
            .await,
    )
}

async fn plain<F: HttpFixture>(app: Data<F>, req: HttpRequest) -> HttpResponse {
    respond(app.plain(&headers(&req)))
}

async fn derive<F: HttpFixture>(app: Data<F>, idem: IdemRequest, req: HttpRequest) -> HttpResponse {
    respond(app.derive(&idem, &headers(&req)))
}

async fn emit<F: HttpFixture>(
    app: Data<F>,
    idem: IdemRequest,
    mut tx: IdemTx<F::Store>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    respond(app.emit(&mut tx, &idem, &headers(&req), &body).await)
}

async fn list<F: HttpFixture>(app: Data<F>) -> HttpResponse {
    respond(app.list())
}

/// The suite's JSON rejections: `415` for another media type, `422` for JSON that does not
/// fit, `400` for a body that is not JSON (actix-web answers `400` to all three by default).
fn json_rejection(err: JsonPayloadError, _: &HttpRequest) -> actix_web::Error {
    let status = match &err {
        JsonPayloadError::ContentType => ActixStatus::UNSUPPORTED_MEDIA_TYPE,
        JsonPayloadError::Deserialize(e) if e.is_data() => ActixStatus::UNPROCESSABLE_ENTITY,
        _ => ActixStatus::BAD_REQUEST,
    };
    InternalError::from_response(err, HttpResponse::build(status).finish()).into()
}

impl HttpFramework for Actix {
    // actix-web's dispatcher does not cancel a handler whose client went away.
    const CANCELS_ON_DISCONNECT: bool = false;

    async fn serve<F: HttpFixture>(app: Arc<SuiteApp<F>>, idem: Idempotency<F::Store>) -> Running {
        let data = web::Data::from(app);
        let factory = move || {
            let mw = |config| IdempotencyMiddleware::new(config);
            let versioned = |prefix: &str| {
                web::scope(prefix)
                    .service(
                        web::resource("/charges")
                            .wrap(mw(layer(idem.clone())))
                            .route(web::post().to(charge::<F>)),
                    )
                    .service(
                        web::resource("/derive")
                            .wrap(mw(layer(idem.clone())))
                            .route(web::post().to(derive::<F>)),
                    )
                    .service(
                        web::resource("/emit")
                            .wrap(mw(layer(idem.clone())))
                            .route(web::post().to(emit::<F>)),
                    )
            };
            App::new()
                .app_data(data.clone())
                .app_data(web::JsonConfig::default().error_handler(json_rejection))
                .service(
                    web::resource("/charges")
                        .wrap(mw(layer(idem.clone())))
                        .route(web::post().to(charge::<F>))
                        .route(web::get().to(list::<F>)),
                )
                .service(
                    web::resource("/optional")
                        .wrap(IdempotencyMiddleware::new(
                            layer(idem.clone()).optional_key(),
                        ))
                        .route(web::post().to(charge::<F>)),
                )
                .service(
                    web::resource("/off")
                        .wrap(IdempotencyMiddleware::new(
                            layer(idem.clone()).key_requirement(KeyRequirement::Off),
                        ))
                        .route(web::post().to(charge::<F>)),
                )
                .service(
                    web::resource("/json")
                        .wrap(mw(layer(idem.clone())))
                        .route(web::post().to(json_charge::<F>)),
                )
                .service(
                    web::resource("/plain")
                        .wrap(mw(layer(idem.clone())))
                        .route(web::post().to(plain::<F>)),
                )
                .service(
                    web::resource("/derive")
                        .wrap(mw(layer(idem.clone())))
                        .route(web::post().to(derive::<F>)),
                )
                .service(
                    web::resource("/emit")
                        .wrap(mw(layer(idem.clone())))
                        .route(web::post().to(emit::<F>)),
                )
                .service(versioned("/v1"))
                .service(versioned("/v2"))
        };
        // actix-web runs on its own runtime (a system of single-threaded workers): a thread of
        // its own, stopped through the server's handle.
        let (sent, started) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(factory)
                    .workers(2)
                    .disable_signals()
                    .shutdown_timeout(1)
                    .bind(("127.0.0.1", 0))
                    .expect("bind 127.0.0.1:0");
                let addr = server.addrs()[0];
                let server = server.run();
                let _ = sent.send((addr, server.handle()));
                let _ = server.await;
            });
        });
        let (addr, handle) = started.await.expect("the server starts");
        Running::new(format!("http://{addr}"), move || {
            // The stop command is sent at once; its completion is not awaited.
            drop(handle.stop(false));
        })
    }
}

idem_testkit::http_suite_tests!(Actix);

/// The principal found in actix-web's own extensions (where an authentication middleware puts
/// it): scoped per account, and `401 missing-principal` without one.
#[test]
fn a_principal_from_the_actix_request_scopes_the_records() {
    use actix_web::dev::Service;
    use actix_web::{HttpMessage, test};

    #[derive(Clone)]
    struct Account(String);

    actix_web::rt::System::new().block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = idem_sql::SqliteStore::open(
            dir.path().join("app.db"),
            idem_sql::SqliteOptions::default(),
        )
        .await
        .expect("open sqlite");
        idem_core::Migrate::migrate(&store).await.expect("migrate");
        let idem = Idempotency::builder(store).build().expect("engine");
        let middleware = IdempotencyMiddleware::new(
            idem_http::IdempotencyLayer::shared_scope(idem).require_key(),
        )
        .principal_from_request(|req: &HttpRequest| {
            req.extensions().get::<Account>().map(|a| a.0.clone())
        });
        let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = Arc::clone(&calls);
        let app = test::init_service(
            App::new()
                .wrap_fn(|req, srv| {
                    // Stands in for authentication: the account from a header, in extensions.
                    let account = req
                        .headers()
                        .get("x-account")
                        .and_then(|v| v.to_str().ok())
                        .map(|a| Account(a.to_owned()));
                    if let Some(account) = account {
                        req.extensions_mut().insert(account);
                    }
                    srv.call(req)
                })
                .service(
                    web::resource("/charges")
                        .wrap(middleware)
                        .route(web::post().to(move || {
                            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            async move { HttpResponse::Created().body(format!("charge {n}")) }
                        })),
                ),
        )
        .await;
        let post = |account: Option<&str>| {
            let mut req = test::TestRequest::post()
                .uri("/charges")
                .insert_header(("idempotency-key", "k-1"));
            if let Some(account) = account {
                req = req.insert_header(("x-account", account.to_owned()));
            }
            req.to_request()
        };
        let anonymous = test::call_service(&app, post(None)).await;
        assert_eq!(anonymous.status(), 401);
        let alice = test::read_body(test::call_service(&app, post(Some("alice"))).await).await;
        let again = test::call_service(&app, post(Some("alice"))).await;
        assert!(again.headers().contains_key("idempotent-replayed"));
        assert_eq!(test::read_body(again).await, alice);
        let bob = test::read_body(test::call_service(&app, post(Some("bob"))).await).await;
        assert_ne!(bob, alice, "another principal's record");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    });
}

/// Recovery points under the actix-web middleware ([`IdemPhases`]): a failed phase answers
/// `503 phase-failed` and is rolled back alone, the retry resumes after the committed phase
/// (which ran once), and the last phase's response is stored and replayed.
mod phases {
    use std::sync::Mutex;

    use actix_web::{App, HttpRequest, HttpResponse, test, web};
    use bytes::Bytes;
    use idem_actix::{IdemPhases, IdempotencyMiddleware, PhasesRejection};
    use idem_core::BoxError;
    use idem_core::store::RecoveryStore;
    use idem_http::phases::{PhaseResponse, Phases};
    use idem_request::{Idempotency, PhaseCtx, Step};
    use idem_testkit::http::HttpFixture;
    use std::sync::Arc;

    #[derive(serde::Serialize, serde::Deserialize)]
    enum Pay {
        Charge { tag: String },
        Record { tag: String },
    }

    struct Payments<F> {
        fx: Arc<F>,
        /// Foreign keys sent, one per call of the `Charge` phase.
        calls: Arc<Mutex<Vec<String>>>,
    }

    impl<F> Phases<F::Store> for Payments<F>
    where
        F: HttpFixture,
        F::Store: RecoveryStore,
    {
        type Phase = Pay;
        type Error = BoxError;

        async fn step(
            &self,
            phase: Pay,
            ctx: &mut PhaseCtx<F::Store>,
        ) -> Result<Step<Pay, PhaseResponse>, BoxError> {
            Ok(match phase {
                Pay::Charge { tag } => {
                    let key = ctx.foreign_key("charge").to_uuid_string();
                    self.calls.lock().expect("the test's lock").push(key);
                    self.fx
                        .record_effect(ctx.tx(), &format!("{tag}:charge"))
                        .await?;
                    Step::Next(Pay::Record { tag })
                }
                Pay::Record { tag } => {
                    self.fx
                        .record_effect(ctx.tx(), &format!("{tag}:record"))
                        .await?;
                    if ctx.attempt() == 1 {
                        return Err("the ledger refused the row".into());
                    }
                    Step::Done(PhaseResponse::new(
                        http::StatusCode::CREATED,
                        format!("paid {tag}"),
                    ))
                }
            })
        }
    }

    async fn pay<F>(
        fx: web::Data<F>,
        calls: web::Data<Mutex<Vec<String>>>,
        phases: IdemPhases<F::Store>,
        _req: HttpRequest,
        body: Bytes,
    ) -> Result<HttpResponse, PhasesRejection>
    where
        F: HttpFixture,
        F::Store: RecoveryStore,
    {
        let op = Payments {
            fx: fx.into_inner(),
            calls: calls.into_inner(),
        };
        let tag = String::from_utf8_lossy(&body).into_owned();
        phases.run(Pay::Charge { tag }, op).await
    }

    async fn a_failed_phase_resumes_and_the_response_replays<F>(test: &str)
    where
        F: HttpFixture,
        F::Store: RecoveryStore,
    {
        let Some(fx) = F::setup(test).await else {
            return;
        };
        let fx = web::Data::new(fx);
        let calls = web::Data::new(Mutex::new(Vec::<String>::new()));
        let idem = Idempotency::builder(fx.store()).build().expect("engine");
        let app = test::init_service(
            App::new()
                .app_data(fx.clone())
                .app_data(calls.clone())
                .service(
                    web::resource("/pay")
                        .wrap(IdempotencyMiddleware::new(
                            idem_http::IdempotencyLayer::shared_scope(idem).require_key(),
                        ))
                        .route(web::post().to(pay::<F>)),
                ),
        )
        .await;
        let post = || {
            test::TestRequest::post()
                .uri("/pay")
                .insert_header(("idempotency-key", "k-1"))
                .set_payload("t1")
                .to_request()
        };
        let failed = test::call_service(&app, post()).await;
        assert_eq!(failed.status(), 503);
        let problem: serde_json::Value =
            serde_json::from_slice(&test::read_body(failed).await).expect("a problem");
        assert_eq!(problem["code"], "phase-failed");
        assert_eq!(fx.count_effects("t1:record").await, 0, "rolled back");
        assert_eq!(fx.count_effects("t1:charge").await, 1, "committed");

        let resumed = test::call_service(&app, post()).await;
        assert_eq!(resumed.status(), 201);
        assert!(!resumed.headers().contains_key("idempotent-replayed"));
        assert_eq!(test::read_body(resumed).await, "paid t1");
        let replay = test::call_service(&app, post()).await;
        assert_eq!(replay.status(), 201);
        assert_eq!(
            replay
                .headers()
                .get("idempotent-replayed")
                .expect("the replay header"),
            "true"
        );
        assert_eq!(test::read_body(replay).await, "paid t1");
        assert_eq!(
            calls.lock().expect("the test's lock").len(),
            1,
            "the committed phase ran again"
        );
        assert_eq!(fx.count_effects("t1:charge").await, 1);
        assert_eq!(fx.count_effects("t1:record").await, 1);
        drop(app);
        if let Some(fx) = Arc::into_inner(fx.into_inner()) {
            fx.teardown().await;
        }
    }

    macro_rules! on {
        ($($name:ident: $fixture:ty),* $(,)?) => {
            $(
                #[test]
                fn $name() {
                    actix_web::rt::System::new().block_on(
                        a_failed_phase_resumes_and_the_response_replays::<$fixture>(
                            concat!(module_path!(), "::", stringify!($name)),
                        ),
                    );
                }
            )*
        };
    }

    on!(
        sqlite_a_failed_phase_resumes_and_the_response_replays: idem_testkit::http::fixtures::SqliteFx,
        postgres_a_failed_phase_resumes_and_the_response_replays: idem_testkit::http::fixtures::PgFx,
        mysql_a_failed_phase_resumes_and_the_response_replays: idem_testkit::http::fixtures::MySqlFx,
    );
}
