//! Structured outputs (constrained decoding) through llguidance: a request's [`ConstraintSpec`] (a JSON schema, any
//! JSON object, a regex, a choice of strings, a Lark grammar) is compiled once, at admission, into a [`Constraint`]
//! by the model's [`GrammarCompiler`]; the coordinator keeps one [`GrammarState`] a request, computes its token mask
//! before each sampled step ([`masks`], in parallel over the step's constrained rows), and advances it with each
//! sampled token. The ranks apply the mask in the sampler (`SampleRow::mask`): every forbidden token's logit becomes
//! [`MASKED`](crate::sample::MASKED), on the CPU and on the device, on the row joined across tensor-parallel ranks.
//!
//! When the grammar is complete its mask allows only the end-of-sequence ids, so the request ends by its EOS
//! (finish reason `stop`).

mod vocab;

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use rayon::prelude::*;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// The largest schema, regex or grammar a request may give, in bytes (JSON schemas counted as serialized): compile
/// time and memory grow with it, and llguidance's own limits ([`GrammarCompiler::new`]) bound what a small text can
/// expand to.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// The most strings a `guided_choice` may list.
pub const MAX_CHOICES: usize = 4096;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Text that is a JSON value valid against this JSON schema (OpenAI `json_schema`, vLLM `guided_json`), compact
    /// unless the schema's `x-guidance` options allow whitespace.
    JsonSchema(Value),
    /// Any JSON object (OpenAI `json_object`).
    JsonObject,
    /// Text matching this regular expression whole (Rust `regex` syntax; vLLM `guided_regex`).
    Regex(String),
    /// Exactly one of these strings (vLLM `guided_choice`).
    Choice(Vec<String>),
    /// Text of this Lark grammar in llguidance's dialect, which takes `%json { schema }` inline for a JSON value of
    /// a schema (vLLM `guided_grammar`; tool calls build theirs with it).
    Lark(String),
}

impl ConstraintSpec {
    /// The llguidance grammar, after the size checks.
    fn grammar(&self) -> Result<TopLevelGrammar> {
        let too_big =
            |n: usize| EngineError::InvalidInput(format!("is {n} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed"));
        let check = |n: usize| {
            if n > MAX_CONSTRAINT_BYTES {
                Err(too_big(n))
            } else {
                Ok(())
            }
        };
        Ok(match self {
            ConstraintSpec::JsonSchema(schema) => {
                check(schema.to_string().len())?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(EngineError::InvalidInput(format!(
                        "a JSON schema is an object or a boolean, got {schema}"
                    )));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            ConstraintSpec::Regex(rx) => {
                check(rx.len())?;
                TopLevelGrammar::from_regex(rx)
            }
            ConstraintSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(EngineError::InvalidInput("needs at least one choice".into()));
                }
                if choices.len() > MAX_CHOICES {
                    return Err(EngineError::InvalidInput(format!(
                        "at most {MAX_CHOICES} choices, got {}",
                        choices.len()
                    )));
                }
                if let Some(i) = choices.iter().position(String::is_empty) {
                    return Err(EngineError::InvalidInput(format!("choice {i} is empty")));
                }
                check(choices.iter().map(String::len).sum())?;
                let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            ConstraintSpec::Lark(grammar) => {
                check(grammar.len())?;
                TopLevelGrammar::from_lark(grammar.clone())
            }
        })
    }
}

/// `schema` generating compact JSON (no whitespace between tokens) unless it sets llguidance's own `x-guidance`
/// options: with free whitespace a model can spend its whole budget on blanks and never close the value (vLLM's
/// `disable_any_whitespace`, on by default here).
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// `text` as a regex matching exactly it.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A compiled constraint: its spec and the grammar's start state, which every request carrying it starts from
/// ([`Constraint::start`]). Cloning shares the compiled grammar; two constraints are equal when their specs are.
#[derive(Clone)]
pub struct Constraint(Arc<Compiled>);

/// What a [`Constraint`] shares (one pointer keeps `SamplingParams`, which every message of a request carries, small).
struct Compiled {
    spec: ConstraintSpec,
    start: Mutex<Matcher>,
}

impl Constraint {
    /// What the request asked for.
    pub fn spec(&self) -> &ConstraintSpec {
        &self.0.spec
    }

    /// A fresh state of the grammar, for one request. Its lexer cache is the request's own copy (of the one the
    /// compile warmed), so the masks of requests of one constraint are computed in parallel, not one at a time.
    pub fn start(&self) -> GrammarState {
        let matcher = self.0.start.lock().unwrap_or_else(|e| e.into_inner()).deep_clone();
        GrammarState { matcher }
    }
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        self.0.spec == other.0.spec
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Constraint").field(&self.0.spec).finish()
    }
}

/// Compiles constraints for one model: its tokenizer's token trie and llguidance's parser factory, built once.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl GrammarCompiler {
    /// The compiler for a model whose sampled rows have `vocab` ids (at least the tokenizer's) and whose
    /// end-of-sequence ids are `eos` (what a complete grammar allows). Fails for a tokenizer whose pieces are not
    /// bytes rewind can read (neither GPT-2 byte-level nor SentencePiece).
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self> {
        let env = vocab::tok_env(tokenizer, vocab, eos)?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| EngineError::NotSupported(format!("structured outputs: {e}")))?;
        factory.quiet();
        // llguidance's defaults bound one mask's work (lexer fuel, Earley items) and the compiled grammar's size;
        // a grammar past them fails to compile or its request fails, and nothing else is slowed for long.
        factory.limits_mut().verbose_errors = false;
        Ok(Self { factory, vocab })
    }

    /// The vocabulary the masks cover.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `spec`. Slow for a large schema or grammar (milliseconds to a second): call it off an async
    /// runtime. An error is [`EngineError::InvalidInput`] saying what is wrong with the spec (the caller names the
    /// request's field).
    pub fn compile(&self, spec: ConstraintSpec) -> Result<Constraint> {
        let started = std::time::Instant::now();
        let grammar = spec.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| EngineError::InvalidInput(first_line(&e.to_string())))?;
        let mut matcher = Matcher::new(Ok(parser));
        // The first mask surfaces what only a step finds (a lexer that cannot start) and is kept for the request.
        matcher
            .compute_mask()
            .map_err(|e| EngineError::InvalidInput(first_line(&e.to_string())))?;
        tracing::debug!(seconds = started.elapsed().as_secs_f64(), "compiled a constraint");
        Ok(Constraint(Arc::new(Compiled {
            spec,
            start: Mutex::new(matcher),
        })))
    }
}

fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).to_string()
}

/// One request's place in its grammar.
pub struct GrammarState {
    matcher: Matcher,
}

impl GrammarState {
    /// The ids the grammar allows next, as `vocab.div_ceil(32)` words (bit `id % 32` of word `id / 32`): the
    /// end-of-sequence ids alone once the grammar is complete.
    pub fn mask(&mut self, vocab: usize) -> Result<Vec<u32>> {
        let set = self.matcher.compute_mask_or_eos().map_err(|e| {
            EngineError::InvalidInput(format!("the output's grammar failed: {}", first_line(&e.to_string())))
        })?;
        let mut words = vec![0u32; vocab.div_ceil(32)];
        let have = set.as_slice();
        let n = words.len().min(have.len());
        words[..n].copy_from_slice(&have[..n]);
        if let Some(last) = words.last_mut().filter(|_| !vocab.is_multiple_of(32)) {
            *last &= (1u32 << (vocab % 32)) - 1;
        }
        if words.iter().all(|&w| w == 0) {
            return Err(EngineError::InvalidInput(
                "the output's grammar allows no token here (it cannot be completed with this tokenizer)".into(),
            ));
        }
        Ok(words)
    }

    /// Advances the grammar by the sampled `token`, which its last mask allowed. An end-of-sequence id after the
    /// grammar completed is taken as it is.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| {
            EngineError::InvalidInput(format!(
                "token {token} breaks the output's grammar: {}",
                first_line(&e.to_string())
            ))
        })
    }

    /// Whether the grammar is complete (only an end-of-sequence id may follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// The masks of a speculative verify's rows, without advancing: from here, row 0's mask, and after each draft
    /// token the previous mask allows, the next row's. The first draft token its mask does not allow ends the walk,
    /// so `masks.len() − 1` drafts are valid and the last mask is the row after them. These are the very masks a
    /// non-speculative run computes at those positions (llguidance's masks may force one canonical token where other
    /// tokens would also parse, so the check is against the mask, not [`GrammarState::valid_prefix`]); the grammar
    /// is rolled back to where it was, also when a mask fails.
    pub fn draft_masks(&mut self, drafts: &[u32], vocab: usize) -> Result<Vec<Vec<u32>>> {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut consumed = 0;
        let walked = (|| {
            loop {
                let mask = self.mask(vocab)?;
                let next = drafts.get(masks.len()).copied().filter(|&t| allows(&mask, t));
                masks.push(mask);
                let Some(token) = next else { return Ok(()) };
                // Once the grammar is complete only end-of-sequence ids follow, which `accept` takes as they are.
                if !self.matcher.is_stopped() {
                    self.matcher.consume_token(token).map_err(|e| {
                        EngineError::InvalidInput(format!(
                            "draft token {token} breaks the output's grammar: {}",
                            first_line(&e.to_string())
                        ))
                    })?;
                    consumed += 1;
                }
            }
        })();
        let rolled = self.matcher.rollback(consumed).map_err(|e| {
            EngineError::InvalidInput(format!(
                "the output's grammar failed to roll back a draft: {}",
                first_line(&e.to_string())
            ))
        });
        walked.and(rolled)?;
        Ok(masks)
    }

    /// How many of `tokens` the grammar accepts from here, in order, without advancing (a draft's valid prefix).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> Result<usize> {
        self.matcher.validate_tokens(tokens).map_err(|e| {
            EngineError::InvalidInput(format!("the output's grammar failed: {}", first_line(&e.to_string())))
        })
    }
}

/// Whether `mask` (as [`GrammarState::mask`] writes it) allows `token`.
pub fn allows(mask: &[u32], token: u32) -> bool {
    mask.get(token as usize / 32)
        .is_some_and(|w| w >> (token % 32) & 1 == 1)
}

/// The masks of `states` over `vocab` ids, computed in parallel on rayon's threads (each mask takes tens of
/// microseconds to milliseconds, and a step's constrained rows are independent).
pub fn masks(states: &mut [&mut GrammarState], vocab: usize) -> Vec<Result<Vec<u32>>> {
    let span = tracing::debug_span!("grammar_masks", rows = states.len(), seconds = tracing::field::Empty);
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let out = states.par_iter_mut().map(|s| s.mask(vocab)).collect();
    span.record("seconds", started.elapsed().as_secs_f64());
    out
}

/// [`GrammarState::draft_masks`] of each `(state, drafts)`, in parallel on rayon's threads (a verify's rows are
/// walked one after the other, the step's constrained requests side by side).
pub fn draft_masks(items: &mut [(&mut GrammarState, &[u32])], vocab: usize) -> Vec<Result<Vec<Vec<u32>>>> {
    let span = tracing::debug_span!(
        "grammar_draft_masks",
        rows = items.len(),
        seconds = tracing::field::Empty
    );
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let out = items
        .par_iter_mut()
        .map(|(s, drafts)| s.draft_masks(drafts, vocab))
        .collect();
    span.record("seconds", started.elapsed().as_secs_f64());
    out
}

#[cfg(test)]
mod tests;
