//! Randomized-schedule test of the offset tracker under shuttle: the poll loop delivering, runner
//! tasks settling in any order (or abandoning), commits computed and failing, and partitions
//! revoked and reassigned, all sharing one [`Offsets`] behind a mutex as `source.rs` and
//! `delivery.rs` share it. A model kept under the same lock says what the tracker may report.
//!
//! The model assumes what librdkafka guarantees: within one assignment a partition's records
//! arrive in offset order, starting at the group's stored offset; and a revoke runs inside a
//! poll, never between a poll returning a record and `track` recording it, so no record of a
//! revoked partition is handed out until the partition is assigned again. (The tracker relies
//! on both: it learns of an assignment only from the first record delivered in it.)
//!
//! Each failure prints shuttle's failing schedule (replay it with `shuttle::replay`) and, for the
//! random scheduler, its seed (`SHUTTLE_RANDOM_SEED=<seed>` reruns that sequence).
//! `IDEM_SHUTTLE_ITERATIONS` raises the number of schedules for a longer soak.
//!
//! Checked to fail on purpose, under both schedulers and within the default iterations, against
//! broken trackers (then restored): `position()` returning `next` and ignoring what is in
//! flight; `settle` not comparing epochs (also with the right return value, so only the model's
//! own checks could see it); `revoke` returning the position but keeping the state.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use shuttle::rand::{Rng, thread_rng};
use shuttle::sync::{Mutex, MutexGuard, mpsc};
use shuttle::thread;

use super::{Offsets, PartitionKey, Ticket};

const PARTITIONS: i32 = 2;
/// Fetch rounds of the poll loop, each delivering one or two records.
const ROUNDS: usize = 4;
const REBALANCES: usize = 2;
const DEFAULT_ITERATIONS: usize = 2_000;

fn iterations() -> usize {
    std::env::var("IDEM_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ITERATIONS)
}

fn topic() -> Arc<str> {
    Arc::from("orders")
}

/// What the test knows about one partition, independently of the tracker.
#[derive(Debug, Default)]
struct Part {
    /// Bumped on every revoke: a delivery belongs to the generation it was handed out in.
    generation: u64,
    assigned: bool,
    /// The next offset the consumer fetches: the group's offset when assigned, then one past
    /// each record handed out.
    fetch: i64,
    /// Handed out in this generation and not settled (abandoned ones stay here).
    in_flight: BTreeSet<i64>,
    /// One past the highest offset handed out in this generation.
    next: Option<i64>,
    /// The last position reported for this generation (commit or revoke).
    last_reported: Option<i64>,
    /// Offsets whose processing finished in any generation, by any member, plus offsets the log
    /// does not have (compacted away). Everything below a committed position must be here.
    done: BTreeSet<i64>,
    /// The consumer group's stored offset for the partition.
    group: i64,
}

impl Part {
    /// What the tracker may commit at most: every offset below it is done and none is in
    /// flight in this generation.
    fn check_commit(&self, p: i32, pos: i64, what: &str) {
        assert!(self.assigned, "{what} {pos} for unassigned partition {p}");
        if let Some(&low) = self.in_flight.first() {
            assert!(
                pos <= low,
                "{what} {pos} of partition {p} passes offset {low}, still in flight"
            );
        }
        if let Some(next) = self.next {
            assert!(
                pos <= next,
                "{what} {pos} of partition {p} is past the highest delivered offset"
            );
        }
        self.check_done_below(p, pos, what);
        if let Some(last) = self.last_reported {
            assert!(
                pos >= last,
                "{what} {pos} of partition {p} went back from {last} within one assignment"
            );
        }
    }

    fn check_done_below(&self, p: i32, pos: i64, what: &str) {
        if let Some(missing) = (0..pos).find(|o| !self.done.contains(o)) {
            panic!("{what} {pos} of partition {p} skips offset {missing}, never processed");
        }
    }

    /// The position the tracker must report once the deliveries of this generation settled
    /// (abandoned ones excepted).
    fn expected_position(&self) -> Option<i64> {
        let next = self.next?;
        Some(self.in_flight.first().copied().unwrap_or(next))
    }
}

#[derive(Debug)]
struct World {
    offsets: Offsets,
    parts: HashMap<i32, Part>,
}

impl World {
    fn new() -> Self {
        let parts = (0..PARTITIONS)
            .map(|p| {
                (
                    p,
                    Part {
                        assigned: true,
                        ..Part::default()
                    },
                )
            })
            .collect();
        Self {
            offsets: Offsets::default(),
            parts,
        }
    }

    fn part(&mut self, p: i32) -> &mut Part {
        self.parts.get_mut(&p).expect("known partition")
    }

    /// The tracker's view of a partition: (position, in flight, epoch).
    fn tracked(&self, p: i32) -> Option<(i64, BTreeSet<i64>, u64)> {
        self.offsets
            .partitions
            .get(&(topic(), p))
            .map(|s| (s.position(), s.in_flight.clone(), s.epoch))
    }

    /// `take_commits` as the poll loop calls it, each position checked against the model.
    fn take_commits(&mut self, all: bool) -> Vec<(PartitionKey, i64)> {
        let commits = self.offsets.take_commits(all);
        for ((_, p), pos) in &commits {
            let part = self.part(*p);
            part.check_commit(*p, *pos, "commit");
            part.last_reported = Some(*pos);
        }
        commits
    }

    /// The broker stored `pos` as the group's offset.
    fn group_committed(&mut self, p: i32, pos: i64) {
        let part = self.part(p);
        part.check_done_below(p, pos, "group offset");
        part.group = pos;
    }
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|p| p.into_inner())
}

/// A runner task: processes its delivery, then settles it (ack or dead letter) or leaves it
/// unsettled (abandoned, or a dead letter that could not be published).
fn runner_task(world: Arc<Mutex<World>>, ticket: Ticket, generation: u64) {
    thread::yield_now();
    let abandon = thread_rng().gen_ratio(1, 8);
    let mut w = lock(&world);
    let p = ticket.partition;
    // Processing finished either way but for an abandon; a stale one committed its effect too.
    if abandon {
        return;
    }
    w.part(p).done.insert(ticket.offset);
    let before = w.tracked(p);
    let settled = w.offsets.settle(&ticket);
    let current = {
        let part = w.part(p);
        part.assigned && part.generation == generation
    };
    if current {
        assert!(settled, "a current delivery must settle: {ticket:?}");
        w.part(p).in_flight.remove(&ticket.offset);
    } else {
        assert!(
            !settled,
            "a delivery of a revoked assignment settled: {ticket:?}"
        );
        assert_eq!(
            before,
            w.tracked(p),
            "a settlement of an old assignment changed the new one: {ticket:?}"
        );
    }
}

/// The poll loop (`KafkaSource::next`): commits what is settled, then fetches and hands each
/// record to its own runner task.
fn poll_loop(world: Arc<Mutex<World>>, commits: mpsc::Sender<(PartitionKey, i64)>) {
    let mut tasks = Vec::new();
    for _ in 0..ROUNDS {
        let sent = lock(&world).take_commits(false);
        for c in sent {
            commits.send(c).expect("broker thread alive");
        }
        let fetched = thread_rng().gen_range(1..=2);
        for _ in 0..fetched {
            let p = thread_rng().gen_range(0..PARTITIONS);
            let mut w = lock(&world);
            let part = w.part(p);
            if !part.assigned {
                continue;
            }
            // Sometimes an offset is missing from the log (compaction, transaction markers).
            if thread_rng().gen_ratio(1, 6) {
                let gap = part.fetch;
                part.done.insert(gap);
                part.fetch += 1;
            }
            let offset = part.fetch;
            let generation = part.generation;
            part.fetch += 1;
            part.in_flight.insert(offset);
            part.next = Some(offset + 1);
            let ticket = w.offsets.deliver(&topic(), p, offset);
            drop(w);
            let world = world.clone();
            tasks.push(thread::spawn(move || {
                runner_task(world, ticket, generation)
            }));
        }
        thread::yield_now();
    }
    drop(commits);
    for t in tasks {
        t.join().expect("runner task");
    }
}

/// The coordinator: applies the commits in the order sent, or fails them (reported through the
/// commit callback, `commit_failed`).
fn broker(world: Arc<Mutex<World>>, commits: mpsc::Receiver<(PartitionKey, i64)>) {
    while let Ok((key, pos)) = commits.recv() {
        let mut w = lock(&world);
        if thread_rng().gen_ratio(1, 4) {
            w.offsets.commit_failed(&key, pos);
        } else {
            w.group_committed(key.1, pos);
        }
    }
}

/// The rebalance callbacks: revoke (committing the settled prefix synchronously), let another
/// member consume a little, then assign the partition back to this member.
fn rebalancer(world: Arc<Mutex<World>>) {
    for _ in 0..REBALANCES {
        thread::yield_now();
        let p = thread_rng().gen_range(0..PARTITIONS);
        let key = (topic(), p);
        let mut w = lock(&world);
        let advanced = w.offsets.revoke(&key);
        if let Some(pos) = advanced {
            w.part(p).check_commit(p, pos, "revoke commit");
        }
        let part = w.part(p);
        part.assigned = false;
        part.generation += 1;
        part.in_flight.clear();
        part.next = None;
        part.last_reported = None;
        assert!(
            w.tracked(p).is_none(),
            "a revoked partition is still tracked"
        );
        drop(w);
        if let Some(pos) = advanced
            && thread_rng().gen_ratio(3, 4)
        {
            lock(&world).group_committed(p, pos);
        }
        thread::yield_now();
        let mut w = lock(&world);
        let part = w.part(p);
        // Another member may have processed and committed a few records meanwhile.
        let theirs = thread_rng().gen_range(0..=2);
        for _ in 0..theirs {
            let o = part.group;
            part.done.insert(o);
            part.group = o + 1;
        }
        part.assigned = true;
        part.fetch = part.group;
    }
}

fn one_schedule() {
    let world = Arc::new(Mutex::new(World::new()));
    let (tx, rx) = mpsc::channel();
    let poll = {
        let world = world.clone();
        thread::spawn(move || poll_loop(world, tx))
    };
    let broker = {
        let world = world.clone();
        thread::spawn(move || broker(world, rx))
    };
    let rebalance = {
        let world = world.clone();
        thread::spawn(move || rebalancer(world))
    };
    for t in [poll, broker, rebalance] {
        t.join().expect("no invariant broken");
    }

    // Quiescent: every delivery of the current assignments settled or was abandoned.
    let mut w = lock(&world);
    for p in 0..PARTITIONS {
        let expected = w.part(p).expected_position();
        let tracked = w.tracked(p).map(|(pos, _, _)| pos);
        assert_eq!(
            tracked, expected,
            "partition {p}: position after everything settled"
        );
    }
    let closing: HashMap<i32, i64> = w
        .take_commits(true)
        .into_iter()
        .map(|((_, p), pos)| (p, pos))
        .collect();
    for p in 0..PARTITIONS {
        assert_eq!(
            closing.get(&p).copied(),
            w.part(p).expected_position(),
            "partition {p}: the closing commit"
        );
    }
}

#[test]
fn offsets_hold_their_invariants_on_random_schedules() {
    shuttle::check_random(one_schedule, iterations());
}

/// PCT favours schedules with few, well-placed preemptions, which random walks reach rarely.
#[test]
fn offsets_hold_their_invariants_on_pct_schedules() {
    shuttle::check_pct(one_schedule, iterations() / 2, 3);
}
