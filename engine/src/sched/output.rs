//! What a request's sampled tokens become for its client: text released as it becomes complete UTF-8, stop strings
//! held back and cut (or kept, `include_stop_str_in_output`), and the finish rule (EOS, stop ids, stop strings, none
//! of them before `min_tokens`; `max_tokens`, the context limit) — the
//! coordinator runs one [`OutputStream`] per request.

use serde::Serialize;

use crate::error::Result;
use crate::sample::{SamplingParams, StopChecker, StopOutcome};
use crate::tokenizer::{DecodeStream, Tokenizer};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-sequence token was sampled.
    Eos,
    /// A `stop_token_ids` token was sampled.
    StopToken,
    /// A stop string was generated.
    StopString,
    /// The model's context limit was reached.
    ContextLimit,
}

impl FinishReason {
    /// The OpenAI API's name for it (`stop` or `length`).
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Length | FinishReason::ContextLimit => "length",
            _ => "stop",
        }
    }

    /// The snake_case name, as in JSON (`stop_string`, `context_limit`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::StopToken => "stop_token",
            FinishReason::StopString => "stop_string",
            FinishReason::ContextLimit => "context_limit",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one sampled token produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text that became final (empty while a character or a possible stop string is held back).
    pub text: String,
    /// Set when the request ends with this token.
    pub finish: Option<FinishReason>,
}

/// One request's output state; see the module docs.
pub struct OutputStream {
    text: Option<DecodeStream>,
    stops: StopChecker,
    eos: Vec<u32>,
    stop_ids: Vec<u32>,
    /// Tokens generated before EOS, stop ids or stop strings may end the request.
    min_tokens: usize,
    include_stop: bool,
    /// Tokens to generate at most, and whether that limit is the context's (not the request's `max_tokens`).
    limit: usize,
    limit_is_context: bool,
    generated: usize,
    finished: Option<FinishReason>,
}

impl OutputStream {
    /// The output of a request with `params` whose prompt leaves `room` tokens of context; EOS ids end it unless
    /// `params.ignore_eos`. Without a tokenizer only ids are produced (no text, stop strings unseen).
    pub fn new(tokenizer: Option<&Tokenizer>, params: &SamplingParams, eos: &[u32], room: usize) -> Self {
        let (limit, limit_is_context) = match params.max_tokens {
            Some(m) if m <= room => (m, false),
            _ => (room, true),
        };
        OutputStream {
            text: tokenizer.map(|t| t.decode_stream(true)),
            stops: StopChecker::new(&params.stop_strings),
            eos: if params.ignore_eos { Vec::new() } else { eos.to_vec() },
            stop_ids: params.stop_token_ids.clone(),
            min_tokens: params.min_tokens,
            include_stop: params.include_stop_str_in_output,
            limit,
            limit_is_context,
            generated: 0,
            finished: None,
        }
    }

    /// Tokens the request may generate at most.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Tokens taken so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Why the request ended, once it has.
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Takes the next sampled token.
    pub fn push(&mut self, token: u32) -> Result<Pushed> {
        if self.finished.is_some() {
            return Ok(Pushed::default());
        }
        self.generated += 1;
        let mut out = Pushed::default();
        let mut finish = None;
        // vLLM's rule: the sampler masks EOS and stop ids while fewer than `min_tokens` are generated, so the first
        // that may end the request is token `min_tokens + 1`; a stop string may end with token `min_tokens`.
        let ids_end = self.generated > self.min_tokens;
        if ids_end && self.eos.contains(&token) {
            finish = Some(FinishReason::Eos);
        } else if ids_end && self.stop_ids.contains(&token) {
            finish = Some(FinishReason::StopToken);
        } else if let Some(stream) = &mut self.text {
            if let Some(piece) = stream.step(token)? {
                let outcome = if self.generated >= self.min_tokens {
                    self.stops.push(&piece)
                } else {
                    self.stops.push_unchecked(&piece)
                };
                match outcome {
                    StopOutcome::Continue(t) => out.text = t,
                    StopOutcome::Stopped { emit, stop } => {
                        out.text = emit;
                        if self.include_stop {
                            out.text.push_str(&stop);
                        }
                        finish = Some(FinishReason::StopString);
                    }
                }
            }
        }
        if finish.is_none() && self.generated >= self.limit {
            finish = Some(if self.limit_is_context {
                FinishReason::ContextLimit
            } else {
                FinishReason::Length
            });
        }
        if let Some(f) = finish {
            if f != FinishReason::StopString {
                out.text.push_str(&self.flush()?);
            }
            self.finished = Some(f);
        }
        out.finish = finish;
        Ok(out)
    }

    /// Releases held-back text at the end (an incomplete character as U+FFFD, a partial stop string as text).
    fn flush(&mut self) -> Result<String> {
        let mut rest = String::new();
        if let Some(stream) = &mut self.text {
            if let Some(piece) = stream.flush()? {
                let (StopOutcome::Continue(t) | StopOutcome::Stopped { emit: t, .. }) = self.stops.push(&piece);
                rest.push_str(&t);
            }
        }
        rest.push_str(&self.stops.finish());
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bpe_builder::{self, SpecialTokenChoice};

    fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().expect("tempdir");
        let bpe = bpe_builder::build_bpe_tokenizer(600).expect("tokenizer");
        bpe_builder::write_tokenizer_files(dir.path(), &bpe, &SpecialTokenChoice::default()).expect("write");
        let t = Tokenizer::from_dir(dir.path()).expect("load");
        (dir, t)
    }

    fn run(s: &mut OutputStream, ids: &[u32]) -> (String, Option<FinishReason>, usize) {
        let mut text = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let p = s.push(id).expect("push");
            text.push_str(&p.text);
            if p.finish.is_some() {
                return (text, p.finish, i + 1);
            }
        }
        (text, None, ids.len())
    }

    #[test]
    fn finish_rules_and_text() {
        let (_d, tok) = tokenizer();
        let ids = tok.encode("hello world, hello there", false).expect("encode");
        let whole = tok.decode(&ids, true).expect("decode");
        let greedy = SamplingParams::greedy();
        // Every token's text, in order, is the whole decode; the length limit ends it at the last token.
        let p = SamplingParams {
            max_tokens: Some(ids.len()),
            ..greedy.clone()
        };
        let mut s = OutputStream::new(Some(&tok), &p, &[], 1000);
        assert_eq!(
            run(&mut s, &ids),
            (whole.clone(), Some(FinishReason::Length), ids.len())
        );
        // The context limit when it comes first.
        let mut s = OutputStream::new(Some(&tok), &p, &[], 2);
        assert_eq!(run(&mut s, &ids).1, Some(FinishReason::ContextLimit));
        // EOS and stop ids end it at that token, without its text.
        let mut s = OutputStream::new(Some(&tok), &greedy, &[ids[2]], 1000);
        assert_eq!(run(&mut s, &ids).1, Some(FinishReason::Eos));
        let p = SamplingParams {
            ignore_eos: true,
            stop_token_ids: vec![ids[3]],
            ..greedy.clone()
        };
        let mut s = OutputStream::new(Some(&tok), &p, &[ids[2]], 1000);
        assert_eq!(run(&mut s, &ids).2, 4);
        // A stop string is cut, with the text before it.
        let p = SamplingParams {
            stop_strings: vec![", hello".into()],
            ..greedy
        };
        let mut s = OutputStream::new(Some(&tok), &p, &[], 1000);
        let (text, finish, _) = run(&mut s, &ids);
        assert_eq!((text.as_str(), finish), ("hello world", Some(FinishReason::StopString)));
        // include_stop_str_in_output keeps it.
        let keep = SamplingParams {
            include_stop_str_in_output: true,
            ..p.clone()
        };
        let mut s = OutputStream::new(Some(&tok), &keep, &[], 1000);
        let (text, finish, _) = run(&mut s, &ids);
        assert_eq!(
            (text.as_str(), finish),
            ("hello world, hello", Some(FinishReason::StopString))
        );
    }

    #[test]
    fn nothing_ends_a_request_before_min_tokens() {
        let (_d, tok) = tokenizer();
        let ids = tok.encode("hello world, hello there", false).expect("encode");
        let p = SamplingParams {
            min_tokens: 3,
            stop_token_ids: vec![ids[1]],
            ..SamplingParams::greedy()
        };
        // EOS and stop ids among the first 3 tokens do not end it; the 4th may.
        let eos = [ids[0], ids[2]];
        let mut s = OutputStream::new(Some(&tok), &p, &eos, 1000);
        let (_, finish, n) = run(&mut s, &[ids[0], ids[1], ids[2], ids[0]]);
        assert_eq!((finish, n), (Some(FinishReason::Eos), 4));
        // A stop string completed before token `min_tokens` is text; the next one ends it.
        let first = (1..=ids.len())
            .find(|&n| tok.decode(&ids[..n], true).expect("decode").contains("hello"))
            .expect("the text holds hello");
        let stop = SamplingParams {
            min_tokens: first + 1,
            stop_strings: vec!["hello".into()],
            ..SamplingParams::greedy()
        };
        let mut s = OutputStream::new(Some(&tok), &stop, &[], 1000);
        let (text, finish, _) = run(&mut s, &ids);
        assert_eq!(
            (text.as_str(), finish),
            ("hello world, ", Some(FinishReason::StopString))
        );
    }
}
