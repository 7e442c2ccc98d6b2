//! How much do a fixture's logits move when its weights are rounded to bf16 (what a GPU stores)? Compares the CPU
//! model with the checkpoint's f32 weights against the CPU model with the same weights rounded to bf16, teacher-forced
//! on the fixture's tokens (one recurrent-form prefill of every token, every row):
//! `cargo run --release -p rewind-engine --example bf16_sensitivity -- tests/fixtures/X`.

use half::bf16;
use rewind_engine::checkpoint::SafetensorsSource;
use rewind_engine::decode::{Decoder, DecoderConfig, FormChoice};
use rewind_engine::model::tensors::TensorSource;
use rewind_engine::model::ModelConfig;
use rewind_engine::rank::Rows;
use rewind_engine::shard::ShardedModel;

struct Rounded(SafetensorsSource);

impl TensorSource for Rounded {
    fn take(&mut self, name: &str, shape: &[usize]) -> rewind_engine::Result<Vec<f32>> {
        let v = self.0.take(name, shape)?;
        Ok(v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect())
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.0.shape_of(name)
    }
    fn finish(&mut self, k: &[&str], i: &[&str]) -> rewind_engine::Result<()> {
        self.0.finish(k, i)
    }
}

/// Every position's logits `[tokens, vocab]` of one recurrent-form prefill of `tokens` (the whole model as one rank).
fn logits(model: ShardedModel, tokens: &[u32]) -> rewind_engine::Result<Vec<f32>> {
    let mut dec = Decoder::single(model, DecoderConfig::new(1, tokens.len()))?;
    let slot = dec.start(FormChoice::Recurrent)?;
    dec.prefill(slot, tokens, Rows::All)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).ok_or("usage: bf16_sensitivity DIR")?);
    let exact = ShardedModel::from_dir(&dir, 1, 0)?;
    let rounded = ShardedModel::load(
        ModelConfig::from_dir(&dir)?,
        1,
        0,
        &mut Rounded(SafetensorsSource::open(&dir)?),
    )?;
    let vocab = exact.config().vocab_size;
    // The fixture's tokens, or (for an init-model checkpoint) 32 fixed pseudo-random ids.
    let tokens: Vec<u32> = match std::fs::read_to_string(dir.join("reference.json")) {
        Ok(text) => {
            let reference: serde_json::Value = serde_json::from_str(&text)?;
            reference["tokens"]
                .as_array()
                .ok_or("tokens")?
                .iter()
                .map(|t| t.as_u64().unwrap_or(0) as u32)
                .collect()
        }
        Err(_) => (0..32u64)
            .map(|i| ((i * 2_654_435_761 + 12_345) % vocab as u64) as u32)
            .collect(),
    };
    let a = logits(exact, &tokens)?;
    let b = logits(rounded, &tokens)?;
    let mut worst = 0.0f32;
    let mut per = Vec::new();
    for (x, y) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
        let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = x.iter().zip(y).fold(0.0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
        worst = worst.max(d);
        per.push(format!("{d:.1e}"));
    }
    println!("{}: worst {worst:.2e}; per position {}", dir.display(), per.join(" "));
    Ok(())
}
