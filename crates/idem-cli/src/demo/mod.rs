//! `idem demo` (placeholder; being written).

/// Options of `idem demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {}

pub(crate) async fn run(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet built")
}
