//! Log-probabilities of a request's tokens: which rows a step asks the ranks about (per sequence a
//! [`LogprobRows`]), and the entries built from the merged row summaries (`rank/vocab.rs`) — never from whole logit
//! rows. A value is `logit(token) − logsumexp(row)` of the raw logits, whatever the request's sampling did (vLLM's
//! default "raw" log-probabilities).
//!
//! A request asking for them does not chain and does not speculate (`step.rs`), so every token it gets comes from a
//! single step's row that the plan asked about. A prompt's entries come from its prefill chunks' rows (every
//! position reported), gathered until the last chunk and sent once, before the first token; a re-prefill after a
//! preemption or a fault asks again only if they were not sent yet. A request of `n > 1` choices
//! ([`LiveLogprobs::split`]) gathers its prompt's entries once, in the shared fork prefill (whose rows predict every
//! prompt token but the first), and each choice its own tokens' entries from its own rows.

use rewind_engine::rank::{LogprobRows, RowPass, Rows};

use crate::request::TokenLogprob;

/// What a live request asked for and what its prompt's rows gave so far.
#[derive(Clone, Debug)]
pub(super) struct LiveLogprobs {
    /// Top entries per generated token; `None`: the generated tokens carry none.
    generated: Option<usize>,
    /// The prompt's entries while they are being gathered (`None` when never asked, or once sent).
    prompt: Option<PromptRows>,
    /// The request scores its prompt and generates nothing (`max_tokens: 0`): its one picked token is dropped.
    pub prompt_only: bool,
}

#[derive(Clone, Debug)]
struct PromptRows {
    top: usize,
    /// The whole prompt: a fork prefill runs all of it but the last token, whose rows still predict every one.
    prompt: Vec<u32>,
    /// Per prompt position; the first stays `None` (nothing predicts it).
    entries: Vec<Option<TokenLogprob>>,
}

/// How a sequence's step reports: its rows and what they ask for their log-probabilities.
pub(super) struct Reporting {
    pub rows: Rows,
    pub logprobs: Option<LogprobRows>,
}

impl LiveLogprobs {
    /// The state of a request of `prompt` asking `generated` / `prompt_top` top entries; `None` when it asks for
    /// neither.
    pub fn new(generated: Option<usize>, prompt_top: Option<usize>, prompt: &[u32], prompt_only: bool) -> Option<Self> {
        if generated.is_none() && prompt_top.is_none() {
            return None;
        }
        Some(LiveLogprobs {
            generated,
            prompt: prompt_top.map(|top| PromptRows {
                top,
                prompt: prompt.to_vec(),
                entries: vec![None; prompt.len()],
            }),
            prompt_only,
        })
    }

    /// Splits a request's asks between its `n > 1` choices: what the shared fork prefill gathers (the prompt's
    /// entries, sent once for the request; its own dropped pick reports none), and what each choice asks of its own
    /// rows (its tokens' entries, and whether it only scores the prompt). Either part may ask nothing.
    pub fn split(self) -> (Option<Self>, Option<Self>) {
        let shared = self.prompt.map(|p| LiveLogprobs {
            generated: None,
            prompt: Some(p),
            prompt_only: false,
        });
        let each = (self.generated.is_some() || self.prompt_only).then_some(LiveLogprobs {
            generated: self.generated,
            prompt: None,
            prompt_only: self.prompt_only,
        });
        (shared, each)
    }

    /// Top entries per generated token, when asked.
    pub fn generated(&self) -> Option<usize> {
        self.generated.filter(|_| !self.prompt_only)
    }

    /// What a prefill chunk of `len` tokens at `position` reports; `picks`: its last row picks the next token. While
    /// the prompt's entries are being gathered every row reports, each asking about the prompt token after it (the
    /// row after the prompt about its pick).
    pub fn prefill(&self, position: usize, len: usize, picks: bool) -> Reporting {
        let generated = self.generated().filter(|_| picks);
        if let Some(p) = &self.prompt {
            let targets = (position + 1..=position + len)
                .map(|next| p.prompt.get(next).copied())
                .collect();
            return Reporting {
                rows: Rows::All,
                logprobs: Some(LogprobRows {
                    top: p.top.max(generated.unwrap_or(0)),
                    targets,
                }),
            };
        }
        Reporting {
            rows: if picks { Rows::Last } else { Rows::None },
            logprobs: generated.map(|top| LogprobRows {
                top,
                targets: vec![None],
            }),
        }
    }

    /// What a decode step reports (its one row).
    pub fn decode(&self) -> Option<LogprobRows> {
        self.generated().map(|top| LogprobRows {
            top,
            targets: vec![None],
        })
    }

    /// Records the rows `rows` of a prefill chunk at `position` that reported every row; `last`: the chunk ends the
    /// sequence's prefill, and the gathered entries are returned, to be sent once.
    pub fn note_prompt(
        &mut self,
        position: usize,
        rows: &[RowPass],
        last: bool,
    ) -> Result<Option<Vec<Option<TokenLogprob>>>, String> {
        let Some(p) = self.prompt.as_mut() else {
            return Ok(None);
        };
        for (i, row) in rows.iter().enumerate() {
            let next = position + i + 1;
            let Some(&token) = p.prompt.get(next) else { break };
            p.entries[next] = Some(entry(row, token, p.top)?);
        }
        if !last {
            return Ok(None);
        }
        let p = self.prompt.take().map(|p| p.entries);
        if let Some(missing) = p.as_ref().and_then(|e| e.iter().skip(1).position(Option::is_none)) {
            return Err(format!(
                "the prompt's row before position {} was never reported, so its log-probability is unknown",
                missing + 1
            ));
        }
        Ok(p)
    }
}

/// `token`'s entry from its row's merged summary, with the row's `top` best entries: `logit − lse` each.
pub(super) fn entry(row: &RowPass, token: u32, top: usize) -> Result<TokenLogprob, String> {
    let lp = row
        .logprob
        .as_ref()
        .ok_or_else(|| format!("the row that chose token {token} carries no log-probabilities"))?;
    let logit = row
        .logit_of(token)
        .ok_or_else(|| format!("the row that chose token {token} does not know its logit"))?;
    Ok(TokenLogprob {
        token,
        logprob: logit - row.lse,
        top: lp.top.entries().take(top).map(|(id, v)| (id, v - row.lse)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use rewind_engine::rank::{summarise_logits_with, LogprobRequest};

    use super::*;

    fn row(logits: &[f32], target: Option<u32>, top: usize) -> RowPass {
        summarise_logits_with(logits, 0, None, Some(&LogprobRequest { top, target }))
    }

    #[test]
    fn an_entry_is_the_raw_softmax_of_the_row() {
        let logits = [1.0f32, 3.0, -2.0, 0.5];
        let lse = logits.iter().map(|v| v.exp()).sum::<f32>().ln();
        let r = row(&logits, Some(2), 2);
        let e = entry(&r, 2, 2).expect("target");
        assert!((e.logprob - (-2.0 - lse)).abs() < 1e-6);
        assert_eq!(e.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
        assert!((e.top[0].1 - (3.0 - lse)).abs() < 1e-6);
        // The argmax is known without a target; a token the summary never saw is an error, not a guess.
        assert!(entry(&row(&logits, None, 0), 1, 0).is_ok());
        assert!(entry(&row(&logits, None, 0), 3, 0).is_err());
        assert!(entry(&row(&logits, None, 1), 1, 1).expect("the argmax").top.len() == 1);
    }

    #[test]
    fn prompt_rows_are_asked_until_the_last_chunk_and_sent_once() {
        let history = [5u32, 6, 7, 8, 9];
        let mut l = LiveLogprobs::new(Some(1), Some(3), &history, false).expect("asked");
        let first = l.prefill(0, 3, false);
        assert_eq!(first.rows, Rows::All);
        let lp = first.logprobs.expect("rows");
        assert_eq!(lp.targets, vec![Some(6), Some(7), Some(8)]);
        assert_eq!(lp.top, 3);
        let last = l.prefill(3, 2, true).logprobs.expect("rows");
        assert_eq!(last.targets, vec![Some(9), None], "the picking row asks about its pick");
        let logits = [0.0f32; 10];
        let rows: Vec<RowPass> = [6u32, 7, 8].iter().map(|&t| row(&logits, Some(t), 3)).collect();
        assert_eq!(l.note_prompt(0, &rows, false), Ok(None));
        let rows = [row(&logits, Some(9), 3), row(&logits, None, 3)];
        let sent = l.note_prompt(3, &rows, true).expect("rows").expect("complete");
        assert_eq!(sent.len(), 5);
        assert!(sent[0].is_none());
        assert!(sent[1..]
            .iter()
            .all(|e| e.as_ref().is_some_and(|e| (e.logprob + 10f32.ln()).abs() < 1e-5)));
        // Sent: a re-prefill reports only its picking row again.
        let again = l.prefill(0, 5, true);
        assert_eq!(again.rows, Rows::Last);
        assert_eq!(again.logprobs.expect("generated").targets, vec![None]);
    }

    #[test]
    fn choices_gather_the_prompt_once_in_the_fork_prefill() {
        let prompt = [5u32, 6, 7, 8];
        let (shared, each) = LiveLogprobs::new(Some(2), Some(1), &prompt, false)
            .expect("asked")
            .split();
        let mut shared = shared.expect("the prompt's part");
        assert_eq!(shared.generated(), None, "the fork prefill's pick is dropped");
        // The fork prefill runs the prompt but its last token; its rows predict every prompt token after the first.
        let r = shared.prefill(0, 3, true);
        assert_eq!(r.rows, Rows::All);
        assert_eq!(r.logprobs.expect("rows").targets, vec![Some(6), Some(7), Some(8)]);
        let logits = [0.0f32; 10];
        let rows: Vec<RowPass> = [6u32, 7, 8].iter().map(|&t| row(&logits, Some(t), 1)).collect();
        let sent = shared.note_prompt(0, &rows, true).expect("rows").expect("complete");
        assert!(sent[0].is_none() && sent[1..].iter().all(Option::is_some), "{sent:?}");
        let each = each.expect("the choices' part");
        assert_eq!(each.generated(), Some(2));
        let r = each.prefill(3, 1, true);
        assert_eq!(r.rows, Rows::Last, "a choice reports its picking row only");
        assert_eq!(r.logprobs.expect("its pick").targets, vec![None]);
        // Choices asking nothing of their own carry nothing; a scoring request's choices keep `prompt_only`.
        let (_, none) = LiveLogprobs::new(None, Some(1), &prompt, false).expect("asked").split();
        assert!(none.is_none());
        let (_, scoring) = LiveLogprobs::new(None, Some(1), &prompt, true).expect("asked").split();
        assert!(scoring.is_some_and(|s| s.prompt_only && s.generated().is_none()));
    }
}
