//! What a chat turn sends. A session holds tokens, not messages: each turn sends only the text that the chat template
//! puts between what the session already holds and the new assistant prompt. That text is the difference between the
//! template's rendering of the whole conversation and what the session holds (the earlier renderings plus the
//! replies as generated), so the tokens a session holds are those a single rendering of the conversation would give
//! (up to where tokenization splits the pieces).

use anyhow::Result;
use rewind_engine::tokenizer::chat::ChatMessage;
use rewind_engine::tokenizer::Tokenizer;

/// A conversation: its messages, and the text its session holds.
#[derive(Clone, Debug, Default)]
pub struct Transcript {
    system: Option<String>,
    messages: Vec<ChatMessage>,
    /// The text the session holds, as the template renders the conversation so far: every turn's rendering and
    /// each reply's tokens (special ones spelled out).
    held: String,
    /// The text of the token that ended the last reply, when it was an end-of-sequence token (the session holds it;
    /// the template writes its own end of turn, which starts with it when the model's EOS is the template's
    /// end-of-turn marker).
    eos_text: Option<String>,
}

impl Transcript {
    /// An empty conversation, opened by `system` when given.
    pub fn new(system: Option<String>) -> Self {
        Transcript {
            system,
            ..Transcript::default()
        }
    }

    fn all_messages(&self) -> Vec<ChatMessage> {
        let mut all = Vec::with_capacity(self.messages.len() + 1);
        if let Some(s) = &self.system {
            all.push(ChatMessage::new("system", s.clone()));
        }
        all.extend(self.messages.iter().cloned());
        all
    }

    /// The text to send for the user's next message `text`: the rendering of the conversation with it and the
    /// assistant prompt, less what the session holds. Returns it with whether the exact difference was found (a
    /// template that rewrites earlier turns, e.g. dropping reasoning, falls back to rendering the new message alone).
    pub fn user_turn(&mut self, tokenizer: &Tokenizer, text: &str) -> Result<(String, bool)> {
        self.messages.push(ChatMessage::new("user", text));
        let full = tokenizer.render(&self.all_messages(), true)?;
        let (delta, exact) = match full.strip_prefix(self.held.as_str()) {
            Some(rest) => {
                let rest = match &self.eos_text {
                    Some(eos) => rest.strip_prefix(eos.as_str()).unwrap_or(rest),
                    None => rest,
                };
                (rest.to_string(), true)
            }
            None => {
                let alone = tokenizer.render(&[ChatMessage::new("user", text)], true)?;
                (alone, false)
            }
        };
        self.held = full;
        self.eos_text = None;
        Ok((delta, exact))
    }

    /// Records the assistant's reply: `content` (the reply's tokens as text, special ones spelled out, without a
    /// final end-of-sequence token) and `eos_text`, that token's text when the reply ended with one.
    pub fn assistant_reply(&mut self, content: String, eos_text: Option<String>) {
        self.held.push_str(&content);
        self.messages.push(ChatMessage::new("assistant", content));
        self.eos_text = eos_text;
    }

    /// Forgets the conversation (a new session starts empty).
    pub fn reset(&mut self) {
        *self = Transcript::new(self.system.take());
    }

    /// Messages so far (the system message not counted).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.messages.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Transcript;
    use rewind_engine::tokenizer::Tokenizer;

    /// The ChatML tokenizer `init-model` writes.
    fn tokenizer() -> Tokenizer {
        let dir = std::env::temp_dir().join(format!("rewind-chat-turns-{}", std::process::id()));
        let inner = rewind_engine::tokenizer::bpe_builder::build_bpe_tokenizer(512).expect("tokenizer");
        rewind_engine::tokenizer::bpe_builder::write_tokenizer_files(&dir, &inner, &Default::default()).expect("files");
        let t = Tokenizer::from_dir(&dir).expect("load");
        let _ = std::fs::remove_dir_all(&dir);
        t
    }

    #[test]
    fn each_turn_sends_only_what_the_session_lacks() {
        let tok = tokenizer();
        let mut t = Transcript::new(Some("Be brief.".into()));
        let (first, exact) = t.user_turn(&tok, "hi").expect("turn 1");
        assert!(exact);
        assert!(first.contains("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"));
        assert!(first.ends_with("<|im_start|>assistant\n"), "{first:?}");
        // A reply cut by max_tokens: the template's end of turn follows it.
        t.assistant_reply("hello there".into(), None);
        let (second, exact) = t.user_turn(&tok, "more").expect("turn 2");
        assert!(exact);
        assert_eq!(
            second,
            "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
        );
        // A reply that ended with the end-of-turn token: the session holds it already.
        t.assistant_reply("ok".into(), Some("<|im_end|>".into()));
        let (third, _) = t.user_turn(&tok, "bye").expect("turn 3");
        assert_eq!(third, "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(t.len(), 5);
        t.reset();
        assert_eq!(t.len(), 0);
        let (again, _) = t.user_turn(&tok, "hi").expect("after reset");
        assert_eq!(again, first);
    }
}
