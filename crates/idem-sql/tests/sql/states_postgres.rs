//! How PostgreSQL's refusals are classified, against the real server in
//! `IDEM_TEST_POSTGRES_URL`: an outage (read-only after a failover, disk full, out of
//! connections) is `Unavailable` — waited out, never a dead letter — and a misconfiguration
//! (missing table, no privilege) under idem's own statements is `Misconfigured`, which stops a
//! consumer; under the handler's own statements it is that message's `Store` failure. Real
//! states where the server can be put in them per test; `RAISE … USING ERRCODE` for the rest
//! (the server then answers with exactly that SQLSTATE, as it would in the real state).

use idem_core::{BoxError, ErrorKind, Migrate, Processor};
use idem_sql::{PostgresStore, TableName};
use idem_testkit::isolated::PgSchema;
use idem_testkit::unique_name;
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use crate::states::{assert_state, failure};

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

/// Each SQLSTATE under the handler's own statement and under idem's claim (a trigger on the
/// claims table raises it there): who ran the statement decides. A refusal only an operator
/// can mend stops a consumer when idem's statement meets it (`Misconfigured`), and is the
/// message's own failure (`Store`: retried, then dead-lettered) when the handler's does; a
/// session the server ended is an outage under idem's statement (`Unavailable`) and a lost
/// connection (`ConnectionLost`, probed by the consumer) under the handler's.
#[tokio::test]
async fn sqlstates_of_outages_and_misconfigurations_are_classified() {
    let Some(db) = Db::new("sqlstates_of_outages_and_misconfigurations_are_classified").await
    else {
        return;
    };
    let store = db.migrated().await;
    let p = Processor::builder(store.clone(), "states")
        .build()
        .expect("p");
    use ErrorKind::{ConnectionLost, Misconfigured, Store, Transient, Unavailable};
    // (SQLSTATE, under the handler's statement, under idem's claim)
    let cases = [
        ("25006", Unavailable, Unavailable), // read_only_sql_transaction
        ("53100", Unavailable, Unavailable), // disk_full
        ("53200", Unavailable, Unavailable), // out_of_memory
        ("53300", Unavailable, Unavailable), // too_many_connections
        ("57P01", ConnectionLost, Unavailable), // admin_shutdown (pg_terminate_backend)
        ("57P02", ConnectionLost, Unavailable), // crash_shutdown
        ("58030", Unavailable, Unavailable), // io_error
        ("08006", ConnectionLost, Unavailable), // connection_failure
        ("42501", Store, Misconfigured),     // insufficient_privilege (and RLS WITH CHECK)
        ("42P01", Store, Misconfigured),     // undefined_table
        ("42703", Store, Misconfigured),     // undefined_column
        ("3F000", Store, Misconfigured),     // invalid_schema_name
        ("40001", Transient, Transient),     // serialization_failure
        ("57014", Transient, Transient),     // query_canceled (statement_timeout)
        ("23505", Store, Store),             // unique_violation: about the message's data
    ];
    for (code, by_handler, _) in cases {
        let sql = format!(
            "DO $$ BEGIN RAISE EXCEPTION 'simulated {code}' USING ERRCODE = '{code}'; END $$"
        );
        let err = failure(&p, &format!("m-{code}"), async |tx| {
            sqlx::query(&sql).execute(&mut **tx).await?;
            Ok::<_, BoxError>(())
        })
        .await;
        assert_state(&format!("{code} under the handler"), &err, by_handler);
    }
    // On the store's pool: the test's schema is first on its search path.
    for sql in [
        "CREATE TABLE raise_on_claim (code text NOT NULL)",
        "CREATE FUNCTION raise_on_claim() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE c text := (SELECT code FROM raise_on_claim); \
         BEGIN RAISE EXCEPTION 'simulated %', c USING ERRCODE = c; END $$",
        "CREATE TRIGGER raise_on_claim BEFORE INSERT ON idem_processed \
         FOR EACH ROW EXECUTE FUNCTION raise_on_claim()",
    ] {
        sqlx::query(sql).execute(store.pool()).await.expect(sql);
    }
    for (code, _, by_idem) in cases {
        sqlx::query("DELETE FROM raise_on_claim")
            .execute(store.pool())
            .await
            .expect("clear");
        sqlx::query("INSERT INTO raise_on_claim (code) VALUES ($1)")
            .bind(code)
            .execute(store.pool())
            .await
            .expect("code");
        let ran = std::sync::atomic::AtomicBool::new(false);
        let err = failure(&p, &format!("c-{code}"), async |_tx| {
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, BoxError>(())
        })
        .await;
        assert!(
            !ran.into_inner(),
            "{code}: the handler ran after a failed claim"
        );
        assert_state(&format!("{code} under idem's claim"), &err, by_idem);
    }
    assert_eq!(db.claims().await, 0, "a failed message left a claim");
    store.pool().close().await;
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
