//! Savepoints inside a handler's transaction, against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`.
//!
//! `Client::transaction` cannot be called on a [`PgTx`] (it derefs to `&Client` only), so a
//! handler nests with [`PgTx::savepoint`]: a released savepoint commits nothing before the
//! transaction does (a later failure rolls everything back, and the redelivery is processed),
//! a rolled-back one undoes only its part, and one dropped open fails the commit.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::Conns;
use idem_core::{BoxError, Message, MessageId, Migrate, Outcome, Processor};
use idem_postgres::tokio_postgres::Client;
use idem_postgres::{PgStore, PgTx};
use idem_testkit::isolated::PgSchema;

fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("id"), b"x".to_vec())
}

async fn insert(tx: &PgTx, k: &str) -> Result<(), BoxError> {
    tx.execute("INSERT INTO effects (k) VALUES ($1)", &[&k])
        .await?;
    Ok(())
}

async fn count(admin: &Client, sql: &str) -> i64 {
    common::count(admin, sql, &[]).await
}

/// A migrated store with an `effects` table, and an admin client.
async fn setup(test: &str, conns: Conns) -> Option<(PgSchema, PgStore, Client)> {
    let schema = PgSchema::create("idem_pgtx", test).await?;
    let config = common::config(&schema);
    let store = common::store(&config, conns).await;
    store.migrate().await.expect("migrate");
    let admin = common::client(&config).await;
    admin
        .batch_execute("CREATE TABLE effects (k text NOT NULL)")
        .await
        .expect("effects");
    Some((schema, store, admin))
}

async fn savepoints(conns: Conns, test: &str) {
    let Some((schema, store, admin)) = setup(test, conns).await else {
        return;
    };
    let p = Processor::builder(store.clone(), "nest")
        .build()
        .expect("p");

    // Released, then the handler fails: nothing of it, nor its claim, is committed.
    let released = AtomicBool::new(false);
    let failed = p
        .process(&msg("m-1"), async |tx| {
            insert(tx, "outer-1").await?;
            let sp = tx.savepoint().await?;
            insert(&sp, "inner").await?;
            sp.release().await?;
            released.store(true, Ordering::SeqCst);
            assert_eq!(
                count(&admin, "SELECT count(*) FROM idem_processed").await,
                0,
                "a released savepoint commits nothing"
            );
            insert(tx, "outer-2").await?;
            Err::<(), BoxError>("fails after its savepoint was released".into())
        })
        .await;
    assert!(
        failed.is_err() && released.load(Ordering::SeqCst),
        "{failed:?}"
    );
    assert_eq!(count(&admin, "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        count(&admin, "SELECT count(*) FROM idem_processed").await,
        0
    );
    let again = p
        .process(&msg("m-1"), async |tx| insert(tx, "redelivered").await)
        .await;
    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");

    // Rolled back (after a failed statement in it, even), then nested ones: only its part
    // is undone.
    let done = p
        .process(&msg("m-2"), async |tx| {
            insert(tx, "kept-1").await?;
            let mut sp = tx.savepoint().await?;
            insert(&sp, "undone").await?;
            let deeper = sp.savepoint().await?;
            insert(&deeper, "undone-deeper").await?;
            deeper.release().await?;
            assert!(
                sp.execute("SELECT * FROM no_such_table", &[])
                    .await
                    .is_err()
            );
            sp.rollback().await?;
            insert(tx, "kept-2").await?;
            Ok::<_, BoxError>(())
        })
        .await;
    assert!(matches!(done, Ok(Outcome::Processed(()))), "{done:?}");
    let kept = count(
        &admin,
        "SELECT count(*) FROM effects WHERE k IN ('kept-1', 'kept-2')",
    )
    .await;
    let undone = count(
        &admin,
        "SELECT count(*) FROM effects WHERE k LIKE 'undone%'",
    )
    .await;
    assert_eq!((kept, undone), (2, 0));

    // Dropped open: the commit fails and nothing is committed.
    let dropped = p
        .process(&msg("m-3"), async |tx| {
            insert(tx, "lost-1").await?;
            {
                let sp = tx.savepoint().await?;
                insert(&sp, "lost-2").await?;
            }
            insert(tx, "lost-3").await?;
            Ok::<_, BoxError>(())
        })
        .await;
    let err = dropped.expect_err("a savepoint dropped open fails the commit");
    assert!(err.to_string().contains("savepoint"), "{err}");
    assert_eq!(
        count(&admin, "SELECT count(*) FROM effects WHERE k LIKE 'lost%'").await,
        0
    );
    let again = p
        .process(&msg("m-3"), async |tx| insert(tx, "m-3").await)
        .await;
    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
    drop((p, store, admin));
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoints_nest_inside_the_claim_transaction_pooled() {
    savepoints(Conns::Pool(2), "savepoints_pooled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoints_nest_inside_the_claim_transaction_on_clients() {
    savepoints(Conns::Clients(1), "savepoints_clients").await;
}
