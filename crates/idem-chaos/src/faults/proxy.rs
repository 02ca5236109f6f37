//! A TCP proxy between the consumers and PostgreSQL that cuts connections around COMMIT, so a
//! consumer sees what a network failure at the worst moment looks like: its COMMIT sent and no
//! answer, outcome unknown.
//!
//! It reads the frontend side of the PostgreSQL wire protocol (an untyped start-up message,
//! then `type, length, body` frames) and spots a COMMIT in a simple query (`Q`) or in the Bind
//! (`B`) of a statement prepared from one (`P`). When it decides to cut (a seeded coin per COMMIT while armed), it does one of two
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
use rand::{Rng, SeedableRng};
// ChaCha8: a stream fixed by its specification, so a seed replays the same cuts after a
// `rand` update (`StdRng` may change algorithm in any release).
use rand_chacha::ChaCha8Rng;
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
                let rng = ChaCha8Rng::seed_from_u64(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let upstream = upstream.clone();
                let state = shared.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await
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
    mut rng: ChaCha8Rng,
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
        // Set once a COMMIT sent in the extended protocol is to be cut after delivery: its
        // Execute and Sync still have to reach the server.
        let mut cutting_after = false;
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => n,
            };
            parser.push(&buf[..n]);
            while let Some((frame, kind)) = parser.next_frame() {
                let mut cut_now = None;
                if cutting_after {
                    if kind == Frame::Sync {
                        cut_now = Some(Cut::After);
                    }
                } else if kind == Frame::Commit {
                    state.commits_seen.fetch_add(1, Ordering::SeqCst);
                    if state.armed.load(Ordering::SeqCst) && rng.gen_bool(share) {
                        if rng.gen_bool(0.5) {
                            state.cuts_before.fetch_add(1, Ordering::SeqCst);
                            return Some(Cut::Before);
                        }
                        withhold.store(true, Ordering::SeqCst);
                        if frame[0] == b'Q' {
                            cut_now = Some(Cut::After);
                        } else {
                            cutting_after = true;
                        }
                    }
                }
                if to_server.write_all(&frame).await.is_err() {
                    return None;
                }
                if let Some(cut) = cut_now {
                    state.cuts_after.fetch_add(1, Ordering::SeqCst);
                    return Some(cut);
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

/// What a frontend message means to the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// Runs a COMMIT: a simple query, or a Bind of a statement parsed from COMMIT.
    Commit,
    /// Ends an extended-protocol exchange: the server answers from here.
    Sync,
    Other,
}

/// Splits the frontend byte stream into whole messages, and remembers which prepared
/// statements are a COMMIT: sqlx parses `COMMIT` once per connection and from then on only
/// binds and executes the statement by name.
#[derive(Debug, Default)]
struct Frontend {
    buf: Vec<u8>,
    /// Past the start-up message: frames are typed.
    started: bool,
    commit_statements: std::collections::HashSet<Vec<u8>>,
}

impl Frontend {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole message and what it is.
    fn next_frame(&mut self) -> Option<(Vec<u8>, Frame)> {
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
            return Some((frame, Frame::Other));
        }
        if self.buf.len() < 5 {
            return None;
        }
        let len = i32::from_be_bytes(self.buf[1..5].try_into().ok()?) as usize;
        if self.buf.len() < 1 + len {
            return None;
        }
        let frame: Vec<u8> = self.buf.drain(..1 + len).collect();
        let body = &frame[5..];
        let kind = match frame[0] {
            b'Q' if is_commit_sql(body) => Frame::Commit,
            b'S' => Frame::Sync,
            // Parse: statement name, NUL, query, NUL, …
            b'P' => {
                if let Some((name, rest)) = cstr(body) {
                    if is_commit_sql(rest) {
                        self.commit_statements.insert(name.to_vec());
                    } else {
                        self.commit_statements.remove(name);
                    }
                }
                Frame::Other
            }
            // Bind: portal name, NUL, statement name, NUL, …
            b'B' => match cstr(body).and_then(|(_, rest)| cstr(rest)) {
                Some((statement, _)) if self.commit_statements.contains(statement) => Frame::Commit,
                _ => Frame::Other,
            },
            _ => Frame::Other,
        };
        Some((frame, kind))
    }
}

/// Splits a NUL-terminated string off the front of `bytes`.
fn cstr(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = bytes.iter().position(|b| *b == 0)?;
    Some((&bytes[..end], &bytes[end + 1..]))
}

/// Whether any statement of `sql` (up to its NUL) is a COMMIT: idem's PostgreSQL store sends
/// `SELECT 1; COMMIT` in one simple query (the aborted-transaction check rides along).
fn is_commit_sql(sql: &[u8]) -> bool {
    let end = sql.iter().position(|b| *b == 0).unwrap_or(sql.len());
    let text = String::from_utf8_lossy(&sql[..end]);
    text.split(';').any(|statement| {
        let word = statement
            .trim_start()
            .split(|c: char| !c.is_ascii_alphabetic())
            .next();
        word.is_some_and(|w| w.eq_ignore_ascii_case("commit") || w.eq_ignore_ascii_case("end"))
    })
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
    fn finds_commit_in_simple_queries_and_bound_statements_split_anywhere() {
        use Frame::{Commit, Other, Sync};
        let mut stream = untyped(80_877_103, b"");
        stream.extend(untyped(196_608, b"user\0postgres\0\0"));
        stream.extend(typed(b'Q', b"BEGIN\0"));
        stream.extend(typed(b'P', b"s1\0INSERT INTO t VALUES ($1)\0\0\0"));
        stream.extend(typed(b'Q', b"  commit\0"));
        stream.extend(typed(b'P', b"s2\0COMMIT\0\0\0"));
        stream.extend(typed(b'B', b"\0s2\0\0\0\0\0\0\0"));
        stream.extend(typed(b'E', b"\0\0\0\0\0"));
        stream.extend(typed(b'S', b""));
        stream.extend(typed(b'B', b"\0s1\0\0\0\0\0\0\0"));
        stream.extend(typed(b'B', b"\0s2\0\0\0\0\0\0\0"));
        stream.extend(typed(b'Q', b"COMMITTED_AT\0"));
        stream.extend(typed(b'Q', b"SELECT 1; COMMIT\0"));
        let expect = [
            Other, Other, Other, Other, Commit, Other, Commit, Other, Sync, Other, Commit, Other,
            Commit,
        ];
        for split in [1, 3, 7, stream.len()] {
            let mut p = Frontend::default();
            let mut kinds = Vec::new();
            for chunk in stream.chunks(split) {
                p.push(chunk);
                while let Some((_, kind)) = p.next_frame() {
                    kinds.push(kind);
                }
            }
            assert_eq!(kinds, expect, "split {split}");
        }
    }
}
