//! Reasoning separated from the answer in a model's output, for `<think>...</think>` models (Qwen3, Qwen3-Next,
//! Qwen3.5, Nemotron-H / Nemotron-3; vLLM's `qwen3` reasoning parser): the text inside the block is the reasoning,
//! the text after it the answer.
//!
//! Templates of thinking models often end the generation prompt with `<think>` themselves, so the output starts
//! inside the block and only ever shows `</think>`; [`prompt_opens_reasoning`] tells from the rendered prompt. Text
//! comes in pieces as it is generated ([`ReasoningSplitter::push`]), and a marker may be split across pieces, so a
//! piece that could be the start of one is held back until the next piece decides it. Streaming and whole answers go
//! through the same splitter, so they split alike.

/// Opens the reasoning block.
pub const THINK_START: &str = "<think>";
/// Closes the reasoning block.
pub const THINK_END: &str = "</think>";

/// Whether a chat template writes reasoning blocks (so its model's answers should be split): it mentions `<think>`.
pub fn template_reasons(source: &str) -> bool {
    source.contains(THINK_START)
}

/// Whether a rendered prompt leaves a reasoning block open (its generation prompt ends with `<think>`), so that the
/// model's output starts inside it.
pub fn prompt_opens_reasoning(rendered: &str) -> bool {
    rendered.trim_end().ends_with(THINK_START)
}

/// A piece of output split in two: what belongs to the reasoning and what to the answer (either may be empty).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl Split {
    /// Whether neither part has text.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }

    fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Before any text but whitespace: the output may still open a block.
    Start,
    Reasoning,
    Content,
}

/// Splits one answer's text, fed piece by piece, into reasoning and content.
#[derive(Clone, Debug)]
pub struct ReasoningSplitter {
    state: State,
    /// Text not yet given out: what may be the start of a marker.
    held: String,
}

impl ReasoningSplitter {
    /// A splitter for an answer whose prompt left a reasoning block open (`in_reasoning`, see
    /// [`prompt_opens_reasoning`]) or not.
    pub fn new(in_reasoning: bool) -> Self {
        Self {
            state: if in_reasoning { State::Reasoning } else { State::Start },
            held: String::new(),
        }
    }

    /// The next piece of the answer: what of it (and of what was held back) is now known to be reasoning or content.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(THINK_START) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning;
                    } else if THINK_START.starts_with(trimmed) {
                        // Only whitespace, or the start of `<think>` so far: the next piece decides.
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.held.find(THINK_END) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + THINK_END.len());
                        self.state = State::Content;
                        continue;
                    }
                    let keep = partial_marker_len(&self.held, THINK_END);
                    let give = self.held.len() - keep;
                    out.reasoning.push_str(&self.held[..give]);
                    self.held.drain(..give);
                    return out;
                }
                State::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The end of the answer: what was held back, given to the part it was in (an unclosed block is reasoning cut
    /// short; text that only looked like the start of a marker is what it was).
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => Split {
                reasoning: held,
                content: String::new(),
            },
            State::Start | State::Content => Split {
                reasoning: String::new(),
                content: held,
            },
        }
    }

    /// A whole answer split at once (the same as pushing it in pieces and finishing).
    pub fn split_all(in_reasoning: bool, text: &str) -> Split {
        let mut s = Self::new(in_reasoning);
        let mut out = s.push(text);
        out.append(s.finish());
        out
    }
}

/// The length of the longest end of `text` that is a proper start of `marker` (a marker that may be split across
/// pieces), at a character boundary.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits `text` fed in pieces of `size` characters, merging the parts.
    fn pieces(in_reasoning: bool, text: &str, size: usize) -> Split {
        let chars: Vec<char> = text.chars().collect();
        let mut s = ReasoningSplitter::new(in_reasoning);
        let mut out = Split::default();
        for chunk in chars.chunks(size) {
            out.append(s.push(&chunk.iter().collect::<String>()));
        }
        out.append(s.finish());
        out
    }

    fn split(reasoning: &str, content: &str) -> Split {
        Split {
            reasoning: reasoning.into(),
            content: content.into(),
        }
    }

    #[test]
    fn a_block_at_the_start_is_reasoning_however_the_text_is_cut() {
        let text = "\n<think>\nLet me see: 2+2.\n</think>\n\nIt is 4 — é.";
        for size in 1..=text.chars().count() {
            assert_eq!(
                pieces(false, text, size),
                split("\nLet me see: 2+2.\n", "\n\nIt is 4 — é."),
                "pieces of {size}"
            );
        }
    }

    #[test]
    fn a_prompt_that_opened_the_block_starts_in_reasoning() {
        let text = "thinking hard</think>answer";
        for size in 1..=text.len() {
            assert_eq!(
                pieces(true, text, size),
                split("thinking hard", "answer"),
                "pieces of {size}"
            );
        }
        // Cut off before the block closed: all of it is reasoning, the held `</th` included.
        assert_eq!(pieces(true, "still going </th", 3), split("still going </th", ""));
    }

    #[test]
    fn text_without_a_block_is_content() {
        assert_eq!(
            ReasoningSplitter::split_all(false, "plain answer"),
            split("", "plain answer")
        );
        // A block later in the answer is not reasoning; a lone `<thi` at the end is text.
        assert_eq!(
            ReasoningSplitter::split_all(false, "a <think>b</think>"),
            split("", "a <think>b</think>")
        );
        assert_eq!(pieces(false, "  <thi", 2), split("", "  <thi"));
        assert_eq!(ReasoningSplitter::split_all(false, ""), split("", ""));
    }

    #[test]
    fn markers_are_found_split_across_pieces() {
        let mut s = ReasoningSplitter::new(true);
        assert_eq!(s.push("abc</"), split("abc", ""));
        assert_eq!(s.push("thi"), split("", ""));
        assert_eq!(s.push("nk>\n\nok"), split("", "\n\nok"));
        assert_eq!(s.finish(), split("", ""));
        // A false start is given back as reasoning once it cannot be the marker.
        let mut s = ReasoningSplitter::new(true);
        assert_eq!(s.push("x</t"), split("x", ""));
        assert_eq!(s.push("able"), split("</table", ""));
    }

    #[test]
    fn prompts_and_templates_are_recognised() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(prompt_opens_reasoning("<SPECIAL_11>Assistant\n<think>\n\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n<think></think>"));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        assert!(template_reasons("{{ '<think>\\n' }}"));
        assert!(!template_reasons("{{ messages }}"));
    }
}
