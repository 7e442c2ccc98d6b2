//! `rewind init-model`: a complete HF checkpoint with seeded random weights.

use anyhow::{bail, Result};
use rewind_engine::checkpoint::writer::WriteDtype;
use rewind_engine::init::{check_out_dir, init_model, InitOptions};
use rewind_engine::presets::parse_arch;

use crate::cli::InitModelArgs;
use crate::output::errln;

pub fn run(args: InitModelArgs) -> Result<()> {
    let family = parse_arch(&args.arch)?;
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some("f32" | "float32") => Some(WriteDtype::F32),
        Some("bf16" | "bfloat16") => Some(WriteDtype::BF16),
        Some(other) => bail!("unknown --dtype `{other}`; expected f32 or bf16"),
    };
    check_out_dir(&args.out, args.force)?;
    let start = std::time::Instant::now();
    let report = init_model(&InitOptions {
        family,
        preset: args.preset.clone(),
        layers: args.layers,
        seed: args.seed,
        out: args.out.clone(),
        dtype,
        mtp: args.mtp,
    })?;
    errln!(
        "wrote {} ({}): {} tensors, {:.1}M parameters, in {:.1} s",
        report.dir.display(),
        report.config.summary(),
        report.tensors,
        report.parameters as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
