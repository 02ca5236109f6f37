//! Static group membership (KIP-345): a member restarted with its instance ID takes its
//! partitions back and the others see no rebalance; a static member's close does not leave,
//! so its partitions wait for the session timeout (both on real brokers: rdkafka's
//! MockCluster does not implement static membership, it rebalances on every join); a broker
//! without static membership (JoinGroup before v5) makes it a dynamic member that leaves on
//! close.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Cluster, Db, Member, MockBroker, fast_group, wait_until};
use idem_kafka::rdkafka::types::RDKafkaApiKey;
use idem_kafka::{KafkaProducer, KafkaSource, KafkaSourceBuilder, Membership};
use idem_testkit::unique_name;

const PARTITIONS: i32 = 4;

/// Short heartbeats as in the other group tests, and `session` as the session timeout.
fn member(topic: &str, group: &str, session: Duration) -> KafkaSourceBuilder {
    fast_group(KafkaSource::builder(topic, group))
        .set_consumer("session.timeout.ms", session.as_millis().to_string())
}

/// Whether `members` between them hold every partition of `topic`, each exactly once.
fn split(members: &[&Membership], topic: &str) -> bool {
    let mut all = BTreeSet::new();
    for m in members {
        for (t, p) in m.held() {
            if t != topic || !all.insert(p) {
                return false;
            }
        }
    }
    all.len() == PARTITIONS as usize && members.iter().all(|m| !m.held().is_empty())
}

/// Waits until `members` split the partitions and no callback has moved for `quiet`: the
/// group's joins are over.
async fn settled(members: &[&Membership], topic: &str, quiet: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let counts = || -> Vec<(u64, u64)> {
        members
            .iter()
            .map(|m| (m.assignments(), m.revocations()))
            .collect()
    };
    while tokio::time::Instant::now() < deadline {
        let before = counts();
        if split(members, topic) {
            tokio::time::sleep(quiet).await;
            if counts() == before && split(members, topic) {
                return true;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    false
}

/// What [`restart_one_of_two`] saw.
struct Restart {
    /// The partitions the restarted member held before, and whether it held them again after.
    a_held: Vec<(String, i32)>,
    back: bool,
    a_after: Membership,
    /// The other member's partitions and revocation count before and after the restart.
    b_before: (Vec<(String, i32)>, u64),
    b_after: (Vec<(String, i32)>, u64),
    /// Every message published after the restart was consumed.
    consumed: bool,
}

/// Members `a` and `b` of one group, each built by `builder` from its name, once they split
/// `topic`'s partitions between them and no assignment has changed for `quiet`.
async fn start_two(
    db: &Db,
    cluster: &Cluster,
    topic: &str,
    quiet: Duration,
    builder: impl Fn(&str) -> KafkaSourceBuilder,
) -> (Member, Member) {
    let a = Member::start(db, "static-test", cluster.brokers(), builder("a")).await;
    let b = Member::start(db, "static-test", cluster.brokers(), builder("b")).await;
    assert!(
        settled(&[&a.membership, &b.membership], topic, quiet).await,
        "the members split the partitions: a {:?}, b {:?}",
        a.membership,
        b.membership
    );
    (a, b)
}

/// Two members of one group on a 4-partition topic; `a` stops (the runner closes its source)
/// and starts again with the same builder.
async fn restart_one_of_two(cluster: Cluster, test: &str, static_members: bool) -> Restart {
    common::init_logs();
    let topic = unique_name("idem", test);
    let group = format!("{topic}-group");
    cluster.create_topics(&[&topic], PARTITIONS).await;
    let db = Db::new(test).await;
    // Long enough for a restart on tansu, which holds a static member's JoinGroup and
    // SyncGroup 3 s each.
    let session = Duration::from_secs(30);
    let builder = |name: &str| {
        let b = member(&topic, &group, session);
        if static_members {
            b.static_member(format!("{group}-{name}"))
        } else {
            b
        }
    };

    let (a, b) = start_two(&db, &cluster, &topic, Duration::from_secs(3), builder).await;
    if static_members {
        assert_eq!(a.membership.static_member(), Some(&*format!("{group}-a")));
    }
    let a_held = a.membership.held();
    let b_before = (b.membership.held(), b.membership.revocations());
    let b_membership = b.membership.clone();

    a.stop().await;
    let a = Member::start(&db, "static-test", cluster.brokers(), builder("a")).await;
    let back = wait_until(Duration::from_secs(60), async || {
        a.membership.held() == a_held
    })
    .await;
    // Time for a rebalance to show if one was coming (a heartbeat is 0.5 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let b_after = (b_membership.held(), b_membership.revocations());

    // The restarted member consumes its partitions: keyed messages land on every partition.
    let producer = KafkaProducer::connect(cluster.brokers())
        .await
        .expect("producer");
    let n = 40;
    for i in 0..n {
        producer
            .publish(
                &topic,
                Some(format!("k{i}").as_bytes()),
                &format!("m-{i}"),
                b"x",
            )
            .await
            .expect("publish");
    }
    let consumed = {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let done = db.effects().await.len() >= n;
            if done || tokio::time::Instant::now() > deadline {
                break done;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let a_after = a.membership.clone();
    a.stop().await;
    b.stop().await;
    db.close().await;
    Restart {
        a_held,
        back,
        a_after,
        b_before,
        b_after,
        consumed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_static_member_takes_its_partitions_back_without_a_rebalance() {
    let test = "static_member_restart";
    let Some(brokers) = idem_testkit::service_url(idem_testkit::services::KAFKA, test) else {
        return;
    };
    let r = restart_one_of_two(Cluster::Real(brokers), test, true).await;
    assert!(
        r.back,
        "the restarted member holds {:?} again: {:?}",
        r.a_held, r.a_after
    );
    assert_eq!(
        r.b_after, r.b_before,
        "the other member kept its partitions and saw no revocation"
    );
    assert!(r.consumed, "every message consumed after the restart");
}

/// The same restart without static membership: the member leaves on close and joins anew, and
/// the other one is rebalanced. Shows that the static test's measure sees a rebalance when
/// there is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_dynamic_member_rebalances_the_other() {
    let test = "dynamic_member_restart";
    let Some(brokers) = idem_testkit::service_url(idem_testkit::services::KAFKA, test) else {
        return;
    };
    let r = restart_one_of_two(Cluster::Real(brokers), test, false).await;
    assert!(
        r.b_after.1 > r.b_before.1,
        "the other member was rebalanced: {:?} → {:?}",
        r.b_before,
        r.b_after
    );
    assert!(r.consumed, "every message consumed after the restart");
}

/// Two static members; one closes and does not come back. Closing does not leave: the other
/// member is not rebalanced until the closed one's session has timed out. Real brokers: the
/// mock cluster names members without their instance ID, so idem treats them as dynamic.
///
/// What the survivor gets then is the broker's business: Kafka hands it every partition;
/// tansu 0.6.0 gives it back only its own, and the gone member's stay with nobody until a
/// member joins anew (its expiry from a static member's heartbeat leaves the group formed,
/// with the old assignment).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_closed_static_member_keeps_its_partitions_until_its_session_times_out() {
    let test = "static_member_close";
    let Some(brokers) = idem_testkit::service_url(idem_testkit::services::KAFKA, test) else {
        return;
    };
    common::init_logs();
    let cluster = Cluster::Real(brokers);
    let topic = unique_name("idem", test);
    let group = format!("{topic}-group");
    cluster.create_topics(&[&topic], PARTITIONS).await;
    let db = Db::new(test).await;
    let session = Duration::from_secs(10);
    let start =
        |name: &str| member(&topic, &group, session).static_member(format!("{group}-{name}"));
    let (a, b) = start_two(&db, &cluster, &topic, Duration::from_secs(3), start).await;
    let b_membership = b.membership.clone();
    let revocations = b_membership.revocations();
    let closed = tokio::time::Instant::now();
    a.stop().await;
    let rebalanced = async || b_membership.revocations() > revocations;
    // A leave would rebalance the other member on its next heartbeat (0.5 s).
    let early = wait_until(Duration::from_secs(5), rebalanced).await;
    let expired = wait_until(Duration::from_secs(60), rebalanced).await;
    let took = closed.elapsed();
    b.stop().await;
    db.close().await;
    assert!(
        !early,
        "the other member was rebalanced {took:?} after the close: the static member left"
    );
    assert!(
        expired && took >= Duration::from_secs(8),
        "the closed member's session ({session:?}) timed out and the group rebalanced: \
         {took:?}, {b_membership:?}"
    );
}

/// A broker whose JoinGroup is older than v5 cannot take a `group.instance.id`: librdkafka
/// joins without it, and the source must then close as the dynamic member it is (leave at
/// once), not wait for a session timeout no static membership buys.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_broker_support_a_static_member_falls_back_to_dynamic() {
    common::init_logs();
    let cluster = Cluster::Mock(MockBroker::start_with(|mock| {
        mock.apiversion(RDKafkaApiKey::JoinGroup, Some(0), Some(4))
            .expect("limit JoinGroup to v4");
    }));
    let topic = unique_name("idem", "static_refused");
    let group = format!("{topic}-group");
    cluster.create_topics(&[&topic], PARTITIONS).await;
    let db = Db::new("static_refused").await;
    // The mock waits up to the session timeout for members to (re)join: keep it short, but
    // well above the time a leave takes to reach the other member (a heartbeat, 0.5 s).
    let session = Duration::from_secs(10);
    let (a, b) = start_two(
        &db,
        &cluster,
        &topic,
        Duration::from_secs(1),
        |name: &str| member(&topic, &group, session).static_member(name),
    )
    .await;
    assert_eq!(
        (a.membership.static_member(), b.membership.static_member()),
        (None, None),
        "the refusal is noticed"
    );
    let b_membership = b.membership.clone();
    let revocations = b_membership.revocations();
    let closed = tokio::time::Instant::now();
    a.stop().await;
    // A leave starts a rebalance at once: the other member's partitions are revoked on its next
    // heartbeat. Without one, nothing happens until the closed member's session times out.
    let rebalanced = wait_until(Duration::from_secs(5), async || {
        b_membership.revocations() > revocations
    })
    .await;
    let took = closed.elapsed();
    b.stop().await;
    db.close().await;
    assert!(
        rebalanced,
        "closing left the group: the other member was rebalanced well inside the {session:?} \
         session, not {took:?} after: {b_membership:?}"
    );
}

#[tokio::test]
async fn a_bad_static_member_id_is_refused_when_connecting() {
    for id in ["", "pod 1", "pod/1", &"x".repeat(250)] {
        let err = KafkaSource::builder("t", "g")
            .static_member(id)
            .connect("127.0.0.1:1")
            .await
            .expect_err(id);
        assert_eq!(err.kind(), idem_core::ErrorKind::InvalidConfig, "{id:?}");
        assert!(err.to_string().contains("static member ID"), "{err}");
    }
    let err = KafkaSource::builder("t", "g")
        .set_consumer("group.instance.id", "a b")
        .connect("127.0.0.1:1")
        .await
        .expect_err("set directly");
    assert_eq!(err.kind(), idem_core::ErrorKind::InvalidConfig);
}
