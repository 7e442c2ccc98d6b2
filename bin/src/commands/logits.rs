//! `rewind logits`: per-position logits, prefill for the first N tokens and decode for the rest, in the chosen decode
//! form, on any backend (`--device`, `--tp`).

use std::io::Write;

use anyhow::{bail, Context, Result};
use rewind_engine::rank::{GroupSequence, Rows, SeqKind};

use super::backend::{self, Needs};
use crate::cli::LogitsArgs;

pub fn run(args: LogitsArgs) -> Result<()> {
    // Bad device values are errors; GPU-only flags on the CPU get a note.
    args.device.check()?;
    if args.prefill > args.tokens.len() {
        bail!(
            "--prefill {} exceeds the number of tokens ({})",
            args.prefill,
            args.tokens.len()
        );
    }
    let needs = Needs {
        slots: 1,
        context: args.tokens.len(),
        verify: 1,
    };
    let mut loaded = backend::open(&args.model, &args.device, Some(&args.decode), needs)?;
    let vocab = loaded.config.vocab_size;
    let limit = args.tokens.len();
    let mut seq = GroupSequence::open(&mut loaded.group, loaded.form, limit)?;
    let mut rows: Vec<Vec<f32>> = Vec::with_capacity(args.tokens.len());
    let mut logits_of = |out: rewind_engine::rank::StepResult| -> Result<()> {
        let l = out.logits.context("the step returned no logits")?;
        rows.extend(l.chunks_exact(vocab).map(<[f32]>::to_vec));
        Ok(())
    };
    if args.prefill > 0 {
        logits_of(seq.run(SeqKind::Prefill, &args.tokens[..args.prefill], Rows::All, true)?)?;
    }
    for &tok in &args.tokens[args.prefill..] {
        logits_of(seq.run(SeqKind::Decode, &[tok], Rows::Last, true)?)?;
    }
    drop(seq);
    let file = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    // A write can fail inside serde_json (when the buffer fills) or at the final flush (a full disk): both name the
    // file.
    let write = || -> Result<()> {
        let mut w = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut w, &serde_json::json!({ "tokens": args.tokens, "logits": rows }))?;
        w.flush()?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", args.out.display()))
}
