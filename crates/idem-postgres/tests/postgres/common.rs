//! Shared by the real-server tests: connections into a test's own schema, on a deadpool pool
//! or on plain clients.

use idem_postgres::PgStore;
use idem_postgres::deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idem_postgres::tokio_postgres::{self, Client, Config, NoTls};
use idem_testkit::isolated::PgSchema;

/// Where a store's connections come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Conns {
    /// A deadpool-postgres pool of this many connections.
    Pool(usize),
    /// This many plain clients.
    Clients(usize),
}

/// The server's configuration, with `schema` first on the search path.
pub(crate) fn config(schema: &PgSchema) -> Config {
    let mut config: Config = schema.url().parse().expect("valid IDEM_TEST_POSTGRES_URL");
    config.options(format!("-c search_path={}", schema.name()));
    config
}

/// One plain client on `config`, its connection task spawned.
pub(crate) async fn client(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// A deadpool pool of up to `max` connections on `config`.
pub(crate) fn pool(config: &Config, max: usize) -> Pool {
    let manager = Manager::from_config(
        config.clone(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(max).build().expect("pool")
}

/// A store on `config`, its connections as `conns` says.
pub(crate) async fn store(config: &Config, conns: Conns) -> PgStore {
    match conns {
        Conns::Pool(max) => PgStore::from_pool(pool(config, max)),
        Conns::Clients(n) => {
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                clients.push(client(config).await);
            }
            PgStore::from_clients(clients)
        }
    }
}

/// `SELECT count(*)` of `sql` on `client`.
pub(crate) async fn count(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> i64 {
    client.query_one(sql, params).await.expect("count").get(0)
}
