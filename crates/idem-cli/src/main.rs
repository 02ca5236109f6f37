//! The `idem` command: a thin binary over the idem libraries.
//!
//! `idem demo` runs the payments scenario on the embedded SQLite store; `migrate`, `prune` and
//! `stats` administer a claims table on any SQL store, `reap-requests` removes expired
//! idempotent-request records, `complete` lists or gives up stuck operations of phases, `relay` publishes a store's outbox through a broker.

mod admin;
mod complete;
mod demo;
mod format;
mod relay;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Idempotent message processing: exactly-once effects over at-least-once delivery.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the payments demo on an embedded SQLite ledger, through a simulated at-least-once broker.
    Demo(demo::DemoArgs),
    /// Create the claims table and the requests table (idempotent).
    Migrate(admin::MigrateArgs),
    /// Delete claims older than a duration, in bounded batches.
    Prune(admin::PruneArgs),
    /// Show claims per consumer, oldest and newest.
    Stats(admin::StatsArgs),
    /// Delete expired idempotent-request records, in bounded batches.
    ReapRequests(admin::ReapRequestsArgs),
    /// List stuck operations of phases, or give up those out of attempts (resuming them is the
    /// application's `idem_request::Completer`).
    Complete(complete::CompleteArgs),
    /// Publish a store's outbox through a broker until SIGINT/SIGTERM (at least once, FIFO per ordering key).
    Relay(relay::RelayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Migrate(args) => admin::migrate(args).await,
            Command::Prune(args) => admin::prune(args).await,
            Command::Stats(args) => admin::stats(args).await,
            Command::ReapRequests(args) => admin::reap_requests(args).await,
            Command::Complete(args) => complete::complete(args).await,
            Command::Relay(args) => relay::relay(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes on one line, skipping causes whose text an outer message already
/// quotes (idem and sqlx errors include their cause in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line.replace('\n', " ")
}
