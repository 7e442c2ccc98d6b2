//! Stop strings for streaming generation.
//!
//! Text arrives in pieces (one detokenized chunk per token) and a stop string can straddle pieces, so the checker
//! holds back the longest tail of the pending text that is still a prefix of some stop string. Held-back text is
//! released as soon as it can no longer start a stop string, or by [`StopChecker::finish`] when generation ends.
//! Because of that, no part of a stop string is ever emitted, and every occurrence starts in the pending text.

/// What [`StopChecker::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; the text may be emitted (possibly empty while a tail is held back).
    Continue(String),
    /// A stop string matched: emit `emit` (the text before it), then end generation.
    Stopped {
        /// Text preceding the stop string that had not been emitted yet.
        emit: String,
        /// The stop string that matched.
        stop: String,
    },
}

/// Tracks generated text and detects stop strings (see the module docs).
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    pending: String,
    emitted: String,
    matched: Option<String>,
}

impl StopChecker {
    /// A checker for `stop_strings` (empty strings are ignored; [`super::SamplingParams::validate`] rejects them).
    pub fn new(stop_strings: &[String]) -> Self {
        Self {
            stops: stop_strings.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            emitted: String::new(),
            matched: None,
        }
    }

    /// Adds newly decoded text. After a stop, further pushes are ignored and report the same stop with nothing to emit.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.push_checked(text, true)
    }

    /// Adds newly decoded text that may not end generation yet (`min_tokens`): a stop string inside it is emitted as
    /// text, while a tail that may start one is still held back, so a stop string completed by a later push counts.
    pub fn push_unchecked(&mut self, text: &str) -> StopOutcome {
        self.push_checked(text, false)
    }

    fn push_checked(&mut self, text: &str, check: bool) -> StopOutcome {
        if let Some(stop) = &self.matched {
            return StopOutcome::Stopped {
                emit: String::new(),
                stop: stop.clone(),
            };
        }
        self.pending.push_str(text);
        // Earliest occurrence wins; at equal starts the longer stop string (it also contains the shorter one's text).
        let found = self
            .stops
            .iter()
            .filter(|_| check)
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.len().cmp(&a.1.len())));
        if let Some((at, stop)) = found {
            let stop = stop.clone();
            let emit = self.pending[..at].to_string();
            self.emitted.push_str(&emit);
            self.pending.clear();
            self.matched = Some(stop.clone());
            return StopOutcome::Stopped { emit, stop };
        }
        let hold = self.held_back_len();
        let cut = self.pending.len() - hold;
        let emit: String = self.pending.drain(..cut).collect();
        self.emitted.push_str(&emit);
        StopOutcome::Continue(emit)
    }

    /// Length in bytes of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn held_back_len(&self) -> usize {
        let max = self.stops.iter().map(String::len).max().unwrap_or(0);
        let start_min = self.pending.len().saturating_sub(max.saturating_sub(1));
        (start_min..self.pending.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .map_or(0, |i| self.pending.len() - i)
    }

    /// Ends generation without a stop string: returns the held-back text (empty after a stop).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        self.emitted.push_str(&rest);
        rest
    }

    /// Everything emitted so far (excluding held-back text and the stop string).
    pub fn text(&self) -> &str {
        &self.emitted
    }

    /// The stop string that ended generation, if any.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn stops(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn holds_back_a_partial_stop_and_releases_it_when_it_diverges() {
        let mut c = StopChecker::new(&stops(&["</end>"]));
        assert_eq!(c.push("hello </"), StopOutcome::Continue("hello ".into()));
        assert_eq!(c.push("en"), StopOutcome::Continue(String::new()));
        assert_eq!(c.push("vy"), StopOutcome::Continue("</envy".into()));
        assert_eq!(c.push(" ok </e"), StopOutcome::Continue(" ok ".into()));
        assert_eq!(
            c.push("nd> tail"),
            StopOutcome::Stopped {
                emit: String::new(),
                stop: "</end>".into()
            }
        );
        assert_eq!(c.text(), "hello </envy ok ");
        assert_eq!(c.matched(), Some("</end>"));
        assert!(matches!(c.push("more"), StopOutcome::Stopped { ref emit, .. } if emit.is_empty()));
        assert_eq!(c.finish(), "");
    }

    #[test]
    fn unchecked_text_emits_stop_strings_but_holds_a_started_one() {
        let mut c = StopChecker::new(&stops(&["ab"]));
        assert_eq!(c.push_unchecked("xab a"), StopOutcome::Continue("xab ".into()));
        assert_eq!(
            c.push("b!"),
            StopOutcome::Stopped {
                emit: String::new(),
                stop: "ab".into()
            }
        );
        assert_eq!(c.text(), "xab ");
    }

    #[test]
    fn earliest_match_wins_and_finish_flushes() {
        let mut c = StopChecker::new(&stops(&["world", "lo w"]));
        assert_eq!(
            c.push("hello world"),
            StopOutcome::Stopped {
                emit: "hel".into(),
                stop: "lo w".into()
            }
        );
        let mut c = StopChecker::new(&stops(&["STOP"]));
        assert_eq!(c.push("abc ST"), StopOutcome::Continue("abc ".into()));
        assert_eq!(c.finish(), "ST");
        assert_eq!(c.text(), "abc ST");
        let mut none = StopChecker::new(&[]);
        assert_eq!(none.push("any text"), StopOutcome::Continue("any text".into()));
    }

    #[test]
    fn multibyte_stop_strings_split_across_pushes() {
        let mut c = StopChecker::new(&stops(&["étoile✨"]));
        assert_eq!(c.push("une é"), StopOutcome::Continue("une ".into()));
        assert_eq!(c.push("toile"), StopOutcome::Continue(String::new()));
        assert!(matches!(c.push("✨!"), StopOutcome::Stopped { .. }));
        assert_eq!(c.text(), "une ");
    }

    /// Property: for random texts split at random char boundaries, the emitted text equals the text before the
    /// first stop occurrence (or all of it), and no emitted piece ever ends inside a would-be stop string.
    #[test]
    fn streaming_equals_one_shot_on_random_splits() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let alphabet: Vec<char> = "ab<>/ é".chars().collect();
        let stop_list = stops(&["</a>", "bb", "é/"]);
        for _ in 0..2000 {
            let len = rng.random_range(0..30);
            let text: String = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let expected_end = stop_list.iter().filter_map(|s| text.find(s.as_str())).min();
            let mut c = StopChecker::new(&stop_list);
            let mut out = String::new();
            let mut stopped = false;
            let chars: Vec<char> = text.chars().collect();
            let mut i = 0;
            while i < chars.len() {
                let n = rng.random_range(1..=3).min(chars.len() - i);
                let piece: String = chars[i..i + n].iter().collect();
                i += n;
                match c.push(&piece) {
                    StopOutcome::Continue(e) => out.push_str(&e),
                    StopOutcome::Stopped { emit, .. } => {
                        out.push_str(&emit);
                        stopped = true;
                        break;
                    }
                }
                // Nothing emitted may already contain a stop string.
                assert!(
                    stop_list.iter().all(|s| !out.contains(s.as_str())),
                    "{text:?} -> {out:?}"
                );
            }
            if !stopped {
                out.push_str(&c.finish());
            }
            assert_eq!(stopped, expected_end.is_some(), "{text:?}");
            assert_eq!(out, &text[..expected_end.unwrap_or(text.len())], "{text:?}");
            assert_eq!(c.text(), out);
        }
    }
}
