//! A gRPC service behind the layer, written by hand (no protoc): `idem.test.Charges` with a
//! unary `Charge` (writes its effect through `IdemTx`, answers the execution's number, or the
//! `Status` its request asks for) and a server-streaming `Watch` (three messages, saying
//! whether the layer made it an idempotent execution). The client is tonic's, in process.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::uri::PathAndQuery;
use idem_http::IdemTx;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::Service;

use idem_testkit::http::HttpFixture;
use idem_testkit::http::SuiteApp as AppState;

pub(crate) const CHARGE: &str = "/idem.test.Charges/Charge";
pub(crate) const WATCH: &str = "/idem.test.Charges/Watch";

/// `message ChargeRequest { string effect = 1; int32 fail_with = 2; }`
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ChargeRequest {
    #[prost(string, tag = "1")]
    pub(crate) effect: String,
    /// A gRPC status code to answer with after writing the effect; 0 answers the reply.
    #[prost(int32, tag = "2")]
    pub(crate) fail_with: i32,
}

/// `message ChargeReply { uint64 execution = 1; string effect = 2; }`
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ChargeReply {
    #[prost(uint64, tag = "1")]
    pub(crate) execution: u64,
    #[prost(string, tag = "2")]
    pub(crate) effect: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The server: routes by path to tonic's unary and server-streaming handling.
pub(crate) struct Charges<F> {
    pub(crate) app: Arc<AppState<F>>,
}

impl<F> Clone for Charges<F> {
    fn clone(&self) -> Self {
        Self {
            app: Arc::clone(&self.app),
        }
    }
}

impl<F, B> Service<http::Request<B>> for Charges<F>
where
    F: HttpFixture + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<idem_core::BoxError> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let app = Arc::clone(&self.app);
        Box::pin(async move {
            let path = req.uri().path().to_owned();
            Ok(match path.as_str() {
                CHARGE => {
                    let codec = ProstCodec::<ChargeReply, ChargeRequest>::default();
                    tonic::server::Grpc::new(codec)
                        .unary(Charge(app), req)
                        .await
                }
                WATCH => {
                    let codec = ProstCodec::<ChargeReply, ChargeRequest>::default();
                    tonic::server::Grpc::new(codec)
                        .server_streaming(Watch::<F>(std::marker::PhantomData), req)
                        .await
                }
                _ => Status::unimplemented(path).into_http(),
            })
        })
    }
}

struct Charge<F>(Arc<AppState<F>>);

impl<F: HttpFixture + 'static> Service<tonic::Request<ChargeRequest>> for Charge<F> {
    type Response = tonic::Response<ChargeReply>;
    type Error = Status;
    type Future = BoxFuture<Result<Self::Response, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::Request<ChargeRequest>) -> Self::Future {
        let app = Arc::clone(&self.0);
        Box::pin(async move {
            let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
            let tx = IdemTx::<F::Store>::take(request.extensions()).ok();
            let order = request.into_inner();
            if let Some(mut tx) = tx {
                app.fx
                    .record_effect(&mut tx, &order.effect)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
            }
            if order.fail_with != 0 {
                return Err(Status::new(
                    Code::from_i32(order.fail_with),
                    format!("failed as asked, execution {n}"),
                ));
            }
            Ok(tonic::Response::new(ChargeReply {
                execution: n,
                effect: order.effect,
            }))
        })
    }
}

struct Watch<F>(std::marker::PhantomData<fn() -> F>);

type Replies = futures_util::stream::Iter<std::vec::IntoIter<Result<ChargeReply, Status>>>;

impl<F: HttpFixture + 'static> Service<tonic::Request<ChargeRequest>> for Watch<F> {
    type Response = tonic::Response<Replies>;
    type Error = Status;
    type Future = BoxFuture<Result<Self::Response, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::Request<ChargeRequest>) -> Self::Future {
        let idempotent = IdemTx::<F::Store>::is_available(request.extensions());
        Box::pin(async move {
            let effect = if idempotent {
                "recorded"
            } else {
                "passed-through"
            };
            let replies: Vec<_> = (1..=3)
                .map(|execution| {
                    Ok(ChargeReply {
                        execution,
                        effect: effect.to_owned(),
                    })
                })
                .collect();
            Ok(tonic::Response::new(futures_util::stream::iter(replies)))
        })
    }
}

/// A unary `Charge` as `principal` with `key` (in the `idempotency-key` metadata).
pub(crate) fn charge_request(
    key: &str,
    principal: &str,
    order: ChargeRequest,
) -> tonic::Request<ChargeRequest> {
    let mut request = tonic::Request::new(order);
    let metadata = request.metadata_mut();
    metadata.insert("idempotency-key", key.parse().expect("ascii key"));
    metadata.insert("x-principal", principal.parse().expect("ascii principal"));
    request
}

pub(crate) fn charge_path() -> PathAndQuery {
    PathAndQuery::from_static(CHARGE)
}

pub(crate) fn watch_path() -> PathAndQuery {
    PathAndQuery::from_static(WATCH)
}

pub(crate) fn client_codec() -> ProstCodec<ChargeRequest, ChargeReply> {
    ProstCodec::default()
}
