//! A migrated store with an `effects` table in a namespace of the test's own, per engine.

use idem_core::Migrate;
use idem_sql::SqlStore;
use idem_testkit::isolated::{MySqlDatabase, PgSchema};
use idem_testkit::unique_name;

/// What to drop when the test ends.
#[derive(Debug)]
pub(crate) enum Namespace {
    Sqlite(std::path::PathBuf),
    Postgres(PgSchema),
    MySql(MySqlDatabase),
}

/// A store, its namespace, and a pool of the test's own (to look from outside a transaction
/// the store's single pooled connection may be busy with).
#[derive(Debug)]
pub(crate) struct Fx<E: idem_sql::engine::Engine> {
    pub(crate) store: SqlStore<E>,
    pub(crate) observer: sqlx::Pool<E>,
    pub(crate) namespace: Namespace,
}

const EFFECTS: &str = "CREATE TABLE effects (k VARCHAR(64) NOT NULL)";

impl Fx<sqlx::Sqlite> {
    pub(crate) async fn sqlite(test: &str, held: bool) -> Option<Self> {
        let dir = std::env::temp_dir().join(unique_name("idem_tx", test));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = idem_sql::SqliteStore::open(dir.join("db"), idem_sql::SqliteOptions::default())
            .await
            .expect("open sqlite");
        store.migrate().await.expect("migrate");
        sqlx::query(EFFECTS)
            .execute(store.pool())
            .await
            .expect("effects");
        let observer = store.pool().clone();
        let store = if held {
            store.hold_connections(2)
        } else {
            store
        };
        Some(Self {
            store,
            observer,
            namespace: Namespace::Sqlite(dir),
        })
    }
}

impl Fx<sqlx::Postgres> {
    /// On a pool of one connection (so the test sees the connection idem gave back).
    pub(crate) async fn postgres(test: &str, held: bool) -> Option<Self> {
        let schema = PgSchema::create("idem_tx", test).await?;
        let store = idem_sql::PostgresStore::from_pool(schema.pool(1).await);
        store.migrate().await.expect("migrate");
        sqlx::query(EFFECTS)
            .execute(store.pool())
            .await
            .expect("effects");
        let store = if held {
            store.hold_connections(2)
        } else {
            store
        };
        Some(Self {
            store,
            observer: schema.pool(1).await,
            namespace: Namespace::Postgres(schema),
        })
    }
}

impl Fx<sqlx::MySql> {
    /// On a pool of one connection.
    pub(crate) async fn mysql(test: &str, held: bool) -> Option<Self> {
        let database = MySqlDatabase::create("idem_tx", test).await?;
        let store = idem_sql::MySqlStore::from_pool(database.pool(1).await);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (k VARCHAR(64) NOT NULL) ENGINE = InnoDB")
            .execute(store.pool())
            .await
            .expect("effects");
        let store = if held {
            store.hold_connections(2)
        } else {
            store
        };
        Some(Self {
            store,
            observer: database.pool(1).await,
            namespace: Namespace::MySql(database),
        })
    }
}

impl<E: idem_sql::engine::Engine> Fx<E> {
    pub(crate) async fn teardown(self) {
        self.store.pool().close().await;
        self.observer.close().await;
        drop(self.store);
        match self.namespace {
            Namespace::Sqlite(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Namespace::Postgres(schema) => schema.drop().await,
            Namespace::MySql(database) => database.drop().await,
        }
    }
}
