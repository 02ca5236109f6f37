//! The processes of a run: several `payments` services in one consumer group (or several
//! `idem relay` processes), started, killed and restarted by slot. A slot is one replica: its
//! instance name (Redis Streams consumer, relay lease owner, as a StatefulSet pod keeps its
//! name) survives its restarts.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use idem_consumer::crash::{CRASH_AT_ENV, CrashAt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// How a consumer process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// SIGKILLed by the harness.
    Killed,
    /// Aborted at its armed crash point.
    Crashed(CrashAt),
    /// Exited 0 (after SIGTERM).
    Clean,
    /// Exited with an error status or died of a signal the harness did not send.
    Failed(Option<i32>, Option<i32>),
}

#[derive(Debug, Default)]
struct Slot {
    child: Option<Child>,
    killed: bool,
    crash: Option<CrashAt>,
    started: Option<std::time::Instant>,
    starts: u64,
}

/// The replicas of one kind in a run.
#[derive(Debug)]
pub(crate) struct Fleet {
    program: PathBuf,
    args: Vec<String>,
    logs: PathBuf,
    slots: Vec<Slot>,
    /// The flag that names a replica (empty: the replicas take no name), and the names' and
    /// log files' prefix.
    instance_flag: &'static str,
    prefix: &'static str,
    /// Flags of one replica's own (an HTTP service's listen address), by slot.
    slot_args: Vec<Vec<String>>,
}

impl Fleet {
    /// `args` are the service's flags common to every replica; logs go to `logs/`.
    pub(crate) fn new(program: PathBuf, args: Vec<String>, logs: &Path, size: usize) -> Self {
        Self {
            program,
            args,
            logs: logs.to_owned(),
            slots: (0..size).map(|_| Slot::default()).collect(),
            instance_flag: "--instance",
            prefix: "consumer",
            slot_args: Vec::new(),
        }
    }

    /// Gives the replica in slot `i` the flags `args[i]` besides the common ones: its own
    /// listen address, which it keeps across restarts.
    pub(crate) fn with_slot_args(mut self, args: Vec<Vec<String>>) -> Self {
        self.slot_args = args;
        self
    }

    /// Replicas named with `flag` as `chaos-<prefix>-<slot>` (default: `--instance
    /// chaos-<slot>`; an empty `flag` names none), logging to `<prefix>-<slot>.log`.
    pub(crate) fn named(mut self, flag: &'static str, prefix: &'static str) -> Self {
        self.instance_flag = flag;
        self.prefix = prefix;
        self
    }

    /// The name the replica in `slot` is given with the instance flag (an MQTT consumer's
    /// client ID, hence its session).
    pub(crate) fn instance(&self, slot: usize) -> String {
        match self.prefix {
            "consumer" => format!("chaos-{slot}"),
            prefix => format!("chaos-{prefix}-{slot}"),
        }
    }

    /// Every replica's instance name.
    pub(crate) fn instances(&self) -> Vec<String> {
        (0..self.slots.len()).map(|s| self.instance(s)).collect()
    }

    fn log_path(&self, slot: usize) -> PathBuf {
        self.logs.join(format!("{}-{slot}.log", self.prefix))
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Starts the replica in `slot`, armed to abort at `crash` if given.
    pub(crate) fn start(&mut self, slot: usize, crash: Option<CrashAt>) -> Result<()> {
        let log_path = self.log_path(slot);
        let instance = self.instance(slot);
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let s = &mut self.slots[slot];
        s.starts += 1;
        {
            use std::io::Write;
            let armed = crash.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
            writeln!(log, "=== idem-chaos: start #{} crash-at {armed}", s.starts)?;
        }
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        if let Some(own) = self.slot_args.get(slot) {
            cmd.args(own);
        }
        if !self.instance_flag.is_empty() {
            cmd.args([self.instance_flag, instance.as_str()]);
        }
        cmd.env_remove(CRASH_AT_ENV)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        if let Some(at) = crash {
            cmd.env(CRASH_AT_ENV, at.to_string());
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.program.display()))?;
        s.child = Some(child);
        s.killed = false;
        s.crash = crash;
        s.started = Some(std::time::Instant::now());
        Ok(())
    }

    /// Whether a random SIGKILL may take the replica in `slot`: it is running and either
    /// unarmed or armed for longer than `spare_armed_for`. An armed replica is left that long
    /// to reach its crash point; without this, where a start costs seconds before the first
    /// message (a Kafka group join), kills came faster than armed replicas got to their points
    /// and a run could end with no abort at a crash point at all.
    pub(crate) fn killable(&self, slot: usize, spare_armed_for: Duration) -> bool {
        let s = &self.slots[slot];
        s.child.is_some()
            && !s.killed
            && (s.crash.is_none() || s.started.is_some_and(|t| t.elapsed() >= spare_armed_for))
    }

    /// SIGKILLs the replica in `slot`; false when it was not running.
    pub(crate) fn kill(&mut self, slot: usize) -> bool {
        let s = &mut self.slots[slot];
        match s.child.as_mut() {
            Some(child) if !s.killed => {
                s.killed = child.start_kill().is_ok();
                s.killed
            }
            _ => false,
        }
    }

    /// The replicas that ended since the last call, and how.
    pub(crate) fn reap(&mut self) -> Vec<(usize, Exit)> {
        let mut ended = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Some(child) = s.child.as_mut() else {
                continue;
            };
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            s.child = None;
            let exit = match (status.code(), status.signal()) {
                (_, Some(9)) if s.killed => Exit::Killed,
                (_, Some(6)) if s.crash.is_some() => Exit::Crashed(s.crash.expect("checked")),
                (Some(0), _) => Exit::Clean,
                (code, signal) => Exit::Failed(code, signal),
            };
            ended.push((i, exit));
        }
        ended
    }

    /// SIGTERMs every replica and waits for it; SIGKILL after `grace`. Returns the exits.
    pub(crate) async fn stop_all(&mut self, grace: Duration) -> Vec<(usize, Exit)> {
        for s in &self.slots {
            if let Some(pid) = s.child.as_ref().and_then(Child::id) {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        let mut ended = Vec::new();
        while self.slots.iter().any(|s| s.child.is_some()) {
            ended.extend(self.reap());
            if tokio::time::Instant::now() > deadline {
                for i in 0..self.slots.len() {
                    self.kill(i);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        ended
    }

    /// Kafka: how many partitions the running replicas hold, by their own rebalance log lines
    /// (idem-kafka logs every assignment and revocation librdkafka hands it): per replica,
    /// its process's last `partitions assigned partitions=N`, or 0 after a revocation.
    pub(crate) fn held_partitions(&self) -> usize {
        let mut held = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.child.is_none() {
                continue;
            }
            let text = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
            let this_process = text
                .rsplit("=== idem-chaos: start")
                .next()
                .unwrap_or_default();
            let mut now = 0;
            for line in this_process.lines() {
                if line.contains("partitions revoked") {
                    now = 0;
                } else if let Some(n) = line
                    .contains("partitions assigned")
                    .then(|| line.split("partitions=").nth(1))
                    .flatten()
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    now = n;
                }
            }
            held += now;
        }
        held
    }

    /// The last `lines` lines of every replica's log, for a failure report.
    pub(crate) fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for i in 0..self.slots.len() {
            let path = self.log_path(i);
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} (last {lines} lines)\n", path.display()));
            for l in &all[all.len().saturating_sub(lines)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}
