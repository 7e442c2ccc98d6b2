//! Tensor-parallel equivalence: every fixture under `tests/fixtures/`, split over TP ranks (threads sharing an
//! in-process communicator), produces the single-rank model's logits for prefill and decode positions.
//!
//! Every TP size from 2 to 8 is tried; a size is skipped when some split dimension of the fixture is smaller than it
//! (the plan refuses ranks without a head), e.g. the `_odd` fixtures have 3 attention heads, so they run at TP 2 and 3
//! only, and the Qwen fixtures stop at their 4 value / query heads. TP 2, 3 (and 4 where heads allow) are required.

use std::path::{Path, PathBuf};

use rewind_engine::model::config::ModelConfig;
use rewind_engine::model::{Logits, Model};
use rewind_engine::shard::{LocalComm, RankPlan, ShardedModel};
use serde_json::Value;

/// max |Δlogit| / max |logit| allowed at every position.
const TOLERANCE: f64 = 1e-4;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

fn rel_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "vocab size differs");
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
    let max_diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
    max_diff / max_ref.max(1e-12)
}

/// The fixture's tokens and prefill length.
fn tokens(dir: &Path) -> (Vec<u32>, usize) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("read reference"))
            .expect("json");
    let tokens = reference["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    (tokens, reference["prefill_len"].as_u64().expect("prefill_len") as usize)
}

/// Logits per position: one prefill over the first `prefill` tokens (split in two calls to carry state across a
/// prefill boundary), then one decode step per remaining token.
fn run(
    forward: &mut dyn FnMut(&[u32], Logits) -> Vec<f32>,
    tokens: &[u32],
    prefill: usize,
    vocab: usize,
) -> Vec<Vec<f32>> {
    let cut = prefill / 2 + 1;
    let mut rows: Vec<Vec<f32>> = forward(&tokens[..cut], Logits::All)
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    rows.extend(
        forward(&tokens[cut..prefill], Logits::All)
            .chunks(vocab)
            .map(<[f32]>::to_vec),
    );
    for &t in &tokens[prefill..] {
        rows.push(forward(&[t], Logits::Last));
    }
    rows
}

fn sharded(dir: &Path, tp: usize, tokens: &[u32], prefill: usize, vocab: usize) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = LocalComm::group(tp)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let model = ShardedModel::from_dir(dir, tp, rank).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    let mut state = model.new_state();
                    run(
                        &mut |toks, which| model.forward(toks, &mut state, which, &comm).expect("sharded forward"),
                        tokens,
                        prefill,
                        vocab,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

#[test]
fn tensor_parallel_ranks_reproduce_single_rank_logits() {
    let mut report = Vec::new();
    for dir in fixtures() {
        let name = dir.file_name().expect("name").to_string_lossy().into_owned();
        let (tokens, prefill) = tokens(&dir);
        assert!(
            prefill >= 2 && prefill < tokens.len(),
            "{name}: needs prefill and decode positions"
        );
        let model = Model::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let vocab = model.config().vocab_size;
        let mut state = model.new_state();
        let want = run(
            &mut |toks, which| model.forward(toks, &mut state, which).expect("forward"),
            &tokens,
            prefill,
            vocab,
        );
        let config = ModelConfig::from_dir(&dir).expect("config");
        let mut tested = Vec::new();
        for tp in 2..=8 {
            if let Err(e) = RankPlan::new(&config, tp, 0, &|_| false) {
                report.push(format!("{name}: tp {tp} skipped: {e}"));
                continue;
            }
            let ranks = sharded(&dir, tp, &tokens, prefill, vocab);
            for (rank, got) in ranks.iter().enumerate() {
                assert_eq!(got, &ranks[0], "{name} tp {tp}: rank {rank} disagrees with rank 0");
            }
            let errors: Vec<f64> = ranks[0].iter().zip(&want).map(|(g, w)| rel_error(g, w)).collect();
            let pre = errors[..prefill].iter().cloned().fold(0.0, f64::max);
            let dec = errors[prefill..].iter().cloned().fold(0.0, f64::max);
            report.push(format!("{name}: tp {tp}: prefill {pre:.2e}, decode {dec:.2e}"));
            assert!(pre < TOLERANCE, "{name} tp {tp}: prefill logits differ by {pre:e}");
            assert!(dec < TOLERANCE, "{name} tp {tp}: decode logits differ by {dec:e}");
            tested.push(tp);
        }
        assert!(tested.starts_with(&[2, 3]), "{name}: tested only {tested:?}");
        if !name.ends_with("_odd") {
            assert!(tested.contains(&4), "{name}: tp 4 not tested");
        }
    }
    eprintln!("{}", report.join("\n"));
}
