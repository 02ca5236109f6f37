//! A Mosquitto of the run's own, for `--broker mqtt://…`. Mosquitto keeps at most
//! `max_queued_messages` (1 000 by default) for a persistent session whose client is
//! disconnected and drops what comes beyond: a consumer killed for a few seconds under load
//! would lose messages to the broker's configuration, not to idem. A shared broker must not be
//! reconfigured for a run, so the harness starts one with no cap (`max_queued_messages 0`) on
//! a free loopback port, no persistence (it is never restarted), and `$SYS` figures every
//! second (the drain reads the store's message count there), and stops it at the end.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

/// Where Debian and Ubuntu install the broker; not on every user's PATH.
const SBIN_MOSQUITTO: &str = "/usr/sbin/mosquitto";
/// How long the broker may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A running private Mosquitto; killed when dropped.
#[derive(Debug)]
pub(crate) struct Mosquitto {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Mosquitto {
    /// Starts `program` (a path, or a name looked up on PATH, then in /usr/sbin) with a
    /// config written to `dir`, and waits until it accepts connections.
    pub(crate) async fn start(program: &str, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let port = free_port()?;
        let config = dir.join("mosquitto.conf");
        std::fs::write(&config, config_text(port))
            .with_context(|| format!("writing {}", config.display()))?;
        let log = dir.join("mosquitto.log");
        let spawn = |program: &str| -> std::io::Result<Child> {
            let out = std::fs::File::create(&log)?;
            Command::new(program)
                .arg("-c")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .kill_on_drop(true)
                .spawn()
        };
        let child = match spawn(program) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !program.contains('/') => {
                spawn(SBIN_MOSQUITTO)
            }
            other => other,
        }
        .with_context(|| {
            format!("starting {program} (install Mosquitto or pass --mosquitto PATH)")
        })?;
        let mut broker = Self { child, port, log };
        broker.wait_until_up().await?;
        eprintln!("idem-chaos: a Mosquitto of the run's own on 127.0.0.1:{port}");
        Ok(broker)
    }

    async fn wait_until_up(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "mosquitto exited at start ({status}): {}",
                    std::fs::read_to_string(&self.log)
                        .unwrap_or_default()
                        .trim()
                );
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("mosquitto accepted no connection within {START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The URL the run's processes connect to.
    pub(crate) fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Stops the broker (the run is over; what it held goes with it).
    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The generated configuration: see the module docs for why each line.
fn config_text(port: u16) -> String {
    format!(
        "# written by idem-chaos for one run\n\
         listener {port} 127.0.0.1\n\
         allow_anonymous true\n\
         max_queued_messages 0\n\
         persistence false\n\
         sys_interval 1\n"
    )
}

/// A loopback port nothing listens on now (the OS's pick; released before the broker binds
/// it, which a port taken in between turns into a start-up failure, not a wrong run).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_lifts_the_queue_cap_on_loopback() {
        let text = config_text(18_830);
        assert!(text.contains("listener 18830 127.0.0.1\n"), "{text}");
        assert!(text.contains("max_queued_messages 0\n"), "{text}");
        assert!(text.contains("persistence false\n"), "{text}");
        assert!(text.contains("sys_interval 1\n"), "{text}");
    }
}
