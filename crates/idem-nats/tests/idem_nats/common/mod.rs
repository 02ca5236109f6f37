//! Shared by the adapter tests and the conformance fixture: an isolated stream and its
//! dead-letter stream on the real server.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, Context};
use futures_util::StreamExt;
use idem_nats::NatsProducer;

/// The test streams' duplicate window.
pub const DUPLICATE_WINDOW: Duration = Duration::from_millis(100);

/// A stream `<name>` capturing `<name>.in`, and `<name>_dlq` capturing `<name>.dead-letter`
/// (the source's default dead-letter subject).
pub struct Streams {
    pub url: String,
    pub js: Context,
    pub producer: NatsProducer,
    pub stream: String,
    pub subject: String,
    pub dlq_stream: String,
    pub dead_letter_subject: String,
    deleted: bool,
}

impl Streams {
    pub async fn create(url: String, name: String) -> Self {
        let client = async_nats::connect(&url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let subject = format!("{name}.in");
        let dead_letter_subject = format!("{name}.dead-letter");
        let dlq_stream = format!("{name}_dlq");
        // JetStream drops a re-published ID inside the stream's duplicate window (two minutes
        // by default). Producers that retry later than that are what idem is for, so the
        // window is kept short and `publish_again_later` waits it out.
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await
        .expect("create stream");
        idem_nats::ensure_stream(&js, &dlq_stream, &[dead_letter_subject.as_str()])
            .await
            .expect("create dead-letter stream");
        Self {
            url,
            producer: NatsProducer::new(js.clone()),
            js,
            stream: name,
            subject,
            dlq_stream,
            dead_letter_subject,
            deleted: false,
        }
    }

    /// Publishes with the adapter's helper; a message JetStream drops as a duplicate is
    /// published again once the duplicate window has passed, as a producer retrying late
    /// would, so that the consumer really receives it twice.
    pub async fn publish_again_later(&self, id: &str, payload: &[u8]) {
        self.try_publish_again_later(id.as_bytes(), payload)
            .await
            .expect("publish");
    }

    /// [`publish_again_later`](Self::publish_again_later), returning the helper's refusal.
    pub async fn try_publish_again_later(
        &self,
        id: &[u8],
        payload: &[u8],
    ) -> Result<(), idem_core::Error> {
        loop {
            let ack = self
                .producer
                .publish(self.subject.clone(), id, payload.to_vec())
                .await?;
            if !ack.duplicate {
                return Ok(());
            }
            tokio::time::sleep(DUPLICATE_WINDOW).await;
        }
    }

    /// Up to `n` messages of `stream`, from its start, waiting at most `timeout` for them.
    pub async fn read(&self, stream: &str, n: usize, timeout: Duration) -> Vec<jetstream::Message> {
        let stream = self.js.get_stream(stream).await.expect("get stream");
        let consumer = stream
            .create_consumer(pull::Config {
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("create reader");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left < Duration::from_millis(100) {
                break;
            }
            let mut batch = consumer
                .batch()
                .max_messages(n - out.len())
                .expires(left)
                .messages()
                .await
                .expect("pull");
            while let Some(m) = batch.next().await {
                out.push(m.expect("message"));
            }
        }
        out
    }

    pub async fn delete(mut self) {
        delete_streams(&self.js, [&self.stream, &self.dlq_stream]).await;
        self.deleted = true;
    }
}

async fn delete_streams(js: &Context, names: [&String; 2]) {
    for s in names {
        if let Err(e) = js.delete_stream(s).await {
            eprintln!("deleting stream {s}: {e}");
        }
    }
}

impl Drop for Streams {
    /// A test that panics never reaches its teardown; its streams are removed here instead,
    /// on a runtime of its own because the test's may be gone.
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let url = self.url.clone();
        let names = [self.stream.clone(), self.dlq_stream.clone()];
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(client) = async_nats::connect(&url).await {
                    delete_streams(&jetstream::new(client), [&names[0], &names[1]]).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}
