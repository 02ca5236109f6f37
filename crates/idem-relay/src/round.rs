//! One round's publishing: leased rows split into units (one per (destination, ordering key),
//! in sequence order, and one per unkeyed row), units published concurrently under a permit
//! each, a unit's rows strictly one after another, stopping at its first failure. Each confirm
//! goes to the round's marker at once.

use std::collections::HashMap;
use std::sync::Arc;

use idem_consumer::crash::{self, CrashPoint};
use idem_core::Error;
use idem_core::outbox::OutboxRow;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::Publish;

/// Rows that publish in order, one at a time.
pub(crate) type Unit = Vec<OutboxRow>;

/// Splits `rows` into units, keeping each key's rows in sequence order (the lease's order is
/// not trusted for that: a sort costs nothing next to a publish).
pub(crate) fn plan(mut rows: Vec<OutboxRow>) -> Vec<Unit> {
    rows.sort_by_key(|r| r.seq);
    let mut units: Vec<Unit> = Vec::new();
    let mut by_key: HashMap<(String, String), usize> = HashMap::new();
    for row in rows {
        match row.message.key() {
            Some(key) => {
                let group = (row.message.destination().to_owned(), key.to_owned());
                match by_key.get(&group) {
                    Some(&i) => units[i].push(row),
                    None => {
                        by_key.insert(group, units.len());
                        units.push(vec![row]);
                    }
                }
            }
            None => units.push(vec![row]),
        }
    }
    units
}

/// What became of one unit's rows.
#[derive(Debug, Default)]
pub(crate) struct UnitOutcome {
    /// The row whose publish failed, and why.
    pub(crate) failed: Option<(OutboxRow, Error)>,
    /// Rows after the failed one, not tried so their key's order holds.
    pub(crate) held: Vec<OutboxRow>,
    /// Rows not started because the relay is stopping.
    pub(crate) unstarted: Vec<OutboxRow>,
}

/// Publishes `unit` in order under one of `permits`, sending each confirmed row's `seq` to
/// `confirms`; stops at the first failure, and before any row not yet started once `stop` is
/// cancelled (a publish in flight is finished, so its confirm is not thrown away).
pub(crate) async fn publish_unit<P: Publish>(
    publisher: Arc<P>,
    permits: Arc<Semaphore>,
    stop: CancellationToken,
    confirms: mpsc::UnboundedSender<i64>,
    unit: Unit,
) -> UnitOutcome {
    let mut out = UnitOutcome::default();
    let permit = tokio::select! {
        biased;
        () = stop.cancelled() => None,
        p = permits.acquire_owned() => p.ok(),
    };
    let Some(_permit) = permit else {
        out.unstarted = unit;
        return out;
    };
    let mut rows = unit.into_iter();
    while let Some(row) = rows.next() {
        if stop.is_cancelled() {
            out.unstarted.push(row);
            out.unstarted.extend(rows);
            break;
        }
        match publisher.publish(&row.message).await {
            Ok(()) => {
                tracing::debug!(seq = row.seq, id = ?row.message.id(), destination = row.message.destination(), "published");
                crash::reached(CrashPoint::RelayAfterPublish);
                // The marker outlives every unit of its round.
                let _ = confirms.send(row.seq);
            }
            Err(e) => {
                tracing::debug!(seq = row.seq, destination = row.message.destination(), error = %e, "publish failed");
                out.failed = Some((row, e));
                out.held.extend(rows);
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use idem_core::MessageId;
    use idem_core::outbox::Outgoing;

    use super::*;

    fn row(seq: i64, dest: &str, key: Option<&str>) -> OutboxRow {
        let mut m = Outgoing::new(
            MessageId::new(format!("m{seq}")).unwrap(),
            dest,
            b"x".to_vec(),
        )
        .unwrap();
        if let Some(k) = key {
            m = m.ordering_key(k).unwrap();
        }
        OutboxRow {
            seq,
            message: m,
            attempts: 0,
            created: idem_core::Timestamp::from_micros(0),
        }
    }

    #[test]
    fn keyed_rows_group_by_destination_and_key_in_seq_order_unkeyed_stand_alone() {
        let units = plan(vec![
            row(5, "orders", Some("a")),
            row(1, "orders", Some("a")),
            row(2, "orders", None),
            row(3, "refunds", Some("a")),
            row(4, "orders", Some("b")),
            row(6, "orders", None),
        ]);
        let seqs: Vec<Vec<i64>> = units
            .iter()
            .map(|u| u.iter().map(|r| r.seq).collect())
            .collect();
        assert_eq!(seqs, [vec![1, 5], vec![2], vec![3], vec![4], vec![6]]);
    }
}
