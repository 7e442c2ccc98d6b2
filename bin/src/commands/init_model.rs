//! `rewind init-model`: a complete HF checkpoint with seeded random weights.

use anyhow::{bail, Context, Result};
use rewind_engine::checkpoint::quant::quantize::{quantize_in_place, FP8_BLOCK};
use rewind_engine::checkpoint::quant::{Method, NVFP4_GROUP};
use rewind_engine::checkpoint::writer::WriteDtype;
use rewind_engine::init::{check_out_dir, init_model, InitOptions};
use rewind_engine::presets::parse_arch;

use crate::cli::{InitModelArgs, QuantizeArgs};
use crate::output::errln;

/// The quantization layout a `--quant` value names.
pub fn layout(name: &str) -> Result<Method> {
    Ok(match name {
        "fp8-block" => Method::Fp8 { block: Some(FP8_BLOCK) },
        "modelopt-fp8" => Method::ModelOptFp8,
        "nvfp4" => Method::Nvfp4 { group: NVFP4_GROUP },
        other => bail!("unknown --quant `{other}`; expected fp8-block, modelopt-fp8 or nvfp4"),
    })
}

/// `rewind quantize`: copies `--model` into `--out` and quantizes the copy's weights in place.
pub fn quantize(args: QuantizeArgs) -> Result<()> {
    let method = layout(&args.quant)?;
    check_out_dir(&args.out, false)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    for entry in std::fs::read_dir(&args.model).with_context(|| format!("reading {}", args.model.display()))? {
        let path = entry?.path();
        if path.is_file() {
            let name = path.file_name().context("a file name")?;
            std::fs::copy(&path, args.out.join(name)).with_context(|| format!("copying {}", path.display()))?;
        }
    }
    let start = std::time::Instant::now();
    let q = quantize_in_place(&args.out, method)?;
    errln!(
        "wrote {}: {} weights quantized to {}, {} tensors kept, in {:.1} s",
        args.out.display(),
        q.quantized,
        args.quant,
        q.kept,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn run(args: InitModelArgs) -> Result<()> {
    let family = parse_arch(&args.arch)?;
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some("f32" | "float32") => Some(WriteDtype::F32),
        Some("bf16" | "bfloat16") => Some(WriteDtype::BF16),
        Some(other) => bail!("unknown --dtype `{other}`; expected f32 or bf16"),
    };
    let quant = match args.quant.as_deref() {
        None => None,
        Some("fp8-block") => Some(Method::Fp8 { block: Some(FP8_BLOCK) }),
        Some("modelopt-fp8") => Some(Method::ModelOptFp8),
        Some("nvfp4") => Some(Method::Nvfp4 { group: NVFP4_GROUP }),
        Some(other) => bail!("unknown --quant `{other}`; expected fp8-block, modelopt-fp8 or nvfp4"),
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
    if let Some(method) = quant {
        let q = quantize_in_place(&args.out, method)?;
        errln!(
            "quantized {} weights to {:?}, kept {} tensors as they were",
            q.quantized,
            method,
            q.kept
        );
    }
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
