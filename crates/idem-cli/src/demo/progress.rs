//! The progress bar on stderr while the demo runs (indicatif hides it when stderr is not a
//! terminal, so `--json` output and tests stay clean).

use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::task::JoinHandle;

use super::broker::SimulatedBroker;
use super::worker::Tally;

/// A bar of messages settled, refreshed from the broker's and workers' counters.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: ProgressBar,
    refresher: JoinHandle<()>,
}

impl Progress {
    /// Starts drawing; `messages` is the bar's length.
    pub(crate) fn start(messages: u64, broker: Arc<SimulatedBroker>, tally: Arc<Tally>) -> Self {
        let bar = ProgressBar::new(messages);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{bar:24}] {pos}/{len} settled · {msg} · {elapsed}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message("starting");
        let drawn = bar.clone();
        // Polling the counters keeps the workers free of any drawing work.
        let refresher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let stats = broker.stats();
                drawn.set_position(stats.messages_settled);
                drawn.set_message(format!(
                    "{} deliveries, {} dups skipped, {} crashes",
                    stats.deliveries,
                    Tally::get(&tally.duplicates_skipped),
                    Tally::get(&tally.crashes),
                ));
            }
        });
        Self { bar, refresher }
    }

    /// Stops and erases the bar, leaving the terminal to the report.
    pub(crate) fn finish(self) {
        self.refresher.abort();
        self.bar.finish_and_clear();
    }
}
