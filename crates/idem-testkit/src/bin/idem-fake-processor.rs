//! `idem-fake-processor --listen ADDR`: the test kit's fake card processor as a process, for
//! examples and soaks that need a card processor to count charges at.

use std::net::SocketAddr;
use std::process::ExitCode;

use idem_testkit::fake_processor::FakeProcessor;

const USAGE: &str = "usage: idem-fake-processor [--listen ADDR]   (default 127.0.0.1:4242)\n\
    POST /v1/charges, GET /v1/_stats, POST /v1/_faults; see idem_testkit::fake_processor";

#[tokio::main]
async fn main() -> ExitCode {
    let mut listen = String::from("127.0.0.1:4242");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => match args.next() {
                Some(a) => listen = a,
                None => {
                    eprintln!("--listen needs an address\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("unknown argument {other:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let addr: SocketAddr = match listen.parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("--listen {listen:?}: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match listener.local_addr() {
        Ok(a) => println!("idem-fake-processor listening on http://{a}"),
        Err(_) => println!("idem-fake-processor listening on http://{addr}"),
    }
    FakeProcessor::run(listener).await;
    ExitCode::FAILURE
}
