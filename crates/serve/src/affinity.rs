//! The affinity key of a proxied call (SPEC §20.2), from the request's body and headers,
//! in the order the specification ranks them: the client's `prompt_cache_key`, else an
//! `x-session-id` / `session_id` header, else `metadata.session_id`, else `user`
//! (Anthropic's `metadata.user_id`). What is found goes into `CallOptions::affinity_key`;
//! nothing found leaves it `None`, and the library keys the call on a hash of its system
//! prompt and first user message. The library hashes the key (the store never holds the
//! client's text) and decides what affinity does with it (`{S}__AFFINITY`).

use axum::http::HeaderMap;
use polygw::core::affinity::KeySources;
use polygw::ChatRequest;
use polygw_dialects::messages::MessagesRequest;
use polygw_dialects::responses::ResponsesRequest;
use serde_json::Value;

/// The headers that name a session, in order.
pub const SESSION_HEADERS: [&str; 2] = ["x-session-id", "session_id"];

/// The first session header with a non-empty text value.
fn session_header(headers: &HeaderMap) -> Option<&str> {
    SESSION_HEADERS.iter().find_map(|h| {
        headers
            .get(*h)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    })
}

/// `/v1/chat/completions`: the body's fields are in the request's overlay as sent.
pub fn chat_key(headers: &HeaderMap, request: &ChatRequest) -> Option<String> {
    let mut k = KeySources::of_request(request);
    k.session_header = session_header(headers);
    k.explicit().map(str::to_string)
}

/// `/v1/responses`: `prompt_cache_key`, `metadata.session_id` and `user` are the
/// Responses request's own (not sent upstream).
pub fn responses_key(
    headers: &HeaderMap,
    req: &ResponsesRequest,
    request: &ChatRequest,
) -> Option<String> {
    let mut k = KeySources::of_request(request);
    k.prompt_cache_key = req.affinity_key().or(k.prompt_cache_key);
    k.session_header = session_header(headers);
    k.metadata_session = req
        .metadata()
        .and_then(|m| m.get("session_id"))
        .and_then(Value::as_str)
        .or(k.metadata_session);
    k.user = req.user().or(k.user);
    k.explicit().map(str::to_string)
}

/// `/v1/messages`: `metadata.user_id` ranks as `user`.
pub fn messages_key(
    headers: &HeaderMap,
    req: &MessagesRequest,
    request: &ChatRequest,
) -> Option<String> {
    let mut k = KeySources::of_request(request);
    k.session_header = session_header(headers);
    k.user = req.affinity_key().or(k.user);
    k.explicit().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use crate::http::test_headers as headers;

    fn chat(body: Value) -> ChatRequest {
        let mut r = ChatRequest::user("hi");
        r.overlay = body.as_object().cloned();
        r
    }

    #[test]
    fn chat_ranks_prompt_cache_key_then_header_then_metadata_then_user() {
        let all = chat(json!({
            "prompt_cache_key": "pck", "metadata": {"session_id": "meta"}, "user": "u"
        }));
        let h = headers(&[("x-session-id", "hdr")]);
        assert_eq!(chat_key(&h, &all).as_deref(), Some("pck"));
        let no_pck = chat(json!({"metadata": {"session_id": "meta"}, "user": "u"}));
        assert_eq!(chat_key(&h, &no_pck).as_deref(), Some("hdr"));
        let under = headers(&[("session_id", "under")]);
        assert_eq!(chat_key(&under, &no_pck).as_deref(), Some("under"));
        let blank = headers(&[("x-session-id", "  "), ("session_id", "second")]);
        assert_eq!(chat_key(&blank, &no_pck).as_deref(), Some("second"));
        assert_eq!(
            chat_key(&HeaderMap::new(), &no_pck).as_deref(),
            Some("meta")
        );
        let user = chat(json!({"user": "u"}));
        assert_eq!(chat_key(&HeaderMap::new(), &user).as_deref(), Some("u"));
        // Nothing: the library hashes the prompt.
        assert_eq!(chat_key(&HeaderMap::new(), &ChatRequest::user("hi")), None);
    }

    #[test]
    fn responses_reads_its_own_fields() {
        let body = br#"{"model": "m", "input": "hi", "prompt_cache_key": "pck",
            "metadata": {"session_id": "meta"}, "user": "u"}"#;
        let req = polygw_dialects::responses::parse_request(body).unwrap();
        let t = polygw_dialects::responses::to_chat(&req, &[]).unwrap();
        let h = headers(&[("x-session-id", "hdr")]);
        assert_eq!(responses_key(&h, &req, &t.request).as_deref(), Some("pck"));
        let body = br#"{"model": "m", "input": "hi", "metadata": {"session_id": "meta"},
            "user": "u"}"#;
        let req = polygw_dialects::responses::parse_request(body).unwrap();
        let t = polygw_dialects::responses::to_chat(&req, &[]).unwrap();
        assert_eq!(responses_key(&h, &req, &t.request).as_deref(), Some("hdr"));
        assert_eq!(
            responses_key(&HeaderMap::new(), &req, &t.request).as_deref(),
            Some("meta")
        );
        let body = br#"{"model": "m", "input": "hi", "user": "u"}"#;
        let req = polygw_dialects::responses::parse_request(body).unwrap();
        let t = polygw_dialects::responses::to_chat(&req, &[]).unwrap();
        assert_eq!(
            responses_key(&HeaderMap::new(), &req, &t.request).as_deref(),
            Some("u")
        );
    }

    #[test]
    fn messages_ranks_user_id_below_the_header() {
        let body = br#"{"model": "m", "max_tokens": 5, "metadata": {"user_id": "u1"},
            "messages": [{"role": "user", "content": "hi"}]}"#;
        let req = polygw_dialects::messages::parse_request(body).unwrap();
        let t = polygw_dialects::messages::to_chat(&req).unwrap();
        assert_eq!(
            messages_key(&HeaderMap::new(), &req, &t.request).as_deref(),
            Some("u1")
        );
        let h = headers(&[("x-session-id", "hdr")]);
        assert_eq!(messages_key(&h, &req, &t.request).as_deref(), Some("hdr"));
    }
}
