//! How MySQL/MariaDB refusals are classified, against the real server in `IDEM_TEST_MYSQL_URL`:
//! an outage (`--read-only`, a read-only transaction, disk or table full, too many
//! connections) is `Unavailable`, a misconfiguration (missing table, no privilege) under idem's
//! own statements is `Misconfigured` and under the handler's the message's own `Store`
//! failure. Real states where the server can be put in them per test; `SIGNAL … SET
//! MYSQL_ERRNO` for the rest (the server then answers with exactly that error number).

use idem_core::{BoxError, ErrorKind, Migrate, Processor};
use idem_sql::{MySqlStore, TableName};
use idem_testkit::isolated::MySqlDatabase;
use idem_testkit::unique_name;
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

use crate::states::{assert_state, failure};

struct Db {
    database: MySqlDatabase,
    admin: MySqlPool,
}

impl Db {
    async fn new(test: &str) -> Option<Self> {
        let database = MySqlDatabase::create("st", test).await?;
        let admin = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(database.url())
            .await
            .expect("connect to IDEM_TEST_MYSQL_URL");
        Some(Self { database, admin })
    }

    fn options(&self) -> MySqlConnectOptions {
        self.database.options()
    }

    async fn store(&self, pool: MySqlPoolOptions) -> MySqlStore {
        MySqlStore::from_pool(pool.connect_with(self.options()).await.expect("connect"))
    }

    async fn migrated(&self) -> MySqlStore {
        let store = self.store(MySqlPoolOptions::new().max_connections(2)).await;
        store.migrate().await.expect("migrate");
        store
    }

    async fn claims(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {}.idem_processed",
            self.database.name()
        ))
        .fetch_one(&self.admin)
        .await
        .expect("count")
    }

    async fn drop(self) {
        self.database.drop().await;
    }
}

#[tokio::test]
async fn error_numbers_of_outages_and_misconfigurations_are_classified() {
    let test = "error_numbers_of_outages_and_misconfigurations_are_classified";
    let Some(db) = Db::new(test).await else {
        return;
    };
    let p = Processor::builder(db.migrated().await, "states")
        .build()
        .expect("p");
    let cases = [
        (1290, ErrorKind::Unavailable),    // running with --read-only
        (1792, ErrorKind::Unavailable),    // read-only transaction
        (1836, ErrorKind::Unavailable),    // read-only mode
        (1021, ErrorKind::Unavailable),    // disk full
        (1114, ErrorKind::Unavailable),    // table is full
        (1040, ErrorKind::Unavailable),    // too many connections
        (1053, ErrorKind::ConnectionLost), // server shutdown in progress: the session ends
        (2013, ErrorKind::ConnectionLost), // lost connection mid-query
        // Under the handler's own statement a refusal that stops a consumer under idem's (see
        // the real states below) is the message's own failure: retried, then dead-lettered.
        (1146, ErrorKind::Store),     // no such table
        (1142, ErrorKind::Store),     // command denied on table
        (1054, ErrorKind::Store),     // unknown column
        (1213, ErrorKind::Transient), // deadlock
        (1062, ErrorKind::Store),     // duplicate entry: about the message's data
    ];
    for (number, kind) in cases {
        let sql = format!(
            "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = {number}, MESSAGE_TEXT = 'simulated {number}'"
        );
        let err = failure(&p, &format!("m-{number}"), async |tx| {
            sqlx::query(&sql).execute(&mut **tx).await?;
            Ok::<_, BoxError>(())
        })
        .await;
        assert_state(&number.to_string(), &err, kind);
    }
    assert_eq!(db.claims().await, 0, "a failed message left a claim");
    db.drop().await;
}

/// A read-only transaction (what `--read-only` or a replica gives a writer): the claim is
/// refused with 1792, so the message never ran.
#[tokio::test]
async fn a_read_only_database_is_an_outage() {
    let Some(db) = Db::new("a_read_only_database_is_an_outage").await else {
        return;
    };
    db.migrated().await;
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION READ ONLY").await?;
                Ok(())
            })
        });
    let p = Processor::builder(db.store(pool).await, "states")
        .build()
        .expect("p");
    let ran = std::sync::atomic::AtomicBool::new(false);
    let err = failure(&p, "m-ro", async |_tx| {
        ran.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, BoxError>(())
    })
    .await;
    assert_state("read-only", &err, ErrorKind::Unavailable);
    assert!(!ran.into_inner(), "the handler ran on a read-only database");
    assert_eq!(db.claims().await, 0);
    db.drop().await;
}

#[tokio::test]
async fn a_store_whose_migration_never_ran_is_misconfigured() {
    let Some(db) = Db::new("a_store_whose_migration_never_ran_is_misconfigured").await else {
        return;
    };
    let store = db
        .store(MySqlPoolOptions::new().max_connections(2))
        .await
        .with_table(TableName::new("never_migrated").expect("name"))
        .expect("table");
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-1", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("missing table", &err, ErrorKind::Misconfigured);
    assert!(err.to_string().contains("never_migrated"), "{err}");
    db.drop().await;
}

/// A user who may read but not write the claims table: the server refuses the claim (1142).
#[tokio::test]
async fn no_privilege_is_misconfigured() {
    let Some(db) = Db::new("no_privilege_is_misconfigured").await else {
        return;
    };
    db.migrated().await;
    let user = unique_name("u", "np");
    for sql in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'idem-test'"),
        format!("GRANT SELECT ON {}.* TO '{user}'@'%'", db.database.name()),
    ] {
        sqlx::query(&sql).execute(&db.admin).await.expect("user");
    }
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options().username(&user).password("idem-test"))
        .await
        .expect("connect as the read-only user");
    let p = Processor::builder(MySqlStore::from_pool(pool), "states")
        .build()
        .expect("p");
    let err = failure(&p, "m-np", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("permission denied", &err, ErrorKind::Misconfigured);
    let _ = sqlx::query(&format!("DROP USER '{user}'@'%'"))
        .execute(&db.admin)
        .await;
    db.drop().await;
}
