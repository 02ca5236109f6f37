//! The progress bar on stderr while the demo runs (indicatif hides it when stderr is not a
//! terminal, so `--json` output and tests stay clean).

use std::time::Duration;

use idem_consumer::InMemoryBroker;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::task::JoinHandle;

/// A bar of published copies settled, refreshed from the broker's counters.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: ProgressBar,
    refresher: JoinHandle<()>,
}

impl Progress {
    /// Starts drawing; the bar grows with what the producer publishes.
    pub(crate) fn start(broker: InMemoryBroker) -> Self {
        let bar = ProgressBar::new(0);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{bar:24}] {pos}/{len} settled · {msg} · {elapsed}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message("starting");
        let drawn = bar.clone();
        // Polling the counters keeps the consumer free of any drawing work.
        let refresher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let stats = broker.stats();
                drawn.set_length(stats.published);
                drawn.set_position(stats.settled);
                drawn.set_message(format!(
                    "{} redelivered, {} acks lost",
                    stats.redelivered, stats.lost_acks,
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
