//! How PostgreSQL's refusals are classified on tokio-postgres, against the real server in
//! `IDEM_TEST_POSTGRES_URL`, as `idem-sql`'s `states_postgres.rs` checks them on sqlx: an outage
//! (read-only after a failover, out of connections, a connection lost) is `Unavailable` —
//! waited out, never a dead letter — under the handler a lost connection is `ConnectionLost`
//! (which the consumer probes), and at `COMMIT` `OutcomeUnknown`; a misconfiguration (missing
//! table, no privilege) under idem's statements is `Misconfigured`, which stops a consumer, and
//! under the handler's the message's own `Store` failure; a swallowed error never reports
//! `Processed`. Real states where the server can be put in them per test,
//! `RAISE … USING ERRCODE` for the rest.

use std::sync::atomic::{AtomicBool, Ordering};

use idem_core::{
    BoxError, ClaimStore, Disposition, Error, ErrorKind, Message, MessageId, Migrate, Outcome,
    Processor, TransactionalStore,
};
use idem_postgres::tokio_postgres::{Client, Config};
use idem_postgres::{PgStore, TableName};
use idem_testkit::isolated::PgSchema;
use idem_testkit::unique_name;

use crate::common::{self, Conns};

struct Db {
    schema: PgSchema,
    admin: Client,
}

impl Db {
    async fn new(test: &str) -> Option<Self> {
        let schema = PgSchema::create("st_pg", test).await?;
        let admin = common::client(&common::config(&schema)).await;
        Some(Self { schema, admin })
    }

    fn config(&self) -> Config {
        common::config(&self.schema)
    }

    async fn migrated(&self) -> PgStore {
        let store = common::store(&self.config(), Conns::Pool(2)).await;
        store.migrate().await.expect("migrate");
        store
    }

    async fn claims(&self) -> i64 {
        common::count(&self.admin, "SELECT count(*) FROM idem_processed", &[]).await
    }

    async fn drop(self) {
        self.schema.drop().await;
    }
}

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("valid id"), b"{}".to_vec())
}

/// Processes `id` with `handler` and returns the error it must fail with.
async fn failure<S, F>(processor: &Processor<S>, id: &str, handler: F) -> Error
where
    S: ClaimStore,
    F: AsyncFnOnce(&mut S::Tx) -> Result<(), BoxError>,
{
    match processor.process(&msg(id), handler).await {
        Ok(outcome) => panic!("{id}: expected a failure, got {outcome:?}"),
        Err(e) => e,
    }
}

/// The kind a database state must map to, and what a consumer then does.
fn assert_state(what: &str, err: &Error, kind: ErrorKind) {
    assert_eq!(err.kind(), kind, "{what}: {err}");
    let expected = match kind {
        ErrorKind::Unavailable
        | ErrorKind::ConnectionLost
        | ErrorKind::OutcomeUnknown
        | ErrorKind::Transient
        | ErrorKind::Store
        | ErrorKind::Handler => Disposition::Retry,
        _ => Disposition::Fatal,
    };
    assert_eq!(err.disposition(), expected, "{what}: {err}");
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
        ("25006", ErrorKind::Unavailable),    // read_only_sql_transaction
        ("53100", ErrorKind::Unavailable),    // disk_full
        ("53200", ErrorKind::Unavailable),    // out_of_memory
        ("53300", ErrorKind::Unavailable),    // too_many_connections
        ("57P01", ErrorKind::ConnectionLost), // admin_shutdown: the session ends
        ("58030", ErrorKind::Unavailable),    // io_error
        ("08006", ErrorKind::ConnectionLost), // connection_failure
        // Under the handler's own statement, a refusal that stops a consumer under idem's
        // (the real states below) is this message's own failure: retried, then dead-lettered.
        ("42501", ErrorKind::Store), // insufficient_privilege (and a row-level-security check)
        ("42P01", ErrorKind::Store), // undefined_table
        ("42703", ErrorKind::Store), // undefined_column
        ("3F000", ErrorKind::Store), // invalid_schema_name
        ("40001", ErrorKind::Transient), // serialization_failure
        ("40P01", ErrorKind::Transient), // deadlock_detected
        ("57014", ErrorKind::Transient), // query_canceled (statement_timeout)
        ("23505", ErrorKind::Store), // unique_violation: about the message's data
    ];
    for (code, kind) in cases {
        let sql = format!(
            "DO $$ BEGIN RAISE EXCEPTION 'simulated {code}' USING ERRCODE = '{code}'; END $$"
        );
        let err = failure(&p, &format!("m-{code}"), async |tx| {
            tx.batch_execute(&sql).await?;
            Ok(())
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
    for conns in [Conns::Pool(2), Conns::Clients(1)] {
        let mut config = db.config();
        let options = format!(
            "{} -c default_transaction_read_only=on",
            config.get_options().unwrap_or_default()
        );
        config.options(options);
        let p = Processor::builder(common::store(&config, conns).await, "states")
            .build()
            .expect("p");
        let ran = AtomicBool::new(false);
        let err = failure(&p, "m-ro", async |_tx| {
            ran.store(true, Ordering::SeqCst);
            Ok(())
        })
        .await;
        assert_state("read-only", &err, ErrorKind::Unavailable);
        assert!(err.to_string().contains("25006"), "{err}");
        assert!(!ran.into_inner(), "the handler ran on a read-only database");
    }
    assert_eq!(db.claims().await, 0);
    db.drop().await;
}

#[tokio::test]
async fn a_store_whose_migration_never_ran_is_misconfigured() {
    let Some(db) = Db::new("a_store_whose_migration_never_ran_is_misconfigured").await else {
        return;
    };
    let store = common::store(&db.config(), Conns::Pool(2))
        .await
        .with_table(TableName::new("never_migrated").expect("name"))
        .expect("table");
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-1", async |_tx| Ok(())).await;
    assert_state("missing table", &err, ErrorKind::Misconfigured);
    assert!(err.to_string().contains("never_migrated"), "{err}");
    // The batch claim too.
    let batch = p
        .process_batch_set(&[msg("m-2")], async |_tx, _fresh| Ok::<_, BoxError>(()))
        .await
        .expect_err("batch on a missing table");
    assert_state("missing table, batch", &batch, ErrorKind::Misconfigured);
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
    db.admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {} TO {role}",
            db.schema.name()
        ))
        .await
        .expect("role");
    let mut config = db.config();
    config.user(&role);
    let store = common::store(&config, Conns::Pool(2)).await;
    let p = Processor::builder(store, "states").build().expect("p");
    let err = failure(&p, "m-np", async |_tx| Ok(())).await;
    assert_state("permission denied", &err, ErrorKind::Misconfigured);
    drop(p);

    db.admin
        .batch_execute(&format!("ALTER ROLE {role} CONNECTION LIMIT 0"))
        .await
        .expect("limit");
    let host = match config.get_hosts().first() {
        Some(idem_postgres::tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        other => panic!("IDEM_TEST_POSTGRES_URL is not TCP: {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let dbname = config.get_dbname().unwrap_or("postgres");
    let url = format!("host={host} port={port} user={role} dbname={dbname}");
    let err = PgStore::connect(&url)
        .await
        .expect_err("no connection slot is left for the role");
    assert_state("too many connections", &err, ErrorKind::Unavailable);

    let admin = common::client(&db.config()).await;
    db.drop().await;
    let _ = admin.batch_execute(&format!("DROP ROLE {role}")).await;
}

/// A connection lost between the handler and the commit: the commit's outcome is unknown, a
/// retryable outage, and the retry finds out what happened (here: nothing committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_at_commit_is_outcome_unknown() {
    let Some(db) = Db::new("a_connection_lost_at_commit_is_outcome_unknown").await else {
        return;
    };
    db.migrated().await;
    for conns in [Conns::Pool(1), Conns::Clients(2)] {
        let p = Processor::builder(common::store(&db.config(), conns).await, "states")
            .build()
            .expect("p");
        let err = failure(&p, "m-lost", async |tx| {
            let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
            db.admin
                .execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await?;
            // Let the connection notice before the commit goes out.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            Ok(())
        })
        .await;
        assert_state("lost at commit", &err, ErrorKind::OutcomeUnknown);
        assert!(err.is_outage(), "{err:?}");
        let retry = p
            .process(&msg("m-lost"), async |_tx| Ok::<_, BoxError>(()))
            .await
            .expect("the retry");
        assert!(matches!(retry, Outcome::Processed(())), "{retry:?}");
        let admin = &db.admin;
        admin
            .batch_execute("DELETE FROM idem_processed")
            .await
            .expect("clean up");
    }
    db.drop().await;
}

/// A handler whose statement ends its own session (`pg_terminate_backend(pg_backend_pid())`,
/// in production an out-of-memory kill): the connection is lost under the handler, so the
/// error is `ConnectionLost`, and the store's probe answers right after on another connection
/// — what lets a consumer pin the loss on the message instead of waiting it out for ever.
#[tokio::test]
async fn a_handler_that_ends_its_own_session_loses_its_connection_and_the_probe_answers() {
    let test = "a_handler_that_ends_its_own_session_loses_its_connection_and_the_probe_answers";
    let Some(db) = Db::new(test).await else {
        return;
    };
    db.migrated().await;
    for (n, conns) in [Conns::Pool(2), Conns::Clients(2)].into_iter().enumerate() {
        let store = common::store(&db.config(), conns).await;
        let p = Processor::builder(store.clone(), "states")
            .build()
            .expect("p");
        let err = failure(&p, &format!("m-kill-{n}"), async |tx| {
            tx.batch_execute("SELECT pg_terminate_backend(pg_backend_pid())")
                .await?;
            Ok(())
        })
        .await;
        assert_state(
            "session ended under the handler",
            &err,
            ErrorKind::ConnectionLost,
        );
        assert!(err.is_connection_lost() && err.is_outage(), "{err:?}");
        store.probe().await.expect("the store answers a probe");
        let next = p
            .process(&msg(&format!("m-next-{n}")), async |_tx| {
                Ok::<_, BoxError>(())
            })
            .await
            .expect("next");
        assert!(matches!(next, Outcome::Processed(())), "{next:?}");
    }
    assert_eq!(db.claims().await, 2, "only the m-next claims committed");
    db.drop().await;
}

/// A handler that swallows a failed statement: PostgreSQL aborted the transaction, and the
/// commit (`SELECT 1; COMMIT`) reports it as a retryable handler failure that names the cause,
/// where a bare `COMMIT` would have rolled back and reported success.
#[tokio::test]
async fn a_swallowed_error_fails_the_commit_with_its_cause() {
    let Some(db) = Db::new("a_swallowed_error_fails_the_commit_with_its_cause").await else {
        return;
    };
    db.migrated().await;
    for (n, conns) in [Conns::Pool(1), Conns::Clients(1)].into_iter().enumerate() {
        let p = Processor::builder(common::store(&db.config(), conns).await, "states")
            .build()
            .expect("p");
        let err = failure(&p, &format!("m-swallow-{n}"), async |tx| {
            let _ignored = tx.execute("SELECT * FROM idem_no_such_table", &[]).await;
            Ok(())
        })
        .await;
        assert_state("swallowed", &err, ErrorKind::Handler);
        assert!(err.to_string().contains("aborted the transaction"), "{err}");
        // The connection (or its replacement) serves the next message.
        let next = p
            .process(&msg(&format!("m-next-{n}")), async |_tx| {
                Ok::<_, BoxError>(())
            })
            .await
            .expect("next");
        assert!(matches!(next, Outcome::Processed(())), "{next:?}");
    }
    assert_eq!(db.claims().await, 2, "only the m-next claims committed");
    db.drop().await;
}
