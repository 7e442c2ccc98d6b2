//! Speculative decoding with the checkpoint's own MTP layer through the serving engine on CPU ranks: greedy
//! speculative output equals greedy output token for token for every family's MTP layout, every decode form, T from
//! 1 to 8 and TP 1 and 2, with prompts split into chunks; and the MTP layer's KV covers the whole prompt (the ranks
//! return every prompt row's hidden state and the coordinator hands them to the drafter chunk by chunk).

use std::sync::{Arc, Mutex};

use rewind_actors::GenerateRequest;
use rewind_engine::decode::FormChoice;
use rewind_engine::model::Family;
use rewind_engine::spec::mtp::{MtpDrafter, MtpWeights};
use rewind_engine::spec::{Draft, DraftInput, DraftRequest, Drafter, DrafterFactory, DrafterKind, HiddenRows};
use rewind_tests::runtime;

use crate::speculative_support;
use speculative_support::{engine_on_ranks, engine_with, factory, params, run_all, spec_config, tiny};

/// The families' MTP layouts: Qwen3.5 (dense and MoE) and Qwen3-Next `mtp.*`, Nemotron-3's (attention then MoE,
/// dense and latent).
const MODELS: [(Family, &str); 5] = [
    (Family::Qwen35, "tiny"),
    (Family::Qwen35Moe, "tiny"),
    (Family::Qwen3Next, "tiny"),
    (Family::NemotronH, "tiny"),
    (Family::NemotronH, "tiny-latent"),
];

/// A step budget that splits the prompt below into chunks (and still holds a verify of 1 + 8 tokens).
const STEP_TOKENS: usize = 12;

/// A prompt with repeats, longer than [`STEP_TOKENS`].
fn prompt() -> Vec<u32> {
    [5, 9, 13, 5, 9, 13, 2, 7].repeat(3)
}

#[test]
fn greedy_mtp_speculation_changes_no_token() {
    let rt = runtime();
    for (family, preset) in MODELS {
        let target = tiny(family, preset, 11, true);
        let dir = target.path();
        let mut window = 0;
        for tp in [1, 2] {
            for form in FormChoice::ALL {
                // Every window from 1 to 8 comes round for every family.
                window = window % 8 + 1;
                let spec = spec_config(DrafterKind::Mtp, window);
                let what = format!("{family:?} {preset} mtp tp {tp} {form} T={window}");
                let out = rt.block_on(async {
                    let e = engine_with(dir, tp, form, 4, &spec, factory(dir, 4, &spec), Some(STEP_TOKENS)).await;
                    let mut plain = GenerateRequest::new(prompt(), params(24, 0.0, 1));
                    plain.speculate = false;
                    let out = run_all(&e, vec![plain, GenerateRequest::new(prompt(), params(24, 0.0, 1))]).await;
                    e.shutdown().await;
                    out
                });
                assert_eq!(out[1].0, out[0].0, "{what}");
                let stats = out[1].1.expect("counters");
                assert!(stats.verifies > 0 && stats.drafted > 0, "{what}: {stats:?}");
            }
        }
    }
}

/// MTP drafting on the ranks (the layer loaded with the model, run inside each step): greedy output is unchanged,
/// and the drafts are the host drafter's — the same counters of drafted and accepted tokens, request by request —
/// for every family's layout, TP 1 and 2, with prompts in chunks and several requests batched.
#[test]
fn mtp_on_the_ranks_drafts_what_the_host_drafter_does() {
    let rt = runtime();
    for (i, (family, preset)) in MODELS.into_iter().enumerate() {
        let target = tiny(family, preset, 11, true);
        let dir = target.path();
        let tp = 1 + i % 2;
        let form = [FormChoice::Replay, FormChoice::Auto][i % 2];
        let window = 2 + i % 3;
        let spec = spec_config(DrafterKind::Mtp, window);
        let what = format!("{family:?} {preset} tp {tp} {form} T={window}");
        let requests = || {
            let mut plain = GenerateRequest::new(prompt(), params(20, 0.0, 1));
            plain.speculate = false;
            let other: Vec<u32> = prompt().iter().rev().copied().collect();
            vec![
                plain,
                GenerateRequest::new(prompt(), params(20, 0.0, 1)),
                GenerateRequest::new(other, params(16, 0.0, 2)),
            ]
        };
        let (host, ranks) = rt.block_on(async {
            let e = engine_with(dir, tp, form, 4, &spec, factory(dir, 4, &spec), Some(STEP_TOKENS)).await;
            let host = run_all(&e, requests()).await;
            e.shutdown().await;
            let e = engine_on_ranks(dir, tp, form, 4, &spec, Some(STEP_TOKENS)).await;
            let ranks = run_all(&e, requests()).await;
            e.shutdown().await;
            (host, ranks)
        });
        assert_eq!(ranks[1].0, ranks[0].0, "{what}: speculation changed the output");
        for (h, r) in host.iter().zip(&ranks) {
            assert_eq!(r.0, h.0, "{what}");
            assert_eq!(r.1, h.1, "{what}: the ranks' drafts differ from the host drafter's");
        }
        let stats = ranks[1].1.expect("counters");
        assert!(stats.verifies > 0 && stats.drafted > 0, "{what}: {stats:?}");
    }
}

/// What the recording drafter saw.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    /// Hidden rows observed: first position and count.
    Rows(usize, usize),
    /// A proposal after `tokens` tokens, with the KV's first position and its committed entries then.
    Proposal {
        tokens: usize,
        kv_start: usize,
        committed: usize,
    },
}

/// The MTP drafter, logging what it observes and where its KV stands at each proposal.
struct Recording {
    inner: MtpDrafter,
    log: Arc<Mutex<Vec<Seen>>>,
}

impl Recording {
    fn log(&self, seen: Seen) {
        self.log.lock().expect("log").push(seen);
    }
}

impl Drafter for Recording {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, tokens: &[u32], hidden: &HiddenRows) -> rewind_engine::Result<()> {
        self.log(Seen::Rows(hidden.position, hidden.rows.len() / hidden.hidden));
        self.inner.observe(tokens, hidden)
    }

    fn propose(&mut self, input: &DraftInput<'_>) -> rewind_engine::Result<Draft> {
        if let Some(h) = input.hidden {
            self.log(Seen::Rows(h.position, h.rows.len() / h.hidden));
        }
        let draft = self.inner.propose(input)?;
        // Every draft but the last ran a draft step, whose KV entry is not committed.
        let steps = draft.tokens.len().saturating_sub(1);
        self.log(Seen::Proposal {
            tokens: input.tokens.len(),
            kv_start: self.inner.kv_start(),
            committed: self.inner.kv_len() - steps,
        });
        Ok(draft)
    }
}

struct RecordingFactory {
    kind: DrafterKind,
    weights: Arc<MtpWeights>,
    log: Arc<Mutex<Vec<Seen>>>,
}

impl DrafterFactory for RecordingFactory {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn drafter(&self, _: &DraftRequest<'_>) -> rewind_engine::Result<Box<dyn Drafter>> {
        Ok(Box::new(Recording {
            inner: MtpDrafter::new(Arc::clone(&self.weights)),
            log: Arc::clone(&self.log),
        }))
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn hidden_width(&self) -> Option<usize> {
        Some(self.weights.config().hidden_size)
    }
}

#[test]
fn the_mtp_layers_kv_covers_the_prompt() {
    let rt = runtime();
    let target = tiny(Family::Qwen35, "tiny", 5, true);
    let dir = target.path();
    let prompt = prompt();
    for tp in [1, 2] {
        let log = Arc::new(Mutex::new(Vec::new()));
        let factory = Arc::new(RecordingFactory {
            kind: DrafterKind::Mtp,
            weights: MtpWeights::load(dir).expect("MTP weights"),
            log: Arc::clone(&log),
        });
        let spec = spec_config(DrafterKind::Mtp, 3);
        let out = rt.block_on(async {
            let e = engine_with(dir, tp, FormChoice::Replay, 2, &spec, factory, Some(STEP_TOKENS)).await;
            let mut plain = GenerateRequest::new(prompt.clone(), params(16, 0.0, 1));
            plain.speculate = false;
            let out = run_all(
                &e,
                vec![plain, GenerateRequest::new(prompt.clone(), params(16, 0.0, 1))],
            )
            .await;
            e.shutdown().await;
            out
        });
        assert_eq!(out[1].0, out[0].0, "tp {tp}");
        let log = log.lock().expect("log").clone();
        let first = log
            .iter()
            .position(|s| matches!(s, Seen::Proposal { .. }))
            .expect("a proposal");
        // Before the first proposal: the prompt's rows, chunk by chunk, from position 0 on without a gap.
        let mut next = 0;
        for s in &log[..first] {
            let Seen::Rows(position, n) = *s else { unreachable!() };
            assert_eq!(position, next, "tp {tp}: rows continue the KV: {log:?}");
            next += n;
        }
        assert!(first >= 2, "tp {tp}: the prompt came in several chunks: {log:?}");
        assert_eq!(next, prompt.len(), "tp {tp}: every prompt row was observed: {log:?}");
        assert_eq!(
            log[first],
            Seen::Proposal {
                tokens: prompt.len() + 1,
                kv_start: 0,
                committed: prompt.len()
            },
            "tp {tp}: the first proposal drafts over a KV of the whole prompt"
        );
        // Later proposals keep that KV: it still starts at 0 and holds every committed position.
        for s in &log[first..] {
            if let Seen::Proposal {
                tokens,
                kv_start,
                committed,
            } = *s
            {
                assert_eq!((kv_start, committed), (0, tokens - 1), "tp {tp}: {log:?}");
            }
        }
    }
}
