//! Shared by the binary's tests: an isolated database per test on each store, the real server
//! as a child process on a loopback port, and a real HTTP client.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_testkit::{service_url, services, unique_name};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_http-payments");

/// Which store a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    Sqlite,
    Postgres,
    MySql,
    Redis,
}

/// A database of the test's own, and how to count the charges in it.
pub(crate) struct TestDb {
    pub(crate) store: Store,
    /// `--database` and, for Redis, `--ledger`.
    pub(crate) args: Vec<String>,
    /// Where the charges are (the ledger).
    ledger_url: String,
    cleanup: Option<(String, String)>,
    dir: PathBuf,
}

impl TestDb {
    /// `None` (after a `SKIPPING` line) when the store's service is not configured.
    pub(crate) async fn new(store: Store, test: &str) -> Option<Self> {
        let name = unique_name("httppay", test);
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let sqlite = format!("sqlite:{}", dir.join("ledger.db").display());
        let (args, ledger_url, cleanup) = match store {
            Store::Sqlite => (vec!["--database".to_owned(), sqlite.clone()], sqlite, None),
            Store::Postgres => {
                let base = service_url(services::POSTGRES, test)?;
                let admin = sqlx::PgPool::connect(&base)
                    .await
                    .expect("connect PostgreSQL");
                sqlx::query(&format!("CREATE SCHEMA {name}"))
                    .execute(&admin)
                    .await
                    .expect("create schema");
                admin.close().await;
                let mut url = url::Url::parse(&base).expect("IDEM_TEST_POSTGRES_URL is a URL");
                url.query_pairs_mut()
                    .append_pair("options", &format!("-c search_path={name}"));
                let url = url.to_string();
                (
                    vec!["--database".to_owned(), url.clone()],
                    url,
                    Some((base, format!("DROP SCHEMA {name} CASCADE"))),
                )
            }
            Store::MySql => {
                let base = service_url(services::MYSQL, test)?;
                let admin = sqlx::MySqlPool::connect(&base)
                    .await
                    .expect("connect MySQL");
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&admin)
                    .await
                    .expect("create database");
                admin.close().await;
                let mut url = url::Url::parse(&base).expect("IDEM_TEST_MYSQL_URL is a URL");
                url.set_path(&name);
                let url = url.to_string();
                (
                    vec!["--database".to_owned(), url.clone()],
                    url,
                    Some((base, format!("DROP DATABASE {name}"))),
                )
            }
            Store::Redis => {
                let redis = service_url(services::REDIS, test)?;
                // Records are scoped by principal and every test's principals are its own,
                // so tests share the key space safely; the ledger is the test's own file.
                (
                    vec![
                        "--database".to_owned(),
                        redis,
                        "--ledger".to_owned(),
                        sqlite.clone(),
                    ],
                    sqlite,
                    None,
                )
            }
        };
        Some(Self {
            store,
            args,
            ledger_url,
            cleanup,
            dir,
        })
    }

    /// The URL of the database holding the charges.
    pub(crate) fn ledger_url(&self) -> &str {
        &self.ledger_url
    }

    /// Charges made with bearer token `token`, as committed (stored under its digest).
    pub(crate) async fn count_charges(&self, token: &str) -> i64 {
        self.count_rows_of(&principal_of(token)).await
    }

    /// Rows whose `principal` column is `principal`, byte for byte.
    pub(crate) async fn count_rows_of(&self, principal: &str) -> i64 {
        let sql = match self.store {
            Store::Postgres => "SELECT count(*) FROM charges WHERE principal = $1",
            _ => "SELECT count(*) FROM charges WHERE principal = ?",
        };
        match self.store {
            Store::Postgres => {
                let pool = sqlx::PgPool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let n = sqlx::query_scalar(sql)
                    .bind(principal)
                    .fetch_one(&pool)
                    .await
                    .expect(sql);
                pool.close().await;
                n
            }
            Store::MySql => {
                let pool = sqlx::MySqlPool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let n = sqlx::query_scalar(sql)
                    .bind(principal)
                    .fetch_one(&pool)
                    .await
                    .expect(sql);
                pool.close().await;
                n
            }
            Store::Sqlite | Store::Redis => {
                let pool = sqlx::SqlitePool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let n = sqlx::query_scalar(sql)
                    .bind(principal)
                    .fetch_one(&pool)
                    .await
                    .expect(sql);
                pool.close().await;
                n
            }
        }
    }

    /// The outbox's rows, in enqueue order: each row's message ID and whether it is marked
    /// sent.
    pub(crate) async fn outbox(&self) -> Vec<(Vec<u8>, bool)> {
        // Two queries of IDs only: `sent_at`'s type differs between engines.
        const ALL: &str = "SELECT message_id FROM idem_outbox ORDER BY seq";
        const SENT: &str = "SELECT message_id FROM idem_outbox WHERE sent_at IS NOT NULL";
        let (all, sent): (Vec<Vec<u8>>, Vec<Vec<u8>>) = match self.store {
            Store::Postgres => {
                let pool = sqlx::PgPool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let all = sqlx::query_scalar(ALL).fetch_all(&pool).await.expect(ALL);
                let sent = sqlx::query_scalar(SENT).fetch_all(&pool).await.expect(SENT);
                pool.close().await;
                (all, sent)
            }
            Store::MySql => {
                let pool = sqlx::MySqlPool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let all = sqlx::query_scalar(ALL).fetch_all(&pool).await.expect(ALL);
                let sent = sqlx::query_scalar(SENT).fetch_all(&pool).await.expect(SENT);
                pool.close().await;
                (all, sent)
            }
            Store::Sqlite | Store::Redis => {
                let pool = sqlx::SqlitePool::connect(&self.ledger_url)
                    .await
                    .expect("connect");
                let all = sqlx::query_scalar(ALL).fetch_all(&pool).await.expect(ALL);
                let sent = sqlx::query_scalar(SENT).fetch_all(&pool).await.expect(SENT);
                pool.close().await;
                (all, sent)
            }
        };
        all.into_iter()
            .map(|id| {
                let marked = sent.contains(&id);
                (id, marked)
            })
            .collect()
    }

    /// Drops the test's schema or database and removes its files.
    pub(crate) async fn teardown(self) {
        if let Some((base, ddl)) = &self.cleanup {
            match self.store {
                Store::Postgres => {
                    let pool = sqlx::PgPool::connect(base).await.expect("connect");
                    sqlx::query(ddl).execute(&pool).await.expect(ddl);
                    pool.close().await;
                }
                Store::MySql => {
                    let pool = sqlx::MySqlPool::connect(base).await.expect("connect");
                    sqlx::query(ddl).execute(&pool).await.expect(ddl);
                    pool.close().await;
                }
                _ => {}
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The real binary, serving on a free loopback port.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts the server on `db` with `extra` flags and waits for its `listening` line.
    pub(crate) fn start(db: &TestDb, extra: &[&str]) -> Self {
        // Test records on a shared Redis expire in minutes, not the default day.
        let ttl: &[&str] = if extra.contains(&"--ttl") {
            &[]
        } else {
            &["--ttl", "10m"]
        };
        let mut child = Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(ttl)
            .args(&db.args)
            .args(extra)
            .env("RUST_LOG", "debug,sqlx=warn,hyper=info,h2=info,redis=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start http-payments");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut tx = Some(tx);
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if line.contains("listening")
                        && let Some(addr) = line
                            .split_whitespace()
                            .find_map(|w| w.strip_prefix("addr="))
                        && let Some(tx) = tx.take()
                    {
                        let _ = tx.send(addr.to_owned());
                    }
                    log.lock().expect("log").push(line);
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(200));
                panic!("server did not start: {:#?}", log.lock().expect("log"));
            }
        };
        Self {
            child,
            base: format!("http://{addr}"),
            log,
        }
    }

    /// Its log so far.
    pub(crate) fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    /// SIGKILL: the process dies at once, mid-request, without running any cleanup.
    pub(crate) fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status.
    pub(crate) fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("no exit 20 s after SIGTERM: {:#?}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `code` of a problem+json answer.
    pub(crate) fn problem_code(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
}

/// One `POST /charges`.
pub(crate) struct Post<'a> {
    pub(crate) token: Option<&'a str>,
    pub(crate) key: Option<&'a str>,
    pub(crate) body: &'a str,
    pub(crate) sleep_ms: Option<u64>,
    /// `X-Test-Work-Ms`: the handler sleeps this long *before* writing the charge.
    pub(crate) work_ms: Option<u64>,
}

impl<'a> Post<'a> {
    pub(crate) fn new(token: &'a str, key: &'a str, body: &'a str) -> Self {
        Self {
            token: Some(token),
            key: Some(key),
            body,
            sleep_ms: None,
            work_ms: None,
        }
    }
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

pub(crate) async fn post(
    client: &reqwest::Client,
    base: &str,
    p: &Post<'_>,
) -> reqwest::Result<Answer> {
    let mut req = client
        .post(format!("{base}/charges"))
        .header("content-type", "application/json")
        .body(p.body.to_owned());
    if let Some(t) = p.token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(k) = p.key {
        req = req.header("idempotency-key", k);
    }
    if let Some(ms) = p.sleep_ms {
        req = req.header("x-test-sleep-ms", ms.to_string());
    }
    if let Some(ms) = p.work_ms {
        req = req.header("x-test-work-ms", ms.to_string());
    }
    let resp = req.send().await?;
    read(resp).await
}

pub(crate) async fn get(client: &reqwest::Client, base: &str, token: &str, path: &str) -> Answer {
    let resp = client
        .get(format!("{base}{path}"))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .expect("GET");
    read(resp).await.expect("read")
}

async fn read(resp: reqwest::Response) -> reqwest::Result<Answer> {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// What the service stores as the principal of bearer token `token`: a digest, never the
/// token.
pub(crate) fn principal_of(token: &str) -> String {
    idem_core::RequestScope::new(["http-payments/principal", token]).to_hex()
}

/// A principal (bearer token) no other test uses.
pub(crate) fn token(test: &str) -> String {
    unique_name("tok", test)
}
