//! PostgreSQL faults: a restart of the whole server, and a failover that leaves the run's
//! database refusing writes for a while.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use sqlx::Executor;

use crate::ledger::RunDatabase;

/// Restarts the PostgreSQL server: `command` when given (run by `sh -c`), else the local
/// Debian cluster through `pg_ctlcluster` (fast shutdown: every session is cut).
pub(crate) async fn restart(command: Option<&str>) -> Result<()> {
    let mut cmd = match command {
        Some(c) => {
            let mut cmd = tokio::process::Command::new("sh");
            cmd.arg("-c").arg(c);
            cmd
        }
        None => {
            let version = std::fs::read_dir("/etc/postgresql")
                .context("no /etc/postgresql: pass --restart-database-command")?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .max()
                .context("no cluster under /etc/postgresql")?;
            let mut cmd = tokio::process::Command::new("pg_ctlcluster");
            cmd.args([
                "--skip-systemctl-redirect",
                &version,
                "main",
                "restart",
                "-m",
                "fast",
            ]);
            cmd
        }
    };
    let out = cmd.output().await.context("restarting PostgreSQL")?;
    if !out.status.success() {
        bail!(
            "restarting PostgreSQL failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A failover to a replica that is not yet writable: new sessions of the run's database are
/// read-only and every open one is cut, as when the old primary goes away. `end` makes it
/// writable again and cuts the sessions once more, so none stays read-only.
pub(crate) async fn make_read_only(db: &RunDatabase, read_only: bool) -> Result<()> {
    let setting = if read_only { "on" } else { "off" };
    db.admin()?
        .execute(
            format!(
                "ALTER DATABASE \"{}\" SET default_transaction_read_only = {setting}",
                db.name()
            )
            .as_str(),
        )
        .await
        .context("ALTER DATABASE … default_transaction_read_only")?;
    cut_sessions(db).await
}

/// Terminates every session of the run's database but the caller's.
pub(crate) async fn cut_sessions(db: &RunDatabase) -> Result<()> {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(db.name())
    .execute(db.admin()?)
    .await
    .context("terminating sessions")?;
    Ok(())
}

/// Waits until the server takes connections again after a restart.
pub(crate) async fn wait_until_up(db: &RunDatabase, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if db.admin()?.execute("SELECT 1").await.is_ok() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("PostgreSQL did not come back within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
