//! `rewind logits`: per-position logits, prefill for the first N tokens and decode for the rest, in the chosen decode
//! form.

use std::io::Write;

use anyhow::{bail, Context, Result};
use rewind_engine::decode::{Decoder, DecoderConfig};
use rewind_engine::model::{Logits, Model};

use crate::cli::{Device, LogitsArgs};

pub fn run(args: LogitsArgs) -> Result<()> {
    if args.prefill > args.tokens.len() {
        bail!(
            "--prefill {} exceeds the number of tokens ({})",
            args.prefill,
            args.tokens.len()
        );
    }
    let rows = match args.device.device()? {
        Device::Cpu => cpu_rows(&args)?,
        #[cfg(feature = "cuda")]
        Device::Cuda(devices) => gpu_rows(&args, devices)?,
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(super::no_cuda()),
    };
    let file = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut w, &serde_json::json!({ "tokens": args.tokens, "logits": rows }))?;
    w.flush().with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}

/// The same prefill / decode split on GPUs (recurrent decoding).
#[cfg(feature = "cuda")]
fn gpu_rows(args: &LogitsArgs, devices: Vec<usize>) -> Result<Vec<Vec<f32>>> {
    args.decode.check_gpu()?;
    let mut dargs = args.device.clone();
    dargs.max_model_len = Some(dargs.max_model_len.unwrap_or(args.tokens.len()).max(args.tokens.len()));
    let mut model = super::gpu::load(&args.model, &dargs, devices)?;
    let vocab = model.config().vocab_size;
    let seq = model.open()?;
    let mut rows: Vec<Vec<f32>> = Vec::with_capacity(args.tokens.len());
    if args.prefill > 0 {
        let logits = model.prefill(seq, &args.tokens[..args.prefill], Logits::All)?;
        rows.extend(logits.chunks_exact(vocab).map(<[f32]>::to_vec));
    }
    for &tok in &args.tokens[args.prefill..] {
        rows.push(model.decode(&[(seq, tok)])?);
    }
    Ok(rows)
}

fn cpu_rows(args: &LogitsArgs) -> Result<Vec<Vec<f32>>> {
    let model = Model::from_dir(&args.model)?;
    model.check_tokens(&args.tokens, 0)?;
    let vocab = model.config().vocab_size;
    let opts = args.decode.options();
    let mut decoder = Decoder::new(
        &model,
        DecoderConfig {
            buffer_len: opts.buffer_len,
            ..DecoderConfig::new(1, args.tokens.len())
        },
    )?;
    let slot = decoder.start(opts.form)?;
    let mut rows: Vec<Vec<f32>> = Vec::with_capacity(args.tokens.len());
    if args.prefill > 0 {
        let logits = decoder.prefill(slot, &args.tokens[..args.prefill], Logits::All)?;
        rows.extend(logits.chunks_exact(vocab).map(<[f32]>::to_vec));
    }
    for &tok in &args.tokens[args.prefill..] {
        rows.push(decoder.decode(&[(slot, tok)])?);
    }
    Ok(rows)
}
