//! The coordinator's reading of hidden rows: both layouts a rank may return (every prefill row, or only the reported
//! rows), and the hand-over of committed rows to a drafter once the token after each is known.

use std::sync::{Arc, Mutex};

use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{Batch, Program, Rows, SeqKind};
use rewind_engine::spec::{Draft, DrafterKind, SpecConfig, SpecPolicy};

use super::*;

const WIDTH: usize = 2;

fn seq(kind: SeqKind, position: usize, n: usize, rows: Rows) -> SeqStep {
    SeqStep {
        slot: 0,
        kind,
        position,
        tokens: vec![1; n],
        form: FormChoice::Replay,
        rows,
        sample: None,
        spec: None,
        logprobs: None,
    }
}

/// A plan of an intermediate prompt chunk (positions 0..3), a last chunk (5..7), a decode (at 9) and a verify of
/// three tokens (at 20).
fn plan() -> StepPlan {
    StepPlan {
        commits: Vec::new(),
        program: Program::Batch(Batch {
            seqs: vec![
                seq(SeqKind::Prefill, 0, 3, Rows::None),
                seq(SeqKind::Prefill, 5, 2, Rows::Last),
                seq(SeqKind::Decode, 9, 1, Rows::Last),
                seq(SeqKind::Verify, 20, 3, Rows::All),
            ],
            full_logits: false,
            hidden: true,
            mtp: Vec::new(),
        }),
    }
}

/// A step result whose hidden row `i` holds `[i, i]`.
fn result(rows: usize) -> StepResult {
    StepResult {
        rows: Vec::new(),
        sampled: Vec::new(),
        logits: None,
        hidden: Some((0..rows).flat_map(|i| [i as f32; WIDTH]).collect()),
        chain: None,
        mtp: Vec::new(),
    }
}

/// The positions and row ids of sequence `seq`'s hidden rows (whose last token is at `last`).
fn read(layout: &HiddenLayout, r: &StepResult, seq: usize, last: usize) -> Option<(usize, Vec<f32>)> {
    layout.rows(r, seq, last).map(|h| {
        assert_eq!(h.hidden, WIDTH);
        (h.position, h.rows.chunks(WIDTH).map(|c| c[0]).collect())
    })
}

#[test]
fn both_hidden_layouts_are_read() {
    let plan = plan();
    // Every prefill row (the CPU rank): 3 + 2 + 1 + 3 rows.
    let r = result(9);
    let l = HiddenLayout::of(&plan, &r, Some(WIDTH)).expect("layout");
    assert_eq!(read(&l, &r, 0, 2), Some((0, vec![0.0, 1.0, 2.0])));
    assert_eq!(read(&l, &r, 1, 6), Some((5, vec![3.0, 4.0])));
    assert_eq!(read(&l, &r, 2, 9), Some((9, vec![5.0])));
    assert_eq!(read(&l, &r, 3, 22), Some((20, vec![6.0, 7.0, 8.0])));
    // Only the reported rows (the GPU rank so far): 0 + 1 + 1 + 3 rows.
    let r = result(5);
    let l = HiddenLayout::of(&plan, &r, Some(WIDTH)).expect("layout");
    assert_eq!(read(&l, &r, 0, 2), None);
    assert_eq!(read(&l, &r, 1, 6), Some((6, vec![0.0])));
    assert_eq!(read(&l, &r, 2, 9), Some((9, vec![1.0])));
    assert_eq!(read(&l, &r, 3, 22), Some((20, vec![2.0, 3.0, 4.0])));
    // Neither layout, or no width to read them with: no rows rather than misread ones.
    assert!(HiddenLayout::of(&plan, &result(7), Some(WIDTH)).is_none());
    assert!(HiddenLayout::of(&plan, &result(9), None).is_none());
}

/// Records the rows a drafter observes.
struct Recorder(Arc<Mutex<Vec<(usize, usize)>>>);

impl Drafter for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, _: &[u32], h: &HiddenRows) -> Result<()> {
        self.0.lock().expect("log").push((h.position, h.rows.len() / h.hidden));
        Ok(())
    }

    fn propose(&mut self, _: &DraftInput<'_>) -> Result<Draft> {
        Ok(Draft::default())
    }
}

struct Factory(DrafterKind, Arc<Mutex<Vec<(usize, usize)>>>);

impl DrafterFactory for Factory {
    fn kind(&self) -> &DrafterKind {
        &self.0
    }

    fn drafter(&self, _: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(Recorder(Arc::clone(&self.1))))
    }

    fn wants_hidden(&self) -> bool {
        true
    }
}

fn rows(position: usize, n: usize) -> HiddenRows {
    HiddenRows {
        position,
        hidden: WIDTH,
        rows: vec![0.0; n * WIDTH],
    }
}

#[test]
fn committed_rows_reach_the_drafter_once_their_next_tokens_are_known() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let spec = EngineSpec {
        config: SpecConfig {
            drafter: DrafterKind::Mtp,
            window: 2,
            policy: SpecPolicy::Fixed,
            profile: None,
        },
        factory: Arc::new(Factory(DrafterKind::Mtp, Arc::clone(&log))),
    };
    let params = SamplingParams::greedy();
    let prompt = [7u32; 6];
    let mut live = LiveSpec::new(
        &spec,
        &DraftRequest {
            prompt: &prompt,
            params: &params,
            seed: 0,
            reference: None,
        },
        false,
    )
    .expect("spec");
    let fed = |live: &mut LiveSpec, tokens: &[u32]| live.feed(tokens, &params, 0).expect("feed");
    // Two prompt chunks: the first's rows all have their next token in the prompt.
    live.add_hidden(rows(0, 4));
    fed(&mut live, &prompt);
    // The last chunk's last row waits for the first generated token.
    live.add_hidden(rows(4, 2));
    fed(&mut live, &prompt);
    assert_eq!(*log.lock().expect("log"), [(0, 4), (4, 1)]);
    let mut stream = prompt.to_vec();
    stream.push(1);
    // A decode's row continues the waiting one: both go together once its token is known.
    live.add_hidden(rows(6, 1));
    stream.push(2);
    fed(&mut live, &stream);
    assert_eq!(log.lock().expect("log")[2..], [(5, 2)]);
    // A gap (rows past the drafter's end) replaces whatever waited; the drafter restarts there.
    live.add_hidden(rows(10, 1));
    live.add_hidden(rows(12, 1));
    stream.extend([3; 6]);
    fed(&mut live, &stream);
    assert_eq!(log.lock().expect("log")[3..], [(12, 1)]);
    // After a reset (preemption, recovery) nothing waits.
    live.add_hidden(rows(13, 1));
    live.reset();
    fed(&mut live, &stream);
    assert_eq!(log.lock().expect("log").len(), 4);
}

/// The chain rule: pinned requests never chain; plain ones chain their decodes, greedy or sampled (the ranks draw
/// sampled rows themselves, joined across tensor-parallel ranks); a speculating request chains where its verifies
/// are judged on the ranks (greedy or one-pass) and chain at all.
#[test]
fn the_chain_rule() {
    let ask = |greedy, one_pass, speculates, verifies_chain| ChainAsk {
        greedy,
        one_pass,
        pinned: false,
        speculates,
        verifies_chain,
    };
    let cases = [
        // Plain requests, greedy or sampled.
        (ask(true, false, false, false), Chain::All),
        (ask(false, true, false, true), Chain::All),
        (ask(false, false, false, false), Chain::All),
        // Speculating, greedy.
        (ask(true, false, true, true), Chain::All),
        (ask(true, false, true, false), Chain::None),
        // Speculating, sampled at a plain temperature.
        (ask(false, true, true, true), Chain::All),
        // Judged on whole rows (top-k, top-p, ...): nothing.
        (ask(false, false, true, true), Chain::None),
        // A drafter the ranks cannot run, or one step per engine step: nothing.
        (ask(false, true, true, false), Chain::None),
    ];
    for (a, want) in cases {
        assert_eq!(chain_rule(&a), want, "{a:?}");
        assert_eq!(
            chain_rule(&ChainAsk { pinned: true, ..a }),
            Chain::None,
            "pinned: {a:?}"
        );
    }
}
