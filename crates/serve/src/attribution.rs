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

/// The headers read, in the order of [`of`]'s slots: the four that name an agent
/// session (in order of preference), then the agent and its parent.
const HEADERS: [&str; 6] = [
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "x-session-id",
    "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id",
];

/// The call's attribution from its headers and its `prompt_cache_key` (if it has one).
/// One pass over the request's headers (a handful), not six hashed lookups (issue 42);
/// each header counts by its first value, as `HeaderMap::get` reads it.
pub fn of(headers: &HeaderMap, prompt_cache_key: Option<&str>) -> Attribution {
    let mut first: [Option<Option<&str>>; 6] = [None; 6];
    for (name, value) in headers {
        if let Some(i) = HEADERS.iter().position(|h| *h == name.as_str()) {
            first[i].get_or_insert(value.to_str().ok());
        }
    }
    let id = |i: usize| first[i].flatten().and_then(Attribution::id);
    Attribution {
        session: (0..4)
            .find_map(id)
            .or_else(|| prompt_cache_key.and_then(Attribution::id)),
        agent: id(4),
        parent_agent: id(5),
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

    /// A header sent twice counts by its first value, as `HeaderMap::get` reads it;
    /// the order the client sent the headers in does not change the preference.
    #[test]
    fn the_first_value_counts_and_the_preference_is_fixed() {
        let mut h = headers(&[
            ("session-id", "third"),
            ("x-claude-code-session-id", "first"),
        ]);
        h.append("x-claude-code-session-id", "again".parse().unwrap());
        h.append(
            "x-claude-code-agent-id",
            axum::http::HeaderValue::from_bytes(b"\xff").unwrap(),
        );
        h.append("x-claude-code-agent-id", "valid".parse().unwrap());
        let a = of(&h, None);
        assert_eq!(a.session.as_deref(), Some("first"));
        // Its first value is not text: no agent (the second is not read).
        assert_eq!(a.agent, None);
    }
}
