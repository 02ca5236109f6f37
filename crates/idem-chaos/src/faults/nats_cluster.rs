//! A 3-node JetStream cluster of the harness's own on loopback ports, for broker restarts: one
//! node at a time is killed and brought back on its store, while R3 streams keep a quorum.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

/// One node: its client and route ports, its store, its process.
#[derive(Debug)]
struct Node {
    name: String,
    client_port: u16,
    route_port: u16,
    /// HTTP monitoring, for `/healthz`.
    monitor_port: u16,
    store: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// The cluster. Dropping it kills every node.
#[derive(Debug)]
pub(crate) struct NatsCluster {
    binary: String,
    nodes: Vec<Node>,
    restarts: u64,
}

impl NatsCluster {
    /// Starts three nodes with stores and logs under `dir`, and waits until JetStream has a
    /// leader (a stream can be created).
    pub(crate) async fn start(binary: &str, dir: &std::path::Path) -> Result<Self> {
        let mut nodes = Vec::new();
        for i in 0..3 {
            nodes.push(Node {
                name: format!("chaos-n{i}"),
                client_port: free_port()?,
                route_port: free_port()?,
                monitor_port: free_port()?,
                store: dir.join(format!("n{i}")),
                log: dir.join(format!("nats-n{i}.log")),
                child: None,
            });
        }
        let mut cluster = Self {
            binary: binary.to_owned(),
            nodes,
            restarts: 0,
        };
        for i in 0..3 {
            cluster.spawn(i)?;
        }
        cluster.wait_for_meta_leader().await?;
        Ok(cluster)
    }

    /// The client URL naming every node, for the consumers and the publisher.
    pub(crate) fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub(crate) fn restarts(&self) -> u64 {
        self.restarts
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("nats://127.0.0.1:{}", n.route_port))
            .collect();
        let node = &mut self.nodes[i];
        std::fs::create_dir_all(&node.store)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)?;
        let child = Command::new(&self.binary)
            .args(["-a", "127.0.0.1", "-p", &node.client_port.to_string()])
            .args(["-n", &node.name, "-js", "-sd"])
            .arg(&node.store)
            .args(["-m", &node.monitor_port.to_string()])
            .args(["--cluster_name", "idem-chaos"])
            .args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", node.route_port),
            ])
            .args(["--routes", &routes.join(",")])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} (--nats-server)", self.binary))?;
        node.child = Some(child);
        Ok(())
    }

    /// Kills node `i` with SIGKILL, waits `down`, starts it again on its store.
    pub(crate) async fn restart_node(&mut self, i: usize, down: Duration) -> Result<()> {
        let i = i % self.nodes.len();
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        tokio::time::sleep(down).await;
        self.spawn(i)?;
        self.restarts += 1;
        // A rolling restart waits for the node to catch up before the next one goes down;
        // without that two nodes can be behind at once and the R3 streams lose their quorum.
        self.wait_healthy(i, Duration::from_secs(60)).await
    }

    /// Waits until node `i` says on `/healthz` that its JetStream is current.
    async fn wait_healthy(&self, i: usize, timeout: Duration) -> Result<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let port = self.nodes[i].monitor_port;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut reply = String::new();
            if let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                let request = "GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
                if conn.write_all(request.as_bytes()).await.is_ok() {
                    let _ = conn.read_to_string(&mut reply).await;
                }
            }
            if reply.starts_with("HTTP/1.0 200") || reply.starts_with("HTTP/1.1 200") {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "NATS node {} not healthy {timeout:?} after its restart: {}",
                    self.nodes[i].name,
                    reply.lines().last().unwrap_or("no answer")
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn wait_for_meta_leader(&self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            // Ready means an R3 stream can be placed, which needs a leader and all peers.
            let probe = idem_nats::async_nats::jetstream::stream::Config {
                name: "idem-chaos-probe".into(),
                subjects: vec!["idem-chaos-probe".into()],
                num_replicas: 3,
                ..Default::default()
            };
            let last = match crate::broker::nats(&self.url()).await {
                Ok(js) => match js.get_or_create_stream(probe).await {
                    Ok(_) => {
                        let _ = js.delete_stream("idem-chaos-probe").await;
                        return Ok(());
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => format!("{e:#}"),
            };
            if tokio::time::Instant::now() > deadline {
                bail!("the NATS cluster elected no JetStream leader within 30 s: {last}");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
