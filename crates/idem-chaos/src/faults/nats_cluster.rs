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
            .args(["--cluster_name", "idem-chaos"])
            .args(["--cluster", &format!("nats://127.0.0.1:{}", node.route_port)])
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
        Ok(())
    }

    async fn wait_for_meta_leader(&self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(client) = idem_nats::async_nats::connect(self.url()).await {
                let js = idem_nats::async_nats::jetstream::new(client);
                if js.query_account().await.is_ok() {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the NATS cluster elected no JetStream leader within 30 s");
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
