//! MTP drafting on the CPU ranks ([`super::mtp`]) proposes exactly what the host's MTP drafter proposes from the
//! same hidden rows: after prompt chunks, after verifies whose drafts were rejected or accepted, after a step whose
//! first token is not the one the ranks guessed (the repair), at TP 1 and 2, in every form.

use std::path::Path;

use super::*;
use crate::decode::{DecoderConfig, FormChoice};
use crate::init::{init_model, InitOptions};
use crate::model::{Family, ModelConfig};
use crate::spec::accept::accept_summaries;
use crate::spec::mtp::{MtpDrafter, MtpWeights};
use crate::spec::{DraftInput, Drafter, HiddenRows};

const WINDOW: usize = 3;

fn checkpoint(family: Family) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    init_model(&InitOptions {
        family,
        // Nemotron-H: the preset whose MTP layer is a latent MoE, as Nemotron-3 Super's.
        preset: if family == Family::NemotronH {
            "tiny-latent"
        } else {
            "tiny"
        }
        .into(),
        layers: None,
        seed: 5,
        out: dir.path().to_path_buf(),
        dtype: None,
        mtp: true,
    })
    .expect("init-model");
    dir
}

fn group(dir: &Path, tp: usize, mtp: bool) -> RankGroup {
    let opts = CpuOptions {
        tp,
        decoder: DecoderConfig {
            buffer_len: 12,
            max_verify: WINDOW + 1,
            ..DecoderConfig::new(2, 64)
        },
    };
    RankGroup::start(&CpuLauncher::new(dir, opts).expect("launcher").with_mtp(mtp)).expect("group")
}

fn step(kind: SeqKind, position: usize, tokens: &[u32], form: FormChoice, rows: Rows) -> SeqStep {
    SeqStep {
        slot: 0,
        kind,
        position,
        tokens: tokens.to_vec(),
        form,
        rows,
        sample: None,
        spec: None,
        logprobs: None,
    }
}

/// One step of slot 0 asking for the MTP layer's proposal and the hidden rows.
fn run(g: &mut RankGroup, commits: Vec<Commit>, s: SeqStep) -> StepResult {
    let plan = StepPlan {
        commits,
        program: Program::Batch(Batch {
            seqs: vec![s],
            full_logits: false,
            hidden: true,
            mtp: vec![MtpRequest {
                slot: 0,
                window: WINDOW,
            }],
        }),
    };
    g.step(plan).expect("step")
}

/// The host drafter's proposal after `stream` from `rows` (hidden rows of positions `position ..`).
fn host(d: &mut MtpDrafter, stream: &[u32], position: usize, rows: &[f32], width: usize) -> Vec<u32> {
    let rows = HiddenRows {
        position,
        hidden: width,
        rows: rows.to_vec(),
    };
    d.propose(&DraftInput {
        tokens: stream,
        hidden: Some(&rows),
        max: WINDOW,
    })
    .expect("host proposal")
    .tokens
}

/// The target's greedy continuation of `prompt` (`n` tokens), from a group without MTP.
fn greedy(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut g = group(dir, 1, false);
    assert_eq!(g.open(FormChoice::Recurrent).expect("open"), 0);
    let r = g
        .step(StepPlan::batch(vec![step(
            SeqKind::Prefill,
            0,
            prompt,
            FormChoice::Recurrent,
            Rows::Last,
        )]))
        .expect("prefill");
    let mut out = vec![r.rows[0].argmax];
    while out.len() < n {
        let p = prompt.len() + out.len() - 1;
        let last = *out.last().expect("a token");
        let r = g
            .step(StepPlan::batch(vec![step(
                SeqKind::Decode,
                p,
                &[last],
                FormChoice::Recurrent,
                Rows::Last,
            )]))
            .expect("decode");
        out.push(r.rows[0].argmax);
    }
    out
}

fn check(family: Family, tp: usize, form: FormChoice) {
    let dir = checkpoint(family);
    let config = ModelConfig::from_dir(dir.path()).expect("config");
    let (vocab, width) = (config.vocab_size as u32, config.hidden_size);
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 37 + 5) % vocab).collect();
    let oracle = greedy(dir.path(), &prompt, 24);
    let mut g = group(dir.path(), tp, true);
    assert_eq!(g.open(form).expect("open"), 0);
    assert!(g.infos().iter().all(|i| i.mtp), "the ranks loaded the MTP layer");
    let mut host_drafter = MtpDrafter::new(MtpWeights::load(dir.path()).expect("MTP weights"));
    let label = format!("{family:?} tp {tp} {form}");

    // The prompt in two chunks; the first reports no row, so its last row waits for the second chunk's token.
    let r1 = run(
        &mut g,
        vec![],
        step(SeqKind::Prefill, 0, &prompt[..6], form, Rows::None),
    );
    assert!(r1.mtp.is_empty(), "{label}: no proposal before the prompt's last row");
    let r2 = run(
        &mut g,
        vec![],
        step(SeqKind::Prefill, 6, &prompt[6..], form, Rows::Last),
    );
    let mut rows: Vec<f32> = [r1.hidden.expect("hidden"), r2.hidden.expect("hidden")].concat();
    let mut y = r2.rows[0].argmax;
    let mut stream: Vec<u32> = prompt.iter().copied().chain([y]).collect();
    let mut proposal = r2.mtp.first().cloned().expect("a proposal after the prompt");
    assert_eq!((proposal.position, proposal.token), (prompt.len(), y), "{label}");
    assert_eq!(
        proposal.drafts,
        host(&mut host_drafter, &stream, 0, &rows, width),
        "{label}: after the prompt"
    );

    // Verifies: the ranks' own drafts (mostly rejected on random weights), then the target's greedy tokens (all
    // accepted), then a decode fed another token than the ranks guessed.
    let mut commits = Vec::new();
    let mut position = prompt.len();
    for k in 0..6 {
        if k == 4 {
            // The coordinator overrides the guessed token (a grammar, a stop): the ranks repair the row before it.
            let z = (y + 1) % vocab;
            *stream.last_mut().expect("stream") = z;
            let r = run(
                &mut g,
                std::mem::take(&mut commits),
                step(SeqKind::Decode, position, &[z], form, Rows::Last),
            );
            let saved = rows[rows.len() - width..].to_vec();
            y = r.rows[0].argmax;
            stream.push(y);
            let p = r.mtp.first().cloned().expect("a proposal after the decode");
            assert_eq!((p.position, p.token), (position + 1, y), "{label}: decode proposal");
            let fed: Vec<f32> = saved
                .iter()
                .chain(r.hidden.as_deref().expect("hidden"))
                .copied()
                .collect();
            assert_eq!(
                p.drafts,
                host(&mut host_drafter, &stream, position - 1, &fed, width),
                "{label}: repair"
            );
            rows = r.hidden.expect("hidden");
            position += 1;
            proposal = p;
            continue;
        }
        let drafts: Vec<u32> = if k % 2 == 0 || position + WINDOW >= prompt.len() + oracle.len() {
            proposal.drafts.clone()
        } else {
            oracle[position - prompt.len() + 1..position - prompt.len() + 1 + WINDOW].to_vec()
        };
        let tokens: Vec<u32> = std::iter::once(y).chain(drafts.iter().copied()).collect();
        let r = run(
            &mut g,
            std::mem::take(&mut commits),
            step(SeqKind::Verify, position, &tokens, form, Rows::All),
        );
        let v = accept_summaries(&r.rows, &drafts, None).expect("judge");
        let hidden = r.hidden.expect("hidden");
        stream.extend_from_slice(&drafts[..v.accepted]);
        stream.push(v.token);
        let p = r.mtp.first().cloned().expect("a proposal after the verify");
        assert_eq!(
            (p.position, p.token),
            (position + v.accepted + 1, v.token),
            "{label}: verify {k}"
        );
        let fed = &hidden[..(v.accepted + 1) * width];
        assert_eq!(
            p.drafts,
            host(&mut host_drafter, &stream, position, fed, width),
            "{label}: verify {k}"
        );
        if k % 2 == 1 && k < 4 && drafts == oracle[position - prompt.len() + 1..][..drafts.len()] {
            assert_eq!(v.accepted, WINDOW, "{label}: the target's own tokens are accepted");
        }
        commits = vec![Commit {
            slot: 0,
            accepted: v.accepted + 1,
        }];
        rows = hidden[..(v.accepted + 1) * width].to_vec();
        position += v.accepted + 1;
        y = v.token;
        proposal = p;
    }
}

#[test]
fn rank_mtp_drafts_equal_the_host_drafter() {
    for family in [Family::Qwen35, Family::NemotronH] {
        for tp in [1, 2] {
            check(family, tp, FormChoice::Replay);
        }
    }
    check(Family::Qwen3Next, 1, FormChoice::Recurrent);
    check(Family::Qwen35, 1, FormChoice::KvOnly);
}

#[test]
fn mtp_requests_are_refused_without_an_mtp_layer() {
    let dir = checkpoint(Family::Qwen35);
    let mut g = group(dir.path(), 1, false);
    assert_eq!(g.open(FormChoice::Replay).expect("open"), 0);
    let plan = StepPlan {
        commits: vec![],
        program: Program::Batch(Batch {
            seqs: vec![step(SeqKind::Prefill, 0, &[1, 2, 3], FormChoice::Replay, Rows::Last)],
            full_logits: false,
            hidden: false,
            mtp: vec![MtpRequest { slot: 0, window: 2 }],
        }),
    };
    let e = g.step(plan).expect_err("no MTP layer").to_string();
    assert!(e.contains("MTP"), "{e}");
    // A checkpoint without MTP weights cannot start ranks that draft with them.
    let plain = crate::init::tiny_checkpoint(Family::Qwen35, 3);
    let opts = CpuOptions {
        tp: 1,
        decoder: DecoderConfig::new(1, 32),
    };
    let e = RankGroup::start(&CpuLauncher::new(plain.path(), opts).expect("launcher").with_mtp(true))
        .err()
        .expect("no MTP weights")
        .to_string();
    assert!(e.contains("no MTP weights"), "{e}");
}
