//! What a caller asks for: [`ChatRequest`] and its [`Message`]s.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One chat message, OpenAI-shaped. Fields other than `role` and `content` (tool calls,
/// `tool_call_id`, `name`, …) are kept verbatim in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, `developer`, …
    pub role: String,
    /// A string, or an array of typed parts (text, image_url, …); absent for some
    /// assistant tool-call messages. An explicit `"content": null` is kept as
    /// `Some(Value::Null)` and reaches the upstream as sent (SPEC §17.5).
    #[serde(
        default,
        deserialize_with = "explicit_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub content: Option<Value>,
    /// Every other field of the message, passed through unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A present field keeps its value, `null` included (`Some(Value::Null)`); an absent one
/// is `None` (`#[serde(default)]`).
fn explicit_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl Message {
    /// A message with a role and text content.
    pub fn new(role: impl Into<String>, text: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Some(Value::String(text.into())),
            extra: Map::new(),
        }
    }

    /// A `system` message.
    pub fn system(text: impl Into<String>) -> Self {
        Message::new("system", text)
    }

    /// A `user` message.
    pub fn user(text: impl Into<String>) -> Self {
        Message::new("user", text)
    }

    /// An `assistant` message.
    pub fn assistant(text: impl Into<String>) -> Self {
        Message::new("assistant", text)
    }

    /// The text of the message when its content is a plain string.
    pub fn text(&self) -> Option<&str> {
        self.content.as_ref().and_then(Value::as_str)
    }
}

/// One embedding input: a text, or the token ids of one (OpenAI accepts both; LangChain's
/// `OpenAIEmbeddings` sends token arrays by default: SPEC §17.5). Serialized as the API
/// has it: a string, or an array of integers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    /// A text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u64>),
}

impl EmbeddingInput {
    /// Its tokens: the ids' count, or the text's estimate.
    pub fn estimate_tokens(&self) -> u64 {
        match self {
            EmbeddingInput::Text(t) => crate::resume::estimate_tokens(t),
            EmbeddingInput::Tokens(ids) => ids.len() as u64,
        }
    }
}

impl From<String> for EmbeddingInput {
    fn from(s: String) -> Self {
        EmbeddingInput::Text(s)
    }
}

/// A credential a client presented for its upstream (bring your own key, a
/// subscription's token), and how it presented it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCredential {
    /// `Authorization: Bearer` (true) or `x-api-key` (false).
    pub bearer: bool,
    /// The credential.
    pub secret: crate::secret::Secret,
}

/// One logical chat call. `stream` chooses how the upstream is read; the library
/// always returns the aggregated response.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Stream from the upstream (enables TTFT/stall figures and the stall hedge).
    #[serde(default)]
    pub stream: bool,
    /// Sampling temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Output cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// `reasoning_effort` (e.g. `low`, `medium`, `high`), sent only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    /// `response_format` (e.g. `{"type":"json_object"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// Tool definitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// Merged into the request body (before the source's `EXTRA_BODY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<Map<String, Value>>,
    /// The client's request in a native API's own shape, for the sources that speak
    /// it (SPEC §23.2); they get it instead of the chat form above.
    #[serde(skip)]
    pub native: Option<std::sync::Arc<crate::native::NativeRequest>>,
    /// The request translated into the other native APIs of the scope's sources (SPEC
    /// §23.3: a chat or Responses client on a `messages` source, a chat or Messages
    /// client on a `responses` source), one per API, made by the dialects: a source of
    /// such an API is sent its translation ([`ChatRequest::native_for`]).
    #[serde(skip)]
    pub translated: Vec<std::sync::Arc<crate::native::NativeRequest>>,
    /// The client's own credential, for sources with `AUTH=client` (SPEC §23.1): never
    /// logged, stored or shown. Sources with `AUTH=client` are candidates only when
    /// there is one.
    #[serde(skip)]
    pub client_credential: Option<ClientCredential>,
    /// Only sources of the native request's API may be sent it (it refers to state
    /// only they may hold: a `previous_response_id` polygw did not store).
    #[serde(skip)]
    pub native_only: bool,
    /// The client's body as received, when the request was read from one (the proxy):
    /// a `chat` source's body is then made from it by editing it in place (SPEC §27.1,
    /// [`crate::client_body`]) instead of from the fields above. It must describe the
    /// same request as they do: code that changes the request sets it to `None` (debug
    /// builds check every body made from it against the fields).
    #[serde(skip)]
    pub wire: Option<std::sync::Arc<crate::client_body::WireBody>>,
}

impl ChatRequest {
    /// A request with these messages and defaults elsewhere.
    pub fn new(messages: Vec<Message>) -> Self {
        ChatRequest {
            messages,
            ..Default::default()
        }
    }

    /// A one-message user request.
    pub fn user(text: impl Into<String>) -> Self {
        ChatRequest::new(vec![Message::user(text)])
    }

    /// Sets `stream`.
    pub fn with_stream(mut self, stream: bool) -> Self {
        self.stream = stream;
        self
    }

    /// Sets `max_tokens`.
    pub fn with_max_tokens(mut self, max_tokens: u32) -> Self {
        self.wire = None;
        self.max_tokens = Some(max_tokens);
        self
    }

    /// Sets `temperature`.
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.wire = None;
        self.temperature = Some(temperature);
        self
    }

    /// Sets `reasoning_effort`.
    pub fn with_reasoning_effort(mut self, effort: impl Into<String>) -> Self {
        self.wire = None;
        self.reasoning_effort = Some(effort.into());
        self
    }

    /// Sets one overlay key.
    pub fn with_overlay(mut self, key: impl Into<String>, value: Value) -> Self {
        self.wire = None;
        self.overlay
            .get_or_insert_with(Map::new)
            .insert(key.into(), value);
        self
    }

    /// Whether `source` can be sent this request: chat sources take every request (its
    /// chat form), a native source only a request in its own API; a source with
    /// `AUTH=client` only a request that carries the client's credential.
    pub fn servable_by(&self, source: &crate::source::SourceConfig) -> bool {
        if source.auth == Some(crate::source::SourceAuth::Client)
            && self.client_credential.is_none()
        {
            return false;
        }
        match source.api {
            crate::source::SourceApi::Chat => !self.native_only,
            other if self.native_only => self.native.as_ref().is_some_and(|n| n.api == other),
            other => self.native_for(other).is_some(),
        }
    }

    /// What a source of `api` is sent: the client's own request when it is in that API,
    /// else its translation into it (`None`: neither).
    pub fn native_for(
        &self,
        api: crate::source::SourceApi,
    ) -> Option<&crate::native::NativeRequest> {
        self.native
            .as_deref()
            .filter(|n| n.api == api)
            .or_else(|| self.translated.iter().map(|t| &**t).find(|t| t.api == api))
    }

    /// The most output the request can make (SPEC §24.1): its cap — `max_tokens`, or in
    /// its overlay `max_completion_tokens` / `max_tokens`, or in its native body
    /// `max_tokens` / `max_output_tokens` / `max_completion_tokens`, the largest —
    /// times its `n` choices; `None` when it sets no cap.
    pub fn output_cap(&self) -> Option<u64> {
        let fields = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
        let from = |m: Option<&Map<String, Value>>| {
            m.into_iter()
                .flat_map(|m| fields.iter().filter_map(move |f| m.get(*f)?.as_u64()))
                .max()
        };
        let cap = [
            self.max_tokens.map(u64::from),
            from(self.overlay.as_ref()),
            from(self.native.as_deref().map(|n| &n.body)),
        ]
        .into_iter()
        .flatten()
        .max()?;
        Some(cap.saturating_mul(self.choices()))
    }

    /// The choices it asks for (its overlay's `n`, at least 1).
    fn choices(&self) -> u64 {
        self.overlay
            .as_ref()
            .and_then(|o| o.get("n"))
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .max(1)
    }

    /// The request with `cap` as its output cap (SPEC §24.1: what a budgeted key's call
    /// without a cap of its own is sent): `max_tokens` of the chat form, and of a native
    /// body its API's field (`max_tokens` for Messages, `max_output_tokens` for
    /// Responses). A request that has a cap keeps it.
    pub fn with_output_cap(self, cap: u64) -> Self {
        if self.output_cap().is_some() {
            return self;
        }
        self.set_output_cap(cap)
    }

    /// The request with its output cap set to `total` (all its `n` choices together, as
    /// [`ChatRequest::output_cap`] counts it; each choice gets `total / n`): in the chat
    /// form, in every cap field it carries, and in its native body's. Extended thinking
    /// (Anthropic's `thinking.budget_tokens`, which must stay in `1024 ≤ budget <
    /// max_tokens`) shrinks with it, or is turned off for the call below that (SPEC §24.1).
    pub fn set_output_cap(mut self, total: u64) -> Self {
        const FIELDS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
        let cap = (total / self.choices()).max(1);
        self.wire = None;
        // The chat form's own field, unless the client capped through another one (a
        // source refuses both at once).
        let other = self
            .overlay
            .as_ref()
            .is_some_and(|o| FIELDS.iter().any(|f| o.contains_key(*f)));
        if self.max_tokens.is_some() || !other {
            self.max_tokens = Some(u32::try_from(cap).unwrap_or(u32::MAX));
        }
        let edit = |m: &mut Map<String, Value>, own: Option<&str>| {
            for f in FIELDS {
                if m.contains_key(f) || own == Some(f) {
                    m.insert(f.to_string(), Value::from(cap));
                }
            }
            fit_thinking(m, cap);
        };
        if let Some(o) = self.overlay.as_mut() {
            edit(o, None);
        }
        let edit_native = |native: &std::sync::Arc<crate::native::NativeRequest>| {
            let field = match native.api {
                crate::source::SourceApi::Responses => "max_output_tokens",
                _ => "max_tokens",
            };
            let mut native = (**native).clone();
            edit(&mut native.body, Some(field));
            std::sync::Arc::new(native)
        };
        self.native = self.native.as_ref().map(edit_native);
        self.translated = self.translated.iter().map(edit_native).collect();
        self
    }

    /// Checks what no upstream could accept, naming the field.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.messages.is_empty() {
            return Err(("messages".into(), "must hold at least one message".into()));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if m.role.trim().is_empty() {
                return Err((format!("messages[{i}].role"), "must not be empty".into()));
            }
        }
        if let Some(t) = self.temperature {
            if !t.is_finite() || !(0.0..=2.0).contains(&t) {
                return Err(("temperature".into(), format!("{t} is not in 0..=2")));
            }
        }
        if self.max_tokens == Some(0) {
            return Err(("max_tokens".into(), "must be at least 1".into()));
        }
        if let Some(rf) = &self.response_format {
            if !rf.is_object() {
                return Err(("response_format".into(), "must be a JSON object".into()));
            }
        }
        Ok(())
    }
}

/// Keeps Anthropic's extended thinking valid under an output cap of `cap`:
/// `budget_tokens` must be at least 1024 and below `max_tokens`, so it shrinks to
/// `cap - 1`, and below 1025 thinking is turned off (`thinking` removed).
fn fit_thinking(m: &mut Map<String, Value>, cap: u64) {
    let Some(t) = m.get_mut("thinking").and_then(Value::as_object_mut) else {
        return;
    };
    let Some(budget) = t.get("budget_tokens").and_then(Value::as_u64) else {
        return;
    };
    if budget < cap {
        return;
    }
    if cap > 1024 {
        t.insert("budget_tokens".into(), Value::from(cap - 1));
    } else {
        m.remove("thinking");
    }
}

#[cfg(test)]
mod tests {
    /// SPEC §24.1: every cap field counts, the largest wins, times `n`.
    #[test]
    fn the_output_cap_reads_every_field_and_n() {
        use super::ChatRequest;
        use serde_json::json;
        assert_eq!(ChatRequest::user("x").output_cap(), None);
        assert_eq!(
            ChatRequest::user("x").with_max_tokens(10).output_cap(),
            Some(10)
        );
        let r = ChatRequest::user("x").with_overlay("max_completion_tokens", json!(300));
        assert_eq!(r.output_cap(), Some(300));
        let r = r.with_overlay("n", json!(3));
        assert_eq!(r.output_cap(), Some(900));
        let mut r = ChatRequest::user("x");
        r.native = Some(std::sync::Arc::new(crate::native::NativeRequest {
            body: json!({"max_output_tokens": 4000})
                .as_object()
                .unwrap()
                .clone(),
            ..Default::default()
        }));
        assert_eq!(r.output_cap(), Some(4000));
    }

    /// SPEC §24.1: the cap a budget pays for is sent in every field the request carries,
    /// per choice; Anthropic's thinking budget shrinks below it, or goes.
    #[test]
    fn a_set_cap_reaches_every_field_and_keeps_thinking_valid() {
        use super::ChatRequest;
        use crate::source::SourceApi;
        use serde_json::json;
        let native = |api, body: serde_json::Value| {
            let mut r = ChatRequest::user("x");
            r.native = Some(std::sync::Arc::new(crate::native::NativeRequest {
                api,
                body: body.as_object().unwrap().clone(),
                ..Default::default()
            }));
            r
        };
        // An uncapped Responses request gets its API's field.
        let r = native(SourceApi::Responses, json!({"input": "x"})).with_output_cap(4096);
        assert_eq!(r.native.as_ref().unwrap().body["max_output_tokens"], 4096);
        assert_eq!(r.output_cap(), Some(4096));
        // A capped request keeps its own cap unless it is set.
        let r = native(SourceApi::Messages, json!({"max_tokens": 64000})).with_output_cap(10);
        assert_eq!(r.output_cap(), Some(64000));
        let r = native(
            SourceApi::Messages,
            json!({"max_tokens": 64000, "thinking": {"type": "enabled", "budget_tokens": 32000}}),
        )
        .set_output_cap(8000);
        let b = &r.native.as_ref().unwrap().body;
        assert_eq!(b["max_tokens"], 8000);
        assert_eq!(b["thinking"]["budget_tokens"], 7999);
        let r = native(
            SourceApi::Messages,
            json!({"max_tokens": 64000, "thinking": {"type": "enabled", "budget_tokens": 2000}}),
        )
        .set_output_cap(1024);
        let b = &r.native.as_ref().unwrap().body;
        assert_eq!(b["max_tokens"], 1024);
        assert!(
            b.get("thinking").is_none(),
            "thinking off below 1025: {b:?}"
        );
        // A thinking budget already below the cap stays.
        let r = native(
            SourceApi::Messages,
            json!({"max_tokens": 64000, "thinking": {"type": "enabled", "budget_tokens": 2000}}),
        )
        .set_output_cap(5000);
        assert_eq!(
            r.native.as_ref().unwrap().body["thinking"]["budget_tokens"],
            2000
        );
        // Per choice: n = 3 shares the total.
        let r = ChatRequest::user("x")
            .with_overlay("max_completion_tokens", json!(300))
            .with_overlay("n", json!(3))
            .set_output_cap(600);
        assert_eq!(r.output_cap(), Some(600));
        assert_eq!(r.max_tokens, None, "only the client's own field");
        assert_eq!(r.overlay.as_ref().unwrap()["max_completion_tokens"], 200);
    }

    /// Issue 22, item 17: an assistant message's `"content": null` reaches the upstream
    /// as sent; an absent content stays absent.
    #[test]
    fn explicit_null_content_is_kept() {
        let m: super::Message =
            serde_json::from_str(r#"{"role":"assistant","content":null,"tool_calls":[]}"#).unwrap();
        assert_eq!(m.content, Some(serde_json::Value::Null));
        let back = serde_json::to_value(&m).unwrap();
        assert!(back.as_object().unwrap().contains_key("content"));
        assert!(back["content"].is_null());
        let m: super::Message = serde_json::from_str(r#"{"role":"assistant"}"#).unwrap();
        assert_eq!(m.content, None);
        assert!(!serde_json::to_value(&m)
            .unwrap()
            .as_object()
            .unwrap()
            .contains_key("content"));
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn message_keeps_unknown_fields() {
        let raw = json!({"role":"assistant","tool_calls":[{"id":"x"}],"name":"bot"});
        let m: Message = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(m.content, None);
        assert_eq!(serde_json::to_value(&m).unwrap(), raw);
    }

    #[test]
    fn validate_names_the_field() {
        assert_eq!(ChatRequest::default().validate().unwrap_err().0, "messages");
        let r = ChatRequest::user("hi").with_temperature(3.0);
        assert_eq!(r.validate().unwrap_err().0, "temperature");
        let r = ChatRequest::user("hi").with_max_tokens(0);
        assert_eq!(r.validate().unwrap_err().0, "max_tokens");
        assert!(ChatRequest::user("hi").validate().is_ok());
        let mut r = ChatRequest::user("hi");
        r.messages[0].role = " ".into();
        assert_eq!(r.validate().unwrap_err().0, "messages[0].role");
        for t in [0.0, 2.0] {
            assert!(
                ChatRequest::user("hi")
                    .with_temperature(t)
                    .validate()
                    .is_ok(),
                "{t}"
            );
        }
        for t in [-0.1, f64::NAN, f64::INFINITY] {
            assert_eq!(
                ChatRequest::user("hi")
                    .with_temperature(t)
                    .validate()
                    .unwrap_err()
                    .0,
                "temperature"
            );
        }
        let mut r = ChatRequest::user("hi");
        r.response_format = Some(json!({"type": "json_object"}));
        assert!(r.validate().is_ok());
        r.response_format = Some(json!("json"));
        assert_eq!(r.validate().unwrap_err().0, "response_format");
    }

    #[test]
    fn an_embedding_input_counts_its_tokens() {
        assert_eq!(EmbeddingInput::Tokens(vec![1, 2, 3]).estimate_tokens(), 3);
        assert_eq!(EmbeddingInput::Tokens(vec![]).estimate_tokens(), 0);
        let text = "the quick brown fox jumps over the lazy dog ".repeat(20);
        assert_eq!(
            EmbeddingInput::Text(text.clone()).estimate_tokens(),
            crate::resume::estimate_tokens(&text)
        );
        assert!(crate::resume::estimate_tokens(&text) > 1);
    }
}
