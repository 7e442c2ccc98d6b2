//! `rewind bench plot` (being written).

use crate::cli::BenchPlotArgs;
use anyhow::Result;

pub fn run(_args: BenchPlotArgs) -> Result<()> {
    anyhow::bail!("rewind bench plot is not built yet")
}
