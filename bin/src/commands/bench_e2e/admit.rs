//! The measured concurrency of `rewind bench e2e`: how many sequences of a fixed context a fixed memory budget
//! admits when speculation keeps a state snapshot per draft (the recurrent form's verify, `T` extra states per
//! sequence) versus input replay (one state plus a ring of inputs), counted by admitting sequences, not only planned.
//!
//! The budget is memory beyond the weights and the step activations: both configurations get the same
//! `--gpu-memory-fraction`, derived from a one-sequence probe load. Each configuration's planned count is the budget
//! over its per-sequence bytes (from its probe: SSM state, snapshots or rings, KV for the context); it is then loaded
//! with that many slots (fewer if the load does not fit) and sequences are opened and prefilled with the context
//! until one is refused. A few percent more slots are tried after that, so the count is the most that fit.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use crate::cli::BenchE2eArgs;

#[cfg(not(feature = "cuda"))]
pub(super) fn measure(_args: &BenchE2eArgs, _dir: &Path) -> Result<Value> {
    Err(crate::commands::no_cuda())
}

#[cfg(feature = "cuda")]
pub(super) use gpu::measure;

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use anyhow::Context;
    use rewind_engine::decode::FormChoice;
    use rewind_engine::model::ModelConfig;
    use rewind_engine::rank::RankGroup;
    use serde_json::json;

    use crate::cli::{DecodeArgs, DeviceArgs};
    use crate::commands::backend::{backend, Needs};
    use crate::commands::bench::tokens;
    use crate::commands::bench_steps::prefill_plan;
    use crate::output::errln;

    const GIB: f64 = (1u64 << 30) as f64;
    /// Loads tried with fewer slots when a planned count does not fit.
    const SHRINK_TRIES: usize = 6;
    /// Loads tried with more slots after every slot was admitted.
    const GROW_TRIES: usize = 2;

    struct Setup<'a> {
        args: &'a BenchE2eArgs,
        dir: &'a Path,
        context: usize,
        window: usize,
    }

    impl Setup<'_> {
        fn device(&self, max_seqs: usize, fraction: f64) -> DeviceArgs {
            DeviceArgs {
                device: self.args.device.clone(),
                tp: 1,
                gpu_memory_fraction: fraction,
                max_seqs: Some(max_seqs),
                // Room for the context and one verify of T drafts after it.
                max_model_len: Some(self.context + self.window + 1),
                prefill_chunk: 512,
                dtype: self.args.dtype.clone(),
                no_cuda_graphs: false,
                stage_profile: false,
            }
        }

        /// Loads `max_seqs` slots in `form` under `fraction`; the group and its load report.
        fn load(
            &self,
            form: FormChoice,
            max_seqs: usize,
            fraction: f64,
        ) -> Result<(RankGroup, rewind_engine::gpu::GpuReport)> {
            let decode = DecodeArgs {
                form: Some(form),
                buffer_len: rewind_engine::state::DEFAULT_BUFFER_LEN,
            };
            let needs = Needs {
                mtp: false,
                time_mtp: false,
                slots: max_seqs,
                context: self.context + self.window + 1,
                verify: self.window + 1,
                prefix_store: 0,
            };
            let b = backend(self.dir, &self.device(max_seqs, fraction), Some(&decode), needs)?;
            let group = RankGroup::start(b.launcher.as_ref())?;
            let report = b.gpu_report()?.context("a GPU load without its report")?;
            Ok((group, report))
        }

        /// Opens and prefills sequences of the context while the books (the scheduler's own admission rule) have a
        /// slot and the KV blocks for one more; how many were admitted. Every admitted sequence is really prefilled,
        /// so a pool that is short on the device fails here rather than being counted.
        fn admit(&self, group: &mut RankGroup, form: FormChoice) -> Result<usize> {
            let vocab = group.vocab_size();
            let mut n = 0;
            loop {
                let books = group.books();
                let room = books.slots_in_use() < books.slots()
                    && books
                        .kv()
                        .is_none_or(|kv| kv.blocks_for(self.context) <= kv.free_count());
                if !room {
                    return Ok(n);
                }
                let slot = group.open(form)?;
                let plan = prefill_plan(slot, form, tokens(self.context, vocab, 31 + n as u64));
                group
                    .step(plan)
                    .with_context(|| format!("prefilling admitted sequence {}", n + 1))?;
                n += 1;
            }
        }

        /// The most sequences `form` admits under `fraction`, starting from `planned` slots.
        fn most(&self, form: FormChoice, planned: usize, fraction: f64) -> Result<(usize, Vec<Value>)> {
            let mut tries = Vec::new();
            let mut slots = planned.max(1);
            let mut best = None;
            for _ in 0..SHRINK_TRIES {
                match self.load(form, slots, fraction) {
                    Ok((mut g, _)) => {
                        let n = self.admit(&mut g, form)?;
                        tries.push(json!({"slots": slots, "loaded": true, "admitted": n}));
                        best = Some(n);
                        break;
                    }
                    Err(e) => {
                        tries.push(json!({"slots": slots, "loaded": false, "error": e.to_string()}));
                        if slots == 1 {
                            break;
                        }
                        slots = (slots * 97 / 100).min(slots - 1).max(1);
                    }
                }
            }
            let mut best = best.with_context(|| format!("no load with {slots} slots or more fit the budget"))?;
            // Every slot taken: more may fit.
            for _ in 0..GROW_TRIES {
                if best < slots {
                    break;
                }
                slots = best + (best / 50).max(1);
                match self.load(form, slots, fraction) {
                    Ok((mut g, _)) => {
                        let n = self.admit(&mut g, form)?;
                        tries.push(json!({"slots": slots, "loaded": true, "admitted": n}));
                        if n <= best {
                            break;
                        }
                        best = n;
                    }
                    Err(e) => {
                        tries.push(json!({"slots": slots, "loaded": false, "error": e.to_string()}));
                        break;
                    }
                }
            }
            Ok((best, tries))
        }
    }

    pub(in crate::commands::bench_e2e) fn measure(args: &BenchE2eArgs, dir: &Path) -> Result<Value> {
        let config = ModelConfig::from_dir(dir)?;
        let s = Setup {
            args,
            dir,
            context: args.admit_context,
            window: args.spec_window,
        };
        anyhow::ensure!(
            s.context + s.window < config.max_position_embeddings,
            "--admit-context {} plus a verify of {} drafts exceeds the model's context limit of {}",
            s.context,
            s.window,
            config.max_position_embeddings
        );
        let forms = [("snapshot", FormChoice::Recurrent), ("replay", FormChoice::Replay)];
        // One-sequence probes: each configuration's bytes per sequence, and the budget's fraction of the device.
        let mut per_seq = Vec::new();
        let mut fraction = None;
        for (label, form) in forms {
            let (_g, r) = s
                .load(form, 1, 0.95)
                .with_context(|| format!("the {label} probe load (one sequence)"))?;
            per_seq.push(r.state_bytes[0] as f64);
            if fraction.is_none() {
                let fixed = (r.weight_bytes[0] + r.scratch_bytes[0]) as f64;
                let f = (fixed + args.admit_budget_gib * GIB) / r.total_bytes[0] as f64;
                anyhow::ensure!(
                    f <= 1.0,
                    "--admit-budget-gib {} plus the weights and activations ({:.1} GiB) exceed the device's {:.1} GiB",
                    args.admit_budget_gib,
                    fixed / GIB,
                    r.total_bytes[0] as f64 / GIB
                );
                fraction = Some(f);
            }
        }
        let fraction = fraction.context("no probe load")?;
        let mut out = json!({
            "context": s.context,
            "budget_gib": args.admit_budget_gib,
            "spec_window": s.window,
            "gpu_memory_fraction": fraction,
        });
        let mut admitted = Vec::new();
        for ((label, form), bytes) in forms.into_iter().zip(&per_seq) {
            let planned = (args.admit_budget_gib * GIB / bytes).floor() as usize;
            errln!(
                "concurrency, {label}: {:.1} MiB per sequence at {} tokens, {planned} planned in {} GiB",
                bytes / (1u64 << 20) as f64,
                s.context,
                args.admit_budget_gib
            );
            let (n, tries) = s.most(form, planned, fraction)?;
            errln!("concurrency, {label}: {n} admitted");
            out[label] = json!({"bytes_per_sequence": bytes, "planned": planned, "admitted": n, "loads": tries});
            admitted.push(n);
        }
        out["ratio"] = json!(admitted[1] as f64 / admitted[0].max(1) as f64);
        Ok(out)
    }
}
