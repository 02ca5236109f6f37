//! The pull consumer: fetching, and recovering from a lost pull request or consumer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::{self, Batch};
use async_nats::jetstream::{self, Context};
use futures_util::{FutureExt, StreamExt};
use idem_consumer::{IdSource, Source};
use idem_core::{Error, ErrorKind};

use crate::delivery::{JetStreamDelivery, Target};
use crate::error;

/// A pull request that ends sooner than this without a message did not really wait (the
/// connection closed under it); going straight back would spin.
const MIN_PULL: Duration = Duration::from_millis(50);

/// How often a waiting `next` checks whether the client reconnected (and the server therefore
/// forgot the open pull request).
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// A durable JetStream pull consumer as an idem [`Source`].
///
/// Messages are acknowledged explicitly, one by one, only after their transaction committed
/// (or they turned out to be duplicates). Each call to [`Source::next`] keeps at most one pull
/// request open for at most the `max` messages the runner asked for, so nothing is fetched
/// ahead that would sit in memory while its ack wait runs out.
///
/// Connection loss is handled by async-nats, which reconnects by itself; a fetch that fails
/// returns [`ErrorKind::Unavailable`], and the next call issues a fresh pull request and
/// re-creates the durable consumer (same configuration) in case the server lost it.
/// Re-creating means that a consumer deleted by an operator while the source runs comes back
/// and starts from the beginning of the stream: reprocessing that the claims turn into
/// duplicates.
pub struct JetStreamSource {
    js: Context,
    config: pull::Config,
    /// `None` after an error that may mean the server no longer has the consumer.
    consumer: Option<PullConsumer>,
    /// The open pull request, kept across calls so that a `next` dropped by the runner loses
    /// nothing: what arrives later is returned by the following call.
    pull: Option<Pull>,
    pull_expires: Duration,
    target: Arc<Target>,
}

/// One open pull request.
struct Pull {
    batch: Batch,
    opened: Instant,
    received: usize,
    /// The client's connection count when the request was sent: a reconnect since then means
    /// the server has forgotten the request.
    connects: u64,
}

impl std::fmt::Debug for JetStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSource")
            .field("stream", &self.target.stream)
            .field("durable", &self.target.durable)
            .field("filter_subject", &self.config.filter_subject)
            .field("ack_wait", &self.config.ack_wait)
            .field("dead_letter_subject", &self.target.dead_letter_subject)
            .field("pull_open", &self.pull.is_some())
            .finish_non_exhaustive()
    }
}

impl JetStreamSource {
    /// A source on the durable consumer that [`JetStreamSourceBuilder::connect_with`
    /// ](crate::JetStreamSourceBuilder::connect_with) created.
    pub(crate) fn new(
        js: Context,
        config: pull::Config,
        consumer: PullConsumer,
        pull_expires: Duration,
        target: Arc<Target>,
    ) -> Self {
        Self {
            js,
            config,
            consumer: Some(consumer),
            pull: None,
            pull_expires,
            target,
        }
    }

    /// The JetStream context this source uses (to publish from the same connection).
    pub fn context(&self) -> &Context {
        &self.js
    }

    /// Where this source publishes dead letters.
    pub fn dead_letter_subject(&self) -> &str {
        self.target.dead_letter_subject.as_str()
    }

    /// Opens a pull request for up to `max` messages, re-creating the consumer if needed.
    async fn open_pull(&mut self, max: usize) -> Result<Pull, Error> {
        let consumer = match &self.consumer {
            Some(c) => c,
            None => {
                let c = self
                    .js
                    .create_consumer_on_stream(self.config.clone(), &self.target.stream)
                    .await
                    // Whatever the server said, the runner only backs off and retries.
                    .map_err(|e| error::unavailable("re-creating the consumer", e))?;
                self.consumer.insert(c)
            }
        };
        // No idle heartbeat: async-nats 0.51's `Batch` returns `Pending` after consuming one
        // without registering for the next message, which would stall delivery until the
        // request's timer fires. A pull request lost in a reconnect is detected instead by
        // watching the client's connection count (`next_or_reconnected`).
        let batch = consumer
            .batch()
            .max_messages(max)
            .expires(self.pull_expires)
            .messages()
            .await
            .map_err(|e| error::unavailable("requesting messages", e))?;
        Ok(Pull {
            batch,
            opened: Instant::now(),
            received: 0,
            connects: self.connects(),
        })
    }

    fn connects(&self) -> u64 {
        self.js
            .client()
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits for the next item of the open pull request, or `None` after a reconnect: a pull
    /// request lives on the server, so one sent before a server restart is gone, and waiting
    /// for its client-side timer would stall delivery for `pull_expires` + 5 s.
    async fn next_or_reconnected(
        &mut self,
    ) -> Option<Option<Result<jetstream::Message, async_nats::Error>>> {
        let pull = self.pull.as_mut()?;
        // Fast path without a timer: a timer that fires "now" still waits for the runtime's
        // next millisecond tick, which halved per-message throughput when it was always armed.
        if let Some(item) = pull.batch.next().now_or_never() {
            return Some(item);
        }
        let before = pull.connects;
        loop {
            let pull = self.pull.as_mut()?;
            tokio::select! {
                item = pull.batch.next() => return Some(item),
                _ = tokio::time::sleep(RECONNECT_CHECK) => {
                    if self.connects() != before {
                        return None;
                    }
                }
            }
        }
    }

    /// Forgets the pull request and the consumer handle after an error.
    fn reset(&mut self) {
        self.pull = None;
        self.consumer = None;
    }
}

impl Source for JetStreamSource {
    type Delivery = JetStreamDelivery;

    fn broker(&self) -> &'static str {
        "nats"
    }

    /// The `Nats-Msg-Id` header.
    ///
    /// It is also JetStream's publish de-duplication header, but JetStream only drops a
    /// re-publish inside the stream's duplicate window (two minutes by default) and never
    /// stops a consumer from receiving a message twice (redelivery after a crash or an ack
    /// timeout). The consumer's claim is what makes processing idempotent.
    fn default_id_source(&self) -> IdSource {
        IdSource::header(NATS_MESSAGE_ID.to_string())
    }

    async fn next(&mut self, max: usize) -> Result<Vec<JetStreamDelivery>, Error> {
        let max = max.max(1);
        loop {
            if self.pull.is_none() {
                let pull = self.open_pull(max).await?;
                self.pull = Some(pull);
            }
            let Some(item) = self.next_or_reconnected().await else {
                // Reconnected: the server lost the request. Tell the runner (one broker error,
                // logged and counted) and send a fresh request on the next call.
                self.pull = None;
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "reconnected to the NATS server; re-sending the pull request",
                ));
            };
            let Some(pull) = self.pull.as_mut() else {
                continue;
            };
            match item {
                Some(Ok(first)) => {
                    pull.received += 1;
                    let mut out = Vec::with_capacity(max.min(16));
                    out.push(JetStreamDelivery::new(first, self.target.clone()));
                    // Take what has already arrived, without waiting for more.
                    while out.len() < max {
                        match pull.batch.next().now_or_never() {
                            Some(Some(Ok(m))) => {
                                pull.received += 1;
                                out.push(JetStreamDelivery::new(m, self.target.clone()));
                            }
                            Some(Some(Err(e))) => {
                                tracing::warn!(error = %e, stream = %self.target.stream, "pull request failed; returning what arrived before");
                                self.reset();
                                break;
                            }
                            Some(None) => {
                                self.pull = None;
                                break;
                            }
                            None => break,
                        }
                    }
                    return Ok(out);
                }
                Some(Err(e)) => {
                    self.reset();
                    return Err(error::unavailable("fetching messages", e));
                }
                None => {
                    let quick = pull.received == 0 && pull.opened.elapsed() < MIN_PULL;
                    self.pull = None;
                    if quick {
                        self.consumer = None;
                        return Err(Error::new(
                            ErrorKind::Unavailable,
                            "the NATS pull request ended at once; is the connection closed?",
                        ));
                    }
                }
            }
        }
    }

    async fn close(mut self) -> Result<(), Error> {
        // Messages that arrived but were never handed out go back now rather than after
        // their ack wait.
        if let Some(mut pull) = self.pull.take() {
            while let Some(Some(Ok(m))) = pull.batch.next().now_or_never() {
                let _ = m.ack_with(jetstream::AckKind::Nak(None)).await;
            }
        }
        self.js
            .client()
            .flush()
            .await
            .map_err(|e| error::unavailable("flushing", e))
    }
}
