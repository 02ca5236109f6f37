//! A TCP proxy between the consumers and PostgreSQL that cuts connections around COMMIT, so a
//! consumer sees what a network failure at the worst moment looks like: its COMMIT sent and no
//! answer, outcome unknown.
//!
//! It reads the frontend side of the PostgreSQL wire protocol (an untyped start-up message,
//! then `type, length, body` frames) and spots a COMMIT in a simple query (`Q`) or a parse
//! (`P`). When it decides to cut (a seeded coin per COMMIT while armed), it does one of two
//! things, half the time each:
//! - **before**: drops the connection without forwarding the COMMIT: the server rolls back;
//! - **after**: forwards the COMMIT, withholds the server's answer, then drops the
//!   connection: the server committed and the consumer cannot know.
//!
//! TLS would hide the protocol; the run's URLs say `sslmode=disable`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// SSLRequest and GSSENCRequest: answered with one byte, then the start-up follows, untyped.
const NEGOTIATION_CODES: [i32; 2] = [80_877_103, 80_877_104];

/// Counters and switches shared with the run.
#[derive(Debug, Default)]
pub(crate) struct ProxyState {
    armed: AtomicBool,
    /// Cuts with the COMMIT withheld from the server.
    pub(crate) cuts_before: AtomicU64,
    /// Cuts with the COMMIT delivered and its answer withheld.
    pub(crate) cuts_after: AtomicU64,
    pub(crate) commits_seen: AtomicU64,
    pub(crate) connections: AtomicU64,
}

impl ProxyState {
    pub(crate) fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    pub(crate) fn cuts(&self) -> u64 {
        self.cuts_before.load(Ordering::SeqCst) + self.cuts_after.load(Ordering::SeqCst)
    }
}

/// A running proxy: listens on `port`, forwards to `upstream`.
#[derive(Debug)]
pub(crate) struct CutProxy {
    pub(crate) port: u16,
    pub(crate) state: Arc<ProxyState>,
    task: tokio::task::JoinHandle<()>,
}

impl CutProxy {
    /// Starts the proxy on an ephemeral loopback port. `share` is the probability of a cut
    /// per COMMIT while armed; `seed` makes the decisions reproducible per connection.
    pub(crate) async fn start(upstream: (String, u16), share: f64, seed: u64) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(ProxyState::default());
        let shared = state.clone();
        let task = tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                n += 1;
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let rng = StdRng::seed_from_u64(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let upstream = upstream.clone();
                let state = shared.clone();
                tokio::spawn(async move {
                    if let Ok(server) =
                        TcpStream::connect((upstream.0.as_str(), upstream.1)).await
                    {
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        relay(client, server, state, rng, share).await;
                    }
                });
            }
        });
        Ok(Self { port, state, task })
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How a COMMIT is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    Before,
    After,
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    state: Arc<ProxyState>,
    mut rng: StdRng,
    share: f64,
) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    // Set before a COMMIT that will be cut after delivery: the answer must never reach the
    // client, so the server-to-client half checks it before every write.
    let withhold = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(tokio::sync::Notify::new());

    let hold = withhold.clone();
    let answer = answered.clone();
    let downstream = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if hold.load(Ordering::SeqCst) {
                answer.notify_one();
                return;
            }
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };

    let upstream = async move {
        let mut parser = Frontend::default();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => n,
            };
            parser.push(&buf[..n]);
            while let Some((frame, is_commit)) = parser.next_frame() {
                if is_commit {
                    state.commits_seen.fetch_add(1, Ordering::SeqCst);
                    if state.armed.load(Ordering::SeqCst) && rng.gen_bool(share) {
                        let cut = if rng.gen_bool(0.5) { Cut::Before } else { Cut::After };
                        if cut == Cut::After {
                            withhold.store(true, Ordering::SeqCst);
                            if to_server.write_all(&frame).await.is_err() {
                                return None;
                            }
                            state.cuts_after.fetch_add(1, Ordering::SeqCst);
                        } else {
                            state.cuts_before.fetch_add(1, Ordering::SeqCst);
                        }
                        return Some(cut);
                    }
                }
                if to_server.write_all(&frame).await.is_err() {
                    return None;
                }
            }
        }
    };

    tokio::pin!(downstream);
    tokio::select! {
        _ = &mut downstream => {}
        cut = upstream => {
            if cut == Some(Cut::After) {
                // Let the server finish the COMMIT (its answer arrives and is dropped), so the
                // cut lands between "committed" and "the client knows".
                let _ = tokio::time::timeout(Duration::from_secs(2), answered.notified()).await;
            }
        }
    }
    // Dropping both halves of both sockets closes the connections.
}

/// Splits the frontend byte stream into whole messages.
#[derive(Debug, Default)]
struct Frontend {
    buf: Vec<u8>,
    /// Past the start-up message: frames are typed.
    started: bool,
}

impl Frontend {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole message and whether it is a COMMIT.
    fn next_frame(&mut self) -> Option<(Vec<u8>, bool)> {
        if !self.started {
            if self.buf.len() < 8 {
                return None;
            }
            let len = i32::from_be_bytes(self.buf[0..4].try_into().ok()?) as usize;
            let code = i32::from_be_bytes(self.buf[4..8].try_into().ok()?);
            if self.buf.len() < len.max(8) {
                return None;
            }
            if !NEGOTIATION_CODES.contains(&code) {
                self.started = true;
            }
            let frame: Vec<u8> = self.buf.drain(..len.max(8)).collect();
            return Some((frame, false));
        }
        if self.buf.len() < 5 {
            return None;
        }
        let len = i32::from_be_bytes(self.buf[1..5].try_into().ok()?) as usize;
        if self.buf.len() < 1 + len {
            return None;
        }
        let frame: Vec<u8> = self.buf.drain(..1 + len).collect();
        let is_commit = match frame[0] {
            b'Q' => is_commit_sql(&frame[5..]),
            // Parse: statement name, NUL, query, NUL, …
            b'P' => frame[5..]
                .iter()
                .position(|b| *b == 0)
                .is_some_and(|end| is_commit_sql(&frame[5 + end + 1..])),
            _ => false,
        };
        Some((frame, is_commit))
    }
}

fn is_commit_sql(sql: &[u8]) -> bool {
    let end = sql.iter().position(|b| *b == 0).unwrap_or(sql.len());
    let text = String::from_utf8_lossy(&sql[..end]);
    let word = text.trim_start().split(|c: char| !c.is_ascii_alphabetic()).next();
    word.is_some_and(|w| w.eq_ignore_ascii_case("commit") || w.eq_ignore_ascii_case("end"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn untyped(code: i32, rest: &[u8]) -> Vec<u8> {
        let mut f = ((rest.len() + 8) as i32).to_be_bytes().to_vec();
        f.extend_from_slice(&code.to_be_bytes());
        f.extend_from_slice(rest);
        f
    }

    #[test]
    fn finds_commit_in_simple_and_extended_queries_split_anywhere() {
        let mut stream = untyped(80_877_103, b"");
        stream.extend(untyped(196_608, b"user\0postgres\0\0"));
        stream.extend(typed(b'Q', b"BEGIN\0"));
        stream.extend(typed(b'P', b"\0INSERT INTO t VALUES ($1)\0\0\0"));
        stream.extend(typed(b'Q', b"  commit\0"));
        stream.extend(typed(b'P', b"s1\0COMMIT\0\0\0"));
        stream.extend(typed(b'Q', b"COMMITTED_AT\0"));
        for split in [1, 3, 7, stream.len()] {
            let mut p = Frontend::default();
            let mut commits = Vec::new();
            let mut frames = 0;
            for chunk in stream.chunks(split) {
                p.push(chunk);
                while let Some((_, c)) = p.next_frame() {
                    frames += 1;
                    commits.push(c);
                }
            }
            assert_eq!(frames, 7, "split {split}");
            assert_eq!(
                commits,
                [false, false, false, false, true, true, false],
                "split {split}"
            );
        }
    }
}
