//! `idem-fault-proxy --listen ADDR --upstream ADDR --drop FRACTION --seed N`: the test kit's
//! fault proxy as a process. Forwards each request, waits for the upstream's whole answer,
//! and for the given fraction closes the client's connection instead of answering. Prints
//! what it did on Ctrl-C.

use std::net::SocketAddr;
use std::process::ExitCode;

use idem_testkit::fault_proxy::FaultProxy;

const USAGE: &str = "usage: idem-fault-proxy --upstream ADDR [--listen ADDR] [--drop FRACTION] [--seed N]\n\
    defaults: --listen 127.0.0.1:4343 --drop 0.3 --seed 1; see idem_testkit::fault_proxy";

fn parse<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value.parse().map_err(|e| format!("{flag} {value:?}: {e}"))
}

fn args() -> Result<Option<(SocketAddr, SocketAddr, f64, u64)>, String> {
    let mut listen: SocketAddr = parse("--listen", Some("127.0.0.1:4343".to_owned()))?;
    let mut upstream = None;
    let mut drop = 0.3;
    let mut seed = 1;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = parse("--listen", args.next())?,
            "--upstream" => upstream = Some(parse("--upstream", args.next())?),
            "--drop" => drop = parse("--drop", args.next())?,
            "--seed" => seed = parse("--seed", args.next())?,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !(0.0..=1.0).contains(&drop) {
        return Err(format!("--drop {drop}: a fraction from 0 to 1"));
    }
    let upstream = upstream.ok_or("--upstream is required")?;
    Ok(Some((listen, upstream, drop, seed)))
}

#[tokio::main]
async fn main() -> ExitCode {
    let (listen, upstream, drop, seed) = match args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let proxy = FaultProxy::serve(listener, upstream, drop, seed);
    println!(
        "idem-fault-proxy listening on {} -> {upstream}, dropping {drop} of answers (seed {seed})",
        proxy.url()
    );
    if let Err(e) = tokio::signal::ctrl_c().await {
        eprintln!("cannot wait for Ctrl-C: {e}");
        return ExitCode::FAILURE;
    }
    let s = proxy.stats();
    println!(
        "forwarded {} dropped {} upstream_errors {}",
        s.forwarded, s.dropped, s.upstream_errors
    );
    ExitCode::SUCCESS
}
