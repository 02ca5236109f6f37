//! `payments --card-processor URL` against the test kit's fake card processor (in this
//! process), each real broker and each database: the charge is made once at the processor and
//! written once, with the processor's ID, whatever is lost or killed between the two.

use std::time::{Duration, Instant};

use idem_testkit::fake_processor::{FakeProcessor, Fault};
use idem_testkit::isolated::{MySqlDatabase, PgSchema};
use idem_testkit::{service_url, services, unique_name};

use super::payments::{Service, publish, teardown};

/// The database a run writes to: its URL for the service, and how to read its charges back.
enum Db {
    Sqlite(std::path::PathBuf),
    Postgres(PgSchema),
    MySql(MySqlDatabase),
}

impl Db {
    /// A fresh database of `kind` for `test`; `None` (after `SKIPPING`) when its service is
    /// not configured.
    fn create(
        rt: &tokio::runtime::Runtime,
        kind: &str,
        test: &str,
        dir: &std::path::Path,
    ) -> Option<Self> {
        match kind {
            "sqlite" => Some(Db::Sqlite(dir.join("payments.db"))),
            "postgres" => rt
                .block_on(PgSchema::create("pay_card", test))
                .map(Db::Postgres),
            "mysql" => rt
                .block_on(MySqlDatabase::create("pay_card", test))
                .map(Db::MySql),
            other => panic!("no database {other}"),
        }
    }

    fn url(&self) -> String {
        match self {
            Db::Sqlite(path) => format!("sqlite:{}", path.display()),
            Db::Postgres(schema) => {
                let mut url =
                    url::Url::parse(schema.url()).expect("IDEM_TEST_POSTGRES_URL is a URL");
                url.query_pairs_mut()
                    .append_pair("options", &format!("-c search_path={}", schema.name()));
                url.to_string()
            }
            Db::MySql(db) => {
                let mut url = url::Url::parse(db.url()).expect("IDEM_TEST_MYSQL_URL is a URL");
                url.set_path(db.name());
                url.to_string()
            }
        }
    }

    /// `(message_id, processor_charge_id)` of every charge row, in ID order.
    fn charges(&self, rt: &tokio::runtime::Runtime) -> Vec<(String, Option<String>)> {
        const SQL: &str = "SELECT message_id, processor_charge_id FROM charges ORDER BY id";
        rt.block_on(async {
            match self {
                Db::Sqlite(_) => {
                    let pool = sqlx::SqlitePool::connect(&self.url()).await.expect("open");
                    let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("charges");
                    pool.close().await;
                    rows
                }
                Db::Postgres(schema) => {
                    let pool = schema.pool(1).await;
                    let rows = sqlx::query_as(SQL).fetch_all(&pool).await.expect("charges");
                    pool.close().await;
                    rows
                }
                Db::MySql(db) => {
                    let pool = db.pool(1).await;
                    // VARBINARY columns read as bytes.
                    let rows: Vec<(Vec<u8>, Option<Vec<u8>>)> =
                        sqlx::query_as(SQL).fetch_all(&pool).await.expect("charges");
                    pool.close().await;
                    let text = |b: Vec<u8>| String::from_utf8(b).expect("UTF-8");
                    rows.into_iter()
                        .map(|(m, p)| (text(m), p.map(text)))
                        .collect()
                }
            }
        })
    }

    fn drop_all(self, rt: &tokio::runtime::Runtime) {
        match self {
            Db::Sqlite(_) => {}
            Db::Postgres(schema) => rt.block_on(schema.drop()),
            Db::MySql(db) => rt.block_on(db.drop()),
        }
    }
}

/// What one test needs: a runtime for the fake processor and the database reads, the fake,
/// the broker, a source of its own and the database.
struct Setup {
    rt: tokio::runtime::Runtime,
    fake: FakeProcessor,
    broker: String,
    source: String,
    dir: std::path::PathBuf,
    db: Db,
}

impl Setup {
    fn new(test: &str, var: &str, to_url: impl Fn(String) -> String, db: &str) -> Option<Self> {
        let url = service_url(var, test)?;
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let source = unique_name("card", test).replace('_', "-");
        let dir = std::env::temp_dir().join(&source);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let db = Db::create(&rt, db, test, &dir)?;
        let fake = rt.block_on(FakeProcessor::start()).expect("fake processor");
        Some(Self {
            rt,
            fake,
            broker: to_url(url),
            source,
            dir,
            db,
        })
    }

    fn start(&self, instance: &str, extra: &[&str]) -> Service {
        let database = self.db.url();
        let url = self.fake.url();
        let mut args = vec![
            "--broker",
            &self.broker,
            "--source",
            &self.source,
            "--database",
            &database,
            "--consumer",
            &self.source,
            "--instance",
            instance,
            "--card-processor",
            &url,
        ];
        args.extend_from_slice(extra);
        let mut svc = Service::start(&args);
        assert!(
            svc.wait_for("consumer started", 1, Duration::from_secs(30)),
            "service starts: {:?}",
            svc.log
        );
        svc
    }

    /// Waits until the database holds `n` charge rows.
    fn wait_rows(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.db.charges(&self.rt).len() >= n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    }

    fn finish(self, instance: &str) {
        teardown(&self.broker, &self.source, &self.source, instance);
        let _ = std::fs::remove_dir_all(&self.dir);
        self.db.drop_all(&self.rt);
    }
}

/// The processor charges and drops its answer; idem-client retries with the same derived key
/// and gets the charge replayed: one charge at the processor, one row with its ID. A
/// redelivery is a duplicate; the same ID with another payload is dead-lettered `conflict`.
fn answer_dropped_after_charging(
    test: &str,
    var: &str,
    to_url: impl Fn(String) -> String,
    db: &str,
) {
    let Some(setup) = Setup::new(test, var, to_url, db) else {
        return;
    };
    let instance = format!("{}-1", setup.source);
    setup.fake.fault_next(Fault::ChargeThenDrop);
    let mut svc = setup.start(&instance, &[]);
    publish(
        &setup.broker,
        &setup.source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    assert!(
        svc.wait_for("outcome=", 1, Duration::from_secs(60)),
        "the charge settles: {:?}",
        svc.log
    );
    let again = publish(
        &setup.broker,
        &setup.source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    let conflict = publish(
        &setup.broker,
        &setup.source,
        "pay-1",
        r#"{"account":"alice","amount_cents":999}"#,
    );
    // JetStream drops a repeated Nats-Msg-Id at publish time (its duplicate window).
    let dropped_at_publish = again.contains("note:") && conflict.contains("note:");
    let settled = dropped_at_publish || svc.wait_for("outcome=", 3, Duration::from_secs(60));
    let (status, log) = svc.terminate();
    assert!(settled, "every delivery settled: {log:#?}");
    assert!(status.success(), "exits 0 on SIGTERM: {status:?} {log:#?}");
    let count = |needle: &str| log.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count(r#"outcome="processed""#), 1, "{log:#?}");
    if !dropped_at_publish {
        assert_eq!(count(r#"outcome="duplicate""#), 1, "{log:#?}");
        assert_eq!(count("reason=conflict"), 1, "{log:#?}");
    }

    let stats = setup.fake.stats();
    assert_eq!(
        stats.total_effects(),
        1,
        "one charge at the processor: {stats:?}"
    );
    assert!(
        stats.calls >= 2,
        "the dropped answer was retried: {stats:?}"
    );
    let rows = setup.db.charges(&setup.rt);
    assert_eq!(rows.len(), 1, "one charge row: {rows:?}");
    assert_eq!(rows[0].0, "pay-1");
    assert!(
        rows[0].1.as_deref().is_some_and(|id| id.starts_with("ch_")),
        "the row carries the processor's ID: {rows:?}"
    );
    setup.finish(&instance);
}

/// The service is killed after the processor charged and before the `Record` point
/// committed; a new process takes the record over once its lease is past (the redelivery or
/// the in-process completer) and resumes at `Charge`: the call repeats with the same derived
/// key, the processor replays its charge, and the row is written once.
fn killed_mid_phase(test: &str, var: &str, to_url: impl Fn(String) -> String, db: &str) {
    let Some(setup) = Setup::new(test, var, to_url, db) else {
        return;
    };
    let instance = format!("{}-1", setup.source);
    let quick = ["--phase-lease", "2s", "--redeliver-after", "2s"];
    let mut first = setup.start(
        &instance,
        &[&quick[..], &["--test-pause-after-charge", "10m"]].concat(),
    );
    publish(
        &setup.broker,
        &setup.source,
        "pay-1",
        r#"{"account":"alice","amount_cents":1250}"#,
    );
    assert!(
        first.wait_for(
            "test hook: the processor charged",
            1,
            Duration::from_secs(60)
        ),
        "the first process reaches the pause: {:?}",
        first.log
    );
    first.kill();
    assert_eq!(setup.fake.stats().total_effects(), 1);
    assert!(
        setup.db.charges(&setup.rt).is_empty(),
        "nothing recorded before the kill"
    );

    let second = setup.start(&instance, &quick);
    let recorded = setup.wait_rows(1, Duration::from_secs(90));
    // Let a late redelivery settle (a duplicate) before counting.
    std::thread::sleep(Duration::from_secs(3));
    let (status, log) = second.terminate();
    assert!(recorded, "the charge is resumed and recorded: {log:#?}");
    assert!(status.success(), "{log:#?}");
    let stats = setup.fake.stats();
    assert_eq!(
        stats.total_effects(),
        1,
        "one charge at the processor: {stats:?}"
    );
    let keys: Vec<_> = stats.calls_by_key.keys().cloned().collect();
    assert_eq!(keys.len(), 1, "every call under one derived key: {stats:?}");
    assert!(
        stats.calls_for(&keys[0]) >= 2,
        "the call repeated with that key: {stats:?}"
    );
    let rows = setup.db.charges(&setup.rt);
    assert_eq!(rows.len(), 1, "one charge row: {rows:?}");
    assert!(
        rows[0].1.as_deref().is_some_and(|id| id.starts_with("ch_")),
        "{rows:?}"
    );
    let count = |needle: &str| log.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count("reason="), 0, "nothing dead-lettered: {log:#?}");
    setup.finish(&instance);
}

#[test]
fn card_answer_dropped_nats_sqlite() {
    answer_dropped_after_charging(
        "card_answer_dropped_nats_sqlite",
        services::NATS,
        |u| u,
        "sqlite",
    );
}

#[test]
fn card_answer_dropped_nats_postgres() {
    answer_dropped_after_charging(
        "card_answer_dropped_nats_postgres",
        services::NATS,
        |u| u,
        "postgres",
    );
}

#[test]
fn card_answer_dropped_nats_mysql() {
    answer_dropped_after_charging(
        "card_answer_dropped_nats_mysql",
        services::NATS,
        |u| u,
        "mysql",
    );
}

#[test]
fn card_answer_dropped_rabbitmq_sqlite() {
    answer_dropped_after_charging(
        "card_answer_dropped_rabbitmq_sqlite",
        services::AMQP,
        |u| u,
        "sqlite",
    );
}

#[test]
fn card_answer_dropped_rabbitmq_postgres() {
    answer_dropped_after_charging(
        "card_answer_dropped_rabbitmq_postgres",
        services::AMQP,
        |u| u,
        "postgres",
    );
}

#[test]
fn card_answer_dropped_redis_streams_mysql() {
    answer_dropped_after_charging(
        "card_answer_dropped_redis_streams_mysql",
        services::REDIS,
        |u| u,
        "mysql",
    );
}

#[test]
fn card_killed_mid_phase_nats_sqlite() {
    killed_mid_phase(
        "card_killed_mid_phase_nats_sqlite",
        services::NATS,
        |u| u,
        "sqlite",
    );
}

#[test]
fn card_killed_mid_phase_nats_postgres() {
    killed_mid_phase(
        "card_killed_mid_phase_nats_postgres",
        services::NATS,
        |u| u,
        "postgres",
    );
}

#[test]
fn card_killed_mid_phase_nats_mysql() {
    killed_mid_phase(
        "card_killed_mid_phase_nats_mysql",
        services::NATS,
        |u| u,
        "mysql",
    );
}

#[test]
fn card_killed_mid_phase_rabbitmq_sqlite() {
    killed_mid_phase(
        "card_killed_mid_phase_rabbitmq_sqlite",
        services::AMQP,
        |u| u,
        "sqlite",
    );
}
