//! Processing futures can be handed to `tokio::spawn` from concrete (non-generic) code — the
//! way services use idem. This is mostly a compile-time check: it fails to build if the
//! store's transaction type ever carries a lifetime again (see `idem_sql::Tx`).

use std::sync::Arc;

use idem_core::{BoxError, Message, MessageId, Migrate, Outcome, Processor};
use idem_sql::{SqliteOptions, SqliteStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processing_runs_inside_spawned_tasks() -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(idem_testkit::unique_name("idem_spawn", "spawn"));
    std::fs::create_dir_all(&dir)?;
    let store = SqliteStore::open(dir.join("spawn.db"), SqliteOptions::default()).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE charges (message_id TEXT NOT NULL)")
        .execute(store.pool())
        .await?;
    let processor = Arc::new(Processor::builder(store, "billing").build()?);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let processor = Arc::clone(&processor);
        tasks.push(tokio::spawn(async move {
            let msg = Message::new(MessageId::new("pay-1")?, b"{}".to_vec());
            processor
                .process(&msg, async |tx| {
                    sqlx::query("INSERT INTO charges VALUES ('pay-1')")
                        .execute(&mut **tx)
                        .await
                })
                .await
        }));
    }
    let mut processed = 0;
    for t in tasks {
        if let Outcome::Processed(_) = t.await?? {
            processed += 1;
        }
    }
    assert_eq!(processed, 1);
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(processor.store().pool())
        .await?;
    assert_eq!(charges, 1);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
