//! `--database URL` → the idempotency store, the ledger, and the router with the layer wired
//! in; and the server loop with graceful shutdown.

use anyhow::{Context, Result};
use axum::Router;
use axum::routing::post;
use idem_relay::RelayWaker;
use idem_sql::{
    AnyStore, MySqlStore, PostgresStore, SqliteOptions, SqliteStore, StoreVisitor, TableName,
};

use crate::app::{self, AppState};
use crate::emit::{self, Emit, Relaying};
use crate::ledger::Ledger;
use crate::{Mode, ServeArgs};

/// The URL's scheme, lowercase (`sqlite`, `postgres`, …).
pub(crate) fn scheme(url: &str) -> String {
    url.split(':')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase()
}

/// The SQL store at `url`, created if missing; a SQLite file with `--busy-timeout` and
/// `--max-connections`.
pub(crate) async fn open_sql(url: &str, args: &ServeArgs) -> Result<AnyStore, idem_core::Error> {
    if scheme(url) == "sqlite" {
        let options = SqliteOptions::default()
            .busy_timeout(args.busy_timeout)
            .max_connections(args.max_connections);
        let store = SqliteStore::connect(url, options).await?;
        return Ok(AnyStore::Sqlite(store));
    }
    AnyStore::connect_or_create(url, TableName::default()).await
}

/// Opens the stores, binds, serves until SIGTERM or Ctrl-C, then finishes in-flight requests
/// (and, with `--emit`, stops the relay after them).
pub(crate) async fn serve(args: ServeArgs) -> Result<()> {
    let (router, relay) = build(&args).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        database = %idem_redact::redact_url(&args.database),
        ledger = args.ledger.as_deref().map(idem_redact::redact_url).as_deref().unwrap_or("(the database)"),
        lease = ?args.lease,
        mode = ?args.mode,
        "listening"
    );
    let relay = relay.map(Relaying::spawn);
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving");
    if let Some(relay) = relay {
        relay.stop().await;
    }
    served?;
    tracing::info!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: finishing in-flight requests");
}

/// The router for `args`: the store chosen by `--database`, the layer unless a baseline mode;
/// with `--emit`, the relay over the store's outbox (not yet running).
pub(crate) async fn build(args: &ServeArgs) -> Result<(Router, Option<Relaying>)> {
    let url = args.database.as_str();
    let shown = idem_redact::redact_url(url);
    let scheme = scheme(url);
    if args.ledger.is_some() && scheme != "redis" && scheme != "rediss" {
        anyhow::bail!(
            "--ledger is for --database redis://…; a SQL --database holds the charges itself"
        );
    }
    let broker = emit::check(args, &scheme)?;
    if args.card_processor.is_some() {
        if scheme == "redis" || scheme == "rediss" {
            anyhow::bail!(
                "--card-processor needs a SQL --database: its recovery points commit with the charge row, which Redis cannot join"
            );
        }
        if args.emit.is_some() {
            anyhow::bail!("--card-processor and --emit together are not supported yet");
        }
        if args.mode != Mode::Idempotent {
            anyhow::bail!("--card-processor is not for the benchmark's baseline modes");
        }
    }
    if args.mode != Mode::Idempotent {
        let ledger =
            match scheme.as_str() {
                "redis" | "rediss" => Ledger::open(
                    args.ledger.as_deref().context(
                        "--database redis://… needs --ledger URL: the SQL database for the charges",
                    )?,
                    args,
                )
                .await?,
                _ => Ledger::open(url, args).await?,
            };
        let state = AppState {
            ledger,
            test_hooks: args.test_hooks,
            ttl: args.ttl,
        };
        let post_charges = match args.mode {
            Mode::Static => post(app::post_charge_static),
            _ => post(app::post_charge_own_tx),
        };
        return Ok((app::router(state, post_charges), None));
    }
    if scheme == "redis" || scheme == "rediss" {
        let ledger_url = args
            .ledger
            .as_deref()
            .context("--database redis://… needs --ledger URL: the SQL database for the charges")?;
        let ledger = Ledger::open(ledger_url, args).await?;
        return Ok((crate::layer::redis(url, ledger, args).await?, None));
    }
    // Every SQL scheme: AnyStore maps it to its engine (and refuses an unknown one).
    let store = open_sql(url, args)
        .await
        .with_context(|| format!("opening {shown}"))?;
    // The outbox table too: `migrate` creates it next to the records.
    store.migrate().await?;
    let relay = match broker {
        Some(broker) => Some(Relaying::new(store.clone(), broker, args)?),
        None => None,
    };
    let router = store
        .visit(SqlRouter {
            args,
            waker: relay.as_ref().map(Relaying::waker),
        })
        .await?;
    Ok((router, relay))
}

/// The router on a SQL engine: the ledger on the store's own pool, the layer over both; with
/// `--emit`, the event enqueued through the layer's transaction and the relay woken after it.
struct SqlRouter<'a> {
    args: &'a ServeArgs,
    waker: Option<RelayWaker>,
}

impl SqlRouter<'_> {
    /// `--emit`'s outbox on `store`, the one whose transaction the handler writes through.
    fn emit<S: Clone>(&self, store: &S) -> Option<Emit<S>> {
        self.args.emit.as_ref().map(|destination| Emit {
            store: store.clone(),
            destination: destination.clone(),
        })
    }
}

impl StoreVisitor for SqlRouter<'_> {
    type Output = Result<Router>;

    async fn sqlite(self, store: SqliteStore) -> Result<Router> {
        let ledger = Ledger::sqlite(store.pool().clone()).await?;
        if self.args.card_processor.is_some() {
            return crate::processor::sql(store, ledger, self.args);
        }
        let emit = self.emit(&store);
        crate::layer::sql(store, ledger, emit, self.waker, self.args)
    }

    async fn postgres(self, store: PostgresStore) -> Result<Router> {
        let ledger = Ledger::postgres(store.pool().clone()).await?;
        let store = match self.args.held_connections {
            0 => store,
            n => store.hold_connections(n),
        };
        if self.args.card_processor.is_some() {
            return crate::processor::sql(store, ledger, self.args);
        }
        let emit = self.emit(&store);
        crate::layer::sql(store, ledger, emit, self.waker, self.args)
    }

    async fn mysql(self, store: MySqlStore) -> Result<Router> {
        let ledger = Ledger::mysql(store.pool().clone()).await?;
        let store = match self.args.held_connections {
            0 => store,
            n => store.hold_connections(n),
        };
        if self.args.card_processor.is_some() {
            return crate::processor::sql(store, ledger, self.args);
        }
        let emit = self.emit(&store);
        crate::layer::sql(store, ledger, emit, self.waker, self.args)
    }
}
