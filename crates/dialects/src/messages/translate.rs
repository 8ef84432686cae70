//! A Messages request as a core [`ChatRequest`], with the [`MessagesMeta`] needed to
//! write the answer back; and `count_tokens`, polygw's own estimate.

use std::collections::BTreeMap;

use polygw_core::resume::estimate_prompt_tokens;
use polygw_core::ChatRequest;
use serde_json::{json, Map, Value};

use super::request::{parse, MessagesRequest};
use crate::error::DialectError;

/// A Messages request translated: the chat request and what writing its answer needs.
pub type Translated = crate::Translated<MessagesMeta>;

/// What the answer to a Messages request needs.
#[derive(Debug, Clone)]
pub struct MessagesMeta {
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) thinking_visible: bool,
    pub(crate) stop_sequences: Vec<String>,
    pub(crate) names: BTreeMap<String, String>,
    pub(crate) prompt_estimate: u64,
    pub(crate) unsupported: Vec<String>,
}

impl MessagesMeta {
    /// The model the client asked for.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the client asked for a stream.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// Whether reasoning comes back as thinking blocks (thinking on in the request).
    pub fn thinking_visible(&self) -> bool {
        self.thinking_visible
    }

    /// polygw's estimate of the prompt's tokens (`count_tokens`' answer), used for
    /// `usage.input_tokens` when the source reports no usage.
    pub fn prompt_estimate(&self) -> u64 {
        self.prompt_estimate
    }

    /// The client's name of the tool behind a chat function name (names chat sources
    /// refuse, e.g. longer than 64 characters, are shortened on the way up).
    pub fn tool_name<'a>(&'a self, chat_name: &'a str) -> &'a str {
        self.names.get(chat_name).map_or(chat_name, String::as_str)
    }

    /// Anthropic-run tools not sent upstream.
    pub fn unsupported_tools(&self) -> &[String] {
        &self.unsupported
    }
}

/// Translates a Messages request: `system` and `role: "system"` entries become system
/// messages, tool results tool messages; `stop_sequences` → `stop`, `top_p`,
/// `tool_choice` and `parallel_tool_calls` (from `disable_parallel_tool_use`, only when
/// tools are sent) in the overlay; `thinking` / `output_config.effort` →
/// `reasoning_effort`; `output_config.format` → `response_format`.
pub fn to_chat(req: &MessagesRequest) -> Result<Translated, DialectError> {
    let mut overlay = Map::new();
    if !req.stop_sequences.is_empty() {
        overlay.insert("stop".into(), json!(req.stop_sequences));
    }
    if let Some(t) = req.top_p {
        overlay.insert("top_p".into(), json!(t));
    }
    if !req.tools.is_empty() {
        if let Some(c) = &req.tool_choice {
            overlay.insert("tool_choice".into(), c.clone());
        }
        if let Some(p) = req.parallel_tool_calls {
            overlay.insert("parallel_tool_calls".into(), Value::Bool(p));
        }
    }
    let request = ChatRequest {
        messages: req.messages.clone(),
        stream: req.stream,
        temperature: req.temperature,
        max_tokens: req.max_tokens,
        reasoning_effort: req.reasoning_effort.clone(),
        response_format: req.response_format.clone(),
        tools: (!req.tools.is_empty()).then(|| req.tools.clone()),
        overlay: (!overlay.is_empty()).then_some(overlay),
        native: None,
        translated: Vec::new(),
        native_only: false,
        client_credential: None,
        wire: None,
    };
    request
        .validate()
        .map_err(|(field, message)| DialectError::invalid(&field, format!("{field}: {message}")))?;
    let prompt_estimate = estimate_prompt_tokens(&request);
    Ok(crate::Translated {
        request,
        meta: MessagesMeta {
            model: req.model.clone(),
            stream: req.stream,
            thinking_visible: req.thinking_visible,
            stop_sequences: req.stop_sequences.clone(),
            names: req.names.clone(),
            prompt_estimate,
            unsupported: req.unsupported.clone(),
        },
    })
}

/// `POST /v1/messages/count_tokens`: the estimate polygw uses for TPM
/// ([`estimate_prompt_tokens`] of the translated request); `max_tokens` is not needed.
pub fn count_tokens(body: &[u8]) -> Result<u64, DialectError> {
    let req = parse(body, false)?;
    Ok(to_chat(&req)?.meta.prompt_estimate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::parse_request;

    #[test]
    fn options_reach_the_chat_request() {
        let body = json!({"model": "m", "max_tokens": 64, "stream": true, "temperature": 0.2, "top_p": 0.9,
            "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 10000},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [{"role": "user", "content": "hi"}]});
        let t = to_chat(&parse_request(body.to_string().as_bytes()).unwrap()).unwrap();
        let r = &t.request;
        assert!(r.stream);
        assert_eq!((r.max_tokens, r.temperature), (Some(64), Some(0.2)));
        assert_eq!(r.reasoning_effort.as_deref(), Some("medium"));
        assert_eq!(
            Value::Object(r.overlay.clone().unwrap()),
            json!({"stop": ["END"], "top_p": 0.9, "tool_choice": "required", "parallel_tool_calls": false})
        );
        assert!(t.meta.thinking_visible());
        assert!(t.meta.prompt_estimate() > 0);
    }

    #[test]
    fn count_tokens_needs_no_max_tokens() {
        let body = json!({"model": "m", "system": "sys", "messages": [{"role": "user", "content": "x".repeat(400)}]});
        let n = count_tokens(body.to_string().as_bytes()).unwrap();
        // The request's framing, the system text and one message with its framing
        // (SPEC §24.3's estimate).
        let text = polygw_core::estimate::text_tokens;
        assert_eq!(
            n,
            polygw_core::estimate::REQUEST_FRAMING + text("sys") + 4 + text(&"x".repeat(400)) + 4
        );
        assert!(parse_request(body.to_string().as_bytes()).is_err());
    }
}
