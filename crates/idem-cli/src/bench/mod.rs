//! `idem bench` (placeholder; being written).

/// Options of `idem bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {}

pub(crate) async fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet built")
}
