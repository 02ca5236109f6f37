//! How PostgreSQL's refusals are classified, against the real server in
//! `IDEM_TEST_POSTGRES_URL`: an outage (read-only after a failover, disk full, out of
//! connections) is `Unavailable` — waited out, never a dead letter — and a misconfiguration
//! (missing table, no privilege) is `Misconfigured`, which stops a consumer. Real states where
//! the server can be put in them per test; `RAISE … USING ERRCODE` for the rest (the server
//! then answers with exactly that SQLSTATE, as it would in the real state).

mod states;

use idem_core::{BoxError, ErrorKind, Migrate, Processor};
use idem_sql::{PostgresStore, TableName};
use idem_testkit::isolated::PgSchema;
use idem_testkit::unique_name;
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use states::{assert_state, failure};

struct Db {
    schema: PgSchema,
    admin: PgPool,
}

impl Db {
    async fn new(test: &str) -> Option<Self> {
        let schema = PgSchema::create("st", test).await?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(schema.url())
            .await
            .expect("connect to IDEM_TEST_POSTGRES_URL");
        Some(Self { schema, admin })
    }

    fn options(&self) -> PgConnectOptions {
        self.schema.options()
    }

    async fn store(&self, options: PgConnectOptions) -> PostgresStore {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .expect("connect");
        PostgresStore::from_pool(pool)
    }

    async fn migrated(&self) -> PostgresStore {
        let store = self.store(self.options()).await;
        store.migrate().await.expect("migrate");
        store
    }

    async fn claims(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {}.idem_processed",
            self.schema.name()
        ))
        .fetch_one(&self.admin)
        .await
        .expect("count")
    }

    async fn drop(self) {
        self.schema.drop().await;
    }
}

#[tokio::test]
async fn sqlstates_of_outages_and_misconfigurations_are_classified() {
    let Some(db) = Db::new("sqlstates_of_outages_and_misconfigurations_are_classified").await
    else {
        return;
    };
    let p = Processor::builder(db.migrated().await, "states")
        .build()
        .expect("p");
    let cases = [
        ("25006", ErrorKind::Unavailable),   // read_only_sql_transaction
        ("53100", ErrorKind::Unavailable),   // disk_full
        ("53200", ErrorKind::Unavailable),   // out_of_memory
        ("53300", ErrorKind::Unavailable),   // too_many_connections
        ("57P01", ErrorKind::Unavailable),   // admin_shutdown
        ("58030", ErrorKind::Unavailable),   // io_error
        ("08006", ErrorKind::Unavailable),   // connection_failure
        ("42501", ErrorKind::Misconfigured), // insufficient_privilege
        ("42P01", ErrorKind::Misconfigured), // undefined_table
        ("42703", ErrorKind::Misconfigured), // undefined_column
        ("3F000", ErrorKind::Misconfigured), // invalid_schema_name
        ("40001", ErrorKind::Transient),     // serialization_failure
        ("57014", ErrorKind::Transient),     // query_canceled (statement_timeout)
        ("23505", ErrorKind::Store),         // unique_violation: about the message's data
    ];
    for (code, kind) in cases {
        let sql = format!(
            "DO $$ BEGIN RAISE EXCEPTION 'simulated {code}' USING ERRCODE = '{code}'; END $$"
        );
        let err = failure(&p, &format!("m-{code}"), async |tx| {
            sqlx::query(&sql).execute(&mut **tx).await?;
            Ok::<_, BoxError>(())
        })
        .await;
        assert_state(code, &err, kind);
    }
    assert_eq!(db.claims().await, 0, "a failed message left a claim");
    db.drop().await;
}

/// What a failover onto a standby looks like to the consumer: every write transaction is
/// refused with SQLSTATE 25006. The claim itself fails, so the message never ran.
#[tokio::test]
async fn a_read_only_database_is_an_outage() {
    let Some(db) = Db::new("a_read_only_database_is_an_outage").await else {
        return;
    };
    db.migrated().await;
    let read_only = db
        .store(
            db.options()
                .options([("default_transaction_read_only", "on")]),
        )
        .await;
    let p = Processor::builder(read_only, "states").build().expect("p");
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
        .store(db.options())
        .await
        .with_table(TableName::new("never_migrated").expect("name"))
        .expect("table");
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-1", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("missing table", &err, ErrorKind::Misconfigured);
    assert!(err.to_string().contains("never_migrated"), "{err}");
    db.drop().await;
}

/// A role that may log in but not write the claims table (42501), and a role whose connection
/// limit is reached (53300): real refusals from the server, on roles made for this test.
#[tokio::test]
async fn no_privilege_is_misconfigured_and_no_connection_slot_is_an_outage() {
    let test = "no_privilege_is_misconfigured_and_no_connection_slot_is_an_outage";
    let Some(db) = Db::new(test).await else {
        return;
    };
    db.migrated().await;
    let role = unique_name("role", "np");
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {} TO {role}", db.schema.name()),
    ] {
        sqlx::query(&sql).execute(&db.admin).await.expect("role");
    }
    let store = db.store(db.options().username(&role)).await;
    let p = Processor::builder(store.clone(), "states")
        .build()
        .expect("p");
    let err = failure(&p, "m-np", async |_tx| Ok::<_, BoxError>(())).await;
    assert_state("permission denied", &err, ErrorKind::Misconfigured);
    store.pool().close().await;

    sqlx::query(&format!("ALTER ROLE {role} CONNECTION LIMIT 0"))
        .execute(&db.admin)
        .await
        .expect("limit");
    let url = db.options().username(&role).to_url_lossy().to_string();
    let err = PostgresStore::connect(&url)
        .await
        .expect_err("no connection slot is left for the role");
    assert_state("too many connections", &err, ErrorKind::Unavailable);

    let admin = db.admin.clone();
    db.drop().await;
    let _ = sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await;
}
