//! Who a proxied call is for (SPEC §24.6): the agent session and agent ids coding agents
//! send, so that telemetry and `polygw report` show spend per session and per sub-agent.
//!
//! - **session**: `x-claude-code-session-id` (Claude Code), else a `session_id` /
//!   `session-id` header (Codex) or `x-session-id`, else the body's `prompt_cache_key` (what Codex and the
//!   OpenAI SDKs key a conversation's cache on);
//! - **agent**: `x-claude-code-agent-id` (a sub-agent's id);
//! - **parent agent**: `x-claude-code-parent-agent-id`.
//!
//! Each value is kept as `Attribution::id` cleans it (trimmed, no control characters, at
//! most 128 characters).

use axum::http::HeaderMap;
use polygw::core::telemetry::Attribution;

/// The headers that name an agent session, in order.
const SESSION_HEADERS: [&str; 4] = [
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "x-session-id",
];

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The call's attribution from its headers and its `prompt_cache_key` (if it has one).
pub fn of(headers: &HeaderMap, prompt_cache_key: Option<&str>) -> Attribution {
    let session = SESSION_HEADERS
        .iter()
        .filter_map(|h| header(headers, h).and_then(Attribution::id))
        .next()
        .or_else(|| prompt_cache_key.and_then(Attribution::id));
    Attribution {
        session,
        agent: header(headers, "x-claude-code-agent-id").and_then(Attribution::id),
        parent_agent: header(headers, "x-claude-code-parent-agent-id").and_then(Attribution::id),
    }
}

/// The `prompt_cache_key` of a chat request (in its overlay, as sent).
pub fn chat_cache_key(request: &polygw::ChatRequest) -> Option<&str> {
    request
        .overlay
        .as_ref()
        .and_then(|o| o.get("prompt_cache_key"))
        .and_then(|v| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::http::test_headers as headers;

    #[test]
    fn claude_codes_headers_then_codexs_then_the_cache_key() {
        let a = of(
            &headers(&[
                ("x-claude-code-session-id", "cc-sess"),
                ("session_id", "codex"),
                ("x-claude-code-agent-id", "agent-7"),
                ("x-claude-code-parent-agent-id", "agent-1"),
            ]),
            Some("pck"),
        );
        assert_eq!(a.session.as_deref(), Some("cc-sess"));
        assert_eq!(a.agent.as_deref(), Some("agent-7"));
        assert_eq!(a.parent_agent.as_deref(), Some("agent-1"));
        let a = of(&headers(&[("session_id", " codex ")]), Some("pck"));
        assert_eq!(a.session.as_deref(), Some("codex"));
        assert_eq!(a.agent, None);
        let a = of(&headers(&[("x-claude-code-session-id", "  ")]), Some("pck"));
        assert_eq!(a.session.as_deref(), Some("pck"));
        assert!(of(&HeaderMap::new(), None).is_empty());
        // Long or odd ids are kept short and printable.
        let long = "s".repeat(500);
        let a = of(&headers(&[("x-session-id", &long)]), None);
        assert_eq!(a.session.unwrap().len(), Attribution::MAX_ID_CHARS);
    }
}
