//! What a chat turn sends. A session holds tokens, not messages: the server renders the whole conversation with its
//! chat template and returns what the session lacks (`RenderChat`, see `Tokenizer::turn_delta` in the engine). The
//! transcript is the client's side of that exchange: the messages, and the text the session holds.

use crate::serve::grpc::pb;

/// A conversation: its messages, and the text its session holds.
#[derive(Clone, Debug, Default)]
pub struct Transcript {
    system: Option<String>,
    messages: Vec<pb::ChatMessage>,
    /// The text the session holds, as the template renders the conversation so far: every turn's rendering and
    /// each reply's tokens (special ones spelled out).
    held: String,
    /// The text of the token that ended the last reply, when it was an end-of-sequence token (the session holds it
    /// after `held`).
    eos_text: Option<String>,
}

fn message(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.as_bytes().to_vec(),
        ..Default::default()
    }
}

impl Transcript {
    /// An empty conversation, opened by `system` when given.
    pub fn new(system: Option<String>) -> Self {
        Transcript {
            system,
            ..Transcript::default()
        }
    }

    /// Adds the user's next message `text`; returns the request that renders the turn.
    pub fn user_turn(&mut self, text: &str) -> pb::RenderChatRequest {
        self.messages.push(message("user", text));
        let system = self.system.as_deref().map(|s| message("system", s));
        pb::RenderChatRequest {
            messages: system.into_iter().chain(self.messages.iter().cloned()).collect(),
            held: self.held.as_bytes().to_vec(),
            held_eos: self.eos_text.as_deref().unwrap_or_default().as_bytes().to_vec(),
            tools_json: String::new(),
        }
    }

    /// The turn was rendered as `turn`: once it is sent, the session holds the whole rendering.
    pub fn rendered(&mut self, turn: &pb::RenderChatResponse) {
        self.held.clone_from(&turn.rendered);
        self.eos_text = None;
    }

    /// Records the assistant's reply: `content` (the reply's tokens as text, special ones spelled out, without a
    /// final end-of-sequence token) and `eos_text`, that token's text when the reply ended with one.
    pub fn assistant_reply(&mut self, content: String, eos_text: Option<String>) {
        self.held.push_str(&content);
        self.messages.push(message("assistant", &content));
        self.eos_text = eos_text;
    }

    /// Forgets the conversation (a new session starts empty).
    pub fn reset(&mut self) {
        *self = Transcript::new(self.system.take());
    }
}

#[cfg(test)]
mod tests {
    use super::Transcript;
    use crate::serve::grpc::pb;

    fn roles(r: &pb::RenderChatRequest) -> Vec<&str> {
        r.messages.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn each_request_carries_the_conversation_and_what_the_session_holds() {
        let mut t = Transcript::new(Some("Be brief.".into()));
        let first = t.user_turn("hi");
        assert_eq!(roles(&first), ["system", "user"]);
        assert!(first.held.is_empty() && first.held_eos.is_empty());
        t.rendered(&pb::RenderChatResponse {
            rendered: "<sys>Be brief.<u>hi<a>".into(),
            ..Default::default()
        });
        t.assistant_reply("ok".into(), Some("<eos>".into()));
        let second = t.user_turn("more");
        assert_eq!(roles(&second), ["system", "user", "assistant", "user"]);
        assert_eq!(second.messages[2].content, b"ok");
        assert_eq!(second.held, b"<sys>Be brief.<u>hi<a>ok");
        assert_eq!(second.held_eos, b"<eos>");
        t.reset();
        assert_eq!(roles(&t.user_turn("again")), ["system", "user"]);
    }
}
