//! `rewind bench e2e` (being written).

use crate::cli::BenchE2eArgs;
use anyhow::Result;

pub fn run(_args: BenchE2eArgs) -> Result<()> {
    anyhow::bail!("rewind bench e2e is not built yet")
}
