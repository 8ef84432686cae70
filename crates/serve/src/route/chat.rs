//! `POST /v1/chat/completions` (SPEC §11, §15, §17): the OpenAI chat-completions API,
//! the dialect polygw's sources speak — so plain answers and stream frames are the
//! upstream's own, passed through with the few edits a gateway must make.
//!
//! Stream frames: `id` and `created` are the first delivered frame's for the whole
//! stream (a resumed stream stays one stream), a frame without a `model` gets the
//! committed source's, and usage is sent once, at the end, when the client asked for it
//! (`include_usage`): the upstream's own usage object when one leg delivered the answer,
//! else the sum over the legs, marked `"polygw": {"usage_source": …}` when not
//! measured, `null` when unknown; the final usage chunk carries the stream's
//! `system_fingerprint` and `service_tier`. Frames carry `"usage": null` where the
//! upstream sent usage mid-stream.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use polygw::{CallOptions, Commit, LlmResponse, StreamDelta, UsageSource};
use serde_json::{json, Map, Value};

use crate::errors::{error_response, ApiError};
use crate::http::{
    answer_headers, call_options, chat_scope, close_after, ensure_request_id, enter_gate,
    failure_headers, read_body, run_plain, set_request_id, unix_now, Conn, Stopped,
};
use crate::openai::{chunk_json, completion_json, parse_chat, usage_json};
use crate::state::State as AppState;
use crate::stream::{respond, Encoder};
use polygw::core::client_key::ClientKey;

/// Frame-level keys every chunk has; anything else is information for the client.
const ENVELOPE: [&str; 9] = [
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "service_tier",
    "obfuscation",
    "choices",
    "usage",
];

/// `POST /v1/chat/completions`.
pub async fn handle(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    key: Option<Extension<Arc<ClientKey>>>,
    proxy: Option<Extension<crate::guard::ProxyCredential>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let proxy = proxy.map(|Extension(p)| p);
    let key = key.map(|Extension(k)| k);
    let id = CallOptions::new_logical_call_id();
    let mut resp = inner(&st, &ctx, key.as_ref(), proxy, &headers, body, &id).await;
    ensure_request_id(resp.headers_mut(), &id);
    resp
}

async fn inner(
    st: &Arc<AppState>,
    ctx: &Option<Arc<crate::conn::ConnCtx>>,
    key: Option<&Arc<ClientKey>>,
    proxy: Option<crate::guard::ProxyCredential>,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Response {
    let early = |e: crate::http::Early| {
        let mut r = error_response(&e.error);
        if e.close {
            close_after(ctx, r.headers_mut());
        }
        r
    };
    let bytes = match read_body(st, headers, body, ctx).await {
        Ok(b) => b,
        Err(e) => return early(e),
    };
    // Read once; the body is kept as received for the byte path (SPEC §27.1).
    let parsed = match parse_chat(bytes) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    let scopes = st.scopes();
    let (served, client) = match chat_scope(&scopes, &parsed.model) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let mut parsed = parsed;
    parsed.request.client_credential = crate::http::credential_for(client, headers, proxy);
    // The scope's `messages` and `responses` sources get the request in their API.
    let untranslated = crate::http::translate_for_sources(
        client,
        &mut parsed.request,
        polygw::core::source::SourceApi::Chat,
    );
    // The client key's scopes, models, limits and budgets (SPEC §21.1), before a slot.
    let charge = match crate::keys::admit(key, &served.scope.name, &parsed.model, async |k| {
        client.admit_key(k, &parsed.request).await
    })
    .await
    {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    let slot = match enter_gate(st, served, ctx).await {
        Ok(s) => s,
        Err(e) => return early(e),
    };
    let mut options = call_options(st, id, headers);
    if let Some(c) = charge {
        options = options.with_client_key(c);
    }
    options.api = Some("chat");
    options.model = Some(parsed.model.clone());
    options.affinity_key = crate::affinity::chat_key(headers, &parsed.request);
    options.attribution =
        crate::attribution::of(headers, crate::attribution::chat_cache_key(&parsed.request));
    let mut resp = if parsed.request.stream {
        let enc = ChatEncoder::new(id, parsed.include_usage);
        respond(
            st.clone(),
            client.clone(),
            parsed.request,
            options,
            slot,
            ctx.clone(),
            enc,
            error_response,
        )
        .await
    } else {
        plain(st, ctx, client, parsed.request, options, slot, id).await
    };
    crate::http::list_header(
        resp.headers_mut(),
        crate::names::X_UNTRANSLATED,
        &untranslated,
    );
    resp
}

/// A plain chat call's answer.
async fn plain(
    st: &Arc<AppState>,
    ctx: &Option<Arc<crate::conn::ConnCtx>>,
    client: &polygw::GatewayClient,
    request: polygw::ChatRequest,
    options: CallOptions,
    slot: crate::scope::Slot,
    id: &str,
) -> Response {
    match run_plain(st, ctx, client, request, options, slot).await {
        Ok(mut r) => {
            // A `messages` or `responses` source's answer is written from what was
            // read of it (SPEC §23.3).
            crate::http::drop_foreign_body(client, &mut r, polygw::core::source::SourceApi::Chat);
            let mut resp = match passthrough_body(&mut r) {
                Some(body) => (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        axum::http::HeaderValue::from_static("application/json"),
                    )],
                    body,
                )
                    .into_response(),
                None => Json(completion_json(&mut r, unix_now())).into_response(),
            };
            answer_headers(resp.headers_mut(), &r);
            resp
        }
        Err(Stopped::Failed(e)) => {
            let api = crate::errors::from_gateway(&e);
            log_failure(&api, &e);
            let mut resp = error_response(&api);
            failure_headers(resp.headers_mut(), &e, id);
            resp
        }
        Err(s) => {
            let mut resp = error_response(&s.error());
            set_request_id(resp.headers_mut(), id);
            resp
        }
    }
}

/// The upstream's plain answer as the bytes it sent, when the client gets it
/// unchanged: its usage is measured and its own (an object in the body) — what
/// [`completion_json`] would otherwise parse-serialize back into the same fields. Taken
/// out of `r` (with the parsed object, not needed then). Issue 27.
fn passthrough_body(r: &mut LlmResponse) -> Option<Vec<u8>> {
    if r.usage_source != UsageSource::Measured {
        return None;
    }
    let own_usage = match &r.upstream {
        Some(o) => o.get("usage").is_some_and(Value::is_object),
        // The transport read it typed and found it (else look).
        None => r.upstream_usage_object || has_usage_object(r.upstream_body.as_deref()?),
    };
    if !own_usage {
        return None;
    }
    let body = r.upstream_body.take()?;
    r.upstream = None;
    Some(body)
}

/// Whether a JSON object's top-level `usage` is an object, read without building any
/// of it (a body that is not an object, or names `usage` twice: `false`).
fn has_usage_object(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        usage: Option<&'a serde_json::value::RawValue>,
    }
    // A derived struct would also read a JSON array (as its fields in order).
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    is_object
        && serde_json::from_slice::<Probe<'_>>(body)
            .is_ok_and(|p| p.usage.is_some_and(|u| u.get().starts_with('{')))
}

/// A failed call's log line (server-side errors and rate limits only).
pub fn log_failure(api: &ApiError, e: &polygw::GatewayError) {
    if api.status.is_server_error() || api.status.as_u16() == 429 {
        tracing::warn!(status = api.status.as_u16(), error = %e, "call failed");
    }
}

/// The chat-completions stream (see the module documentation).
pub(crate) struct ChatEncoder {
    /// The committed leg.
    commit: Option<Commit>,
    /// `id` and `created` of the stream: the first delivered frame's.
    id: Option<String>,
    created: Option<Value>,
    /// The stream's `model`: the first delivered frame's (SPEC §25.5: a resumed
    /// stream keeps one model in every frame; the leg that finished it is in the
    /// trace, the telemetry and `x-polygw-*`).
    model: Option<String>,
    /// The stream's `system_fingerprint` and `service_tier`, as the upstream sent them.
    fingerprint: Option<Value>,
    service_tier: Option<Value>,
    logical_call_id: String,
    include_usage: bool,
    /// The last usage object an upstream sent, as sent.
    upstream_usage: Option<Value>,
    /// Legs whose chunks reached the client.
    legs: u32,
    /// Chunks written.
    chunks: u64,
}

impl ChatEncoder {
    pub(crate) fn new(logical_call_id: &str, include_usage: bool) -> Self {
        ChatEncoder {
            commit: None,
            id: None,
            created: None,
            model: None,
            fingerprint: None,
            service_tier: None,
            logical_call_id: logical_call_id.to_string(),
            include_usage,
            upstream_usage: None,
            legs: 0,
            chunks: 0,
        }
    }

    fn id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("chatcmpl-{}", self.logical_call_id))
    }

    fn created(&self) -> Value {
        self.created.clone().unwrap_or_else(|| json!(unix_now()))
    }

    fn model(&self) -> String {
        self.model.clone().unwrap_or_else(|| {
            self.commit
                .as_ref()
                .map(|c| c.model.clone())
                .unwrap_or_default()
        })
    }

    /// The upstream's frame text when it can go to the client exactly as received:
    /// kept as text by the transport (no usage, no error, one line), after the frame
    /// that named the stream, with the stream's id and created, an `object`, a model
    /// and choices — everything [`ChatEncoder::chunk`] would otherwise set or check.
    fn verbatim<'d>(&self, d: &'d StreamDelta) -> Option<&'d str> {
        let t = d.raw_text.as_ref().filter(|_| d.raw.is_none())?;
        let id = self.id.as_deref()?;
        let created = self.created.as_ref().and_then(Value::as_u64);
        let same = t.id.as_deref() == Some(id)
            && t.created.is_some()
            && t.created == created
            && t.has_object
            && t.choices > 0
            && d.model.is_some()
            && d.model == self.model;
        same.then_some(t.json.as_str())
    }

    /// One upstream chunk as the client sees it, or `None` when nothing is left to send
    /// (a frame that carried only usage).
    fn chunk(&mut self, mut d: StreamDelta) -> Option<Value> {
        let raw = match d.raw.take() {
            Some(o) => Some(o),
            None => d.raw_object().map(std::borrow::Cow::into_owned),
        };
        let mut obj: Map<String, Value> = match raw {
            Some(o) => o,
            None => match chunk_json(&self.id(), &self.model(), 0, &d) {
                Some(Value::Object(o)) => o,
                _ => return None,
            },
        };
        // Usage goes out once, at the end: a frame keeps its `usage` key, as null.
        if let Some(u) = obj.get_mut("usage").filter(|u| u.is_object()) {
            self.upstream_usage = Some(u.take());
        }
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
            for c in choices.iter_mut() {
                if let Some(u) = c.get_mut("usage").filter(|u| u.is_object()) {
                    self.upstream_usage = Some(u.take());
                }
            }
        }
        for (key, slot) in [
            ("system_fingerprint", &mut self.fingerprint),
            ("service_tier", &mut self.service_tier),
        ] {
            if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                *slot = Some(v.clone());
            }
        }
        let has_choices = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        let extras = obj
            .iter()
            .any(|(k, v)| !ENVELOPE.contains(&k.as_str()) && !v.is_null());
        if !has_choices && !extras {
            return None;
        }
        if self.id.is_none() {
            // The first delivered frame names the stream.
            self.id = Some(
                obj.get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("chatcmpl-{}", self.logical_call_id)),
            );
            self.created = Some(
                obj.get("created")
                    .filter(|c| c.as_u64().is_some_and(|t| t > 0))
                    .cloned()
                    .unwrap_or_else(|| json!(unix_now())),
            );
            self.model = obj
                .get("model")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string);
        }
        // Every frame carries the stream's id and created (a resumed stream's later
        // legs have their own); most already do, and are left as they are.
        if obj.get("id").and_then(Value::as_str) != self.id.as_deref() {
            obj.insert("id".into(), json!(self.id()));
        }
        if obj.get("created") != self.created.as_ref() {
            obj.insert("created".into(), self.created());
        }
        obj.entry("object")
            .or_insert_with(|| json!("chat.completion.chunk"));
        // The stream's model in every frame (a later leg's own is replaced); a frame
        // without one gets it too.
        let model = self.model();
        let named = obj
            .get("model")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        if named.is_none() || (named != Some(model.as_str()) && !model.is_empty()) {
            obj.insert("model".into(), json!(model));
        }
        Some(Value::Object(obj))
    }

    /// The final usage chunk (SPEC §15: measured as reported, an estimate marked,
    /// unknown as null), with the stream's fingerprint and tier (issue 22, item 18).
    fn usage_chunk(&self, r: &LlmResponse) -> Value {
        let usage = match r.usage_source {
            UsageSource::Unavailable => Value::Null,
            UsageSource::Measured if self.legs <= 1 && self.upstream_usage.is_some() => {
                self.upstream_usage.clone().unwrap_or(Value::Null)
            }
            _ => usage_json(&r.usage),
        };
        let mut c = json!({
            "id": self.id(),
            "object": "chat.completion.chunk",
            "created": self.created(),
            "model": self.model.clone().unwrap_or_else(|| r.model.clone()),
            "choices": [],
            "usage": usage,
        });
        if let Some(f) = &self.fingerprint {
            c["system_fingerprint"] = f.clone();
        }
        if let Some(t) = &self.service_tier {
            c["service_tier"] = t.clone();
        }
        if r.usage_source != UsageSource::Measured {
            c["polygw"] = json!({"usage_source": r.usage_source.as_str()});
        }
        c
    }
}

fn sse(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}

/// An answer that was never streamed, as chunks (role and text, then finish).
fn whole_answer_chunks(r: &LlmResponse, id: &str) -> Vec<Value> {
    let created = unix_now();
    let d = StreamDelta {
        role: Some("assistant".into()),
        content: (!r.content.is_empty() || r.tool_calls.is_empty()).then(|| r.content.clone()),
        reasoning: r.reasoning_content.clone(),
        tool_calls: r
            .tool_calls
            .iter()
            .map(|t| polygw::ToolCallDelta {
                index: t.index,
                id: t.id.clone(),
                name: t.name.clone(),
                arguments: t.arguments.clone(),
            })
            .collect(),
        finish_reason: r.finish_reason.clone(),
        ..Default::default()
    };
    chunk_json(id, &r.model, created, &d).into_iter().collect()
}

impl Encoder for ChatEncoder {
    fn open(&mut self, _out: &mut Vec<u8>) {}

    fn committed(&mut self, c: &Commit) {
        self.legs += 1;
        self.commit = Some(c.clone());
    }

    fn delta(&mut self, d: StreamDelta, out: &mut Vec<u8>) {
        if let Some(text) = self.verbatim(&d) {
            self.chunks += 1;
            // One allocation of the exact size (a grown buffer costs three, and its
            // spare capacity one more when it becomes `Bytes`).
            out.reserve(text.len() + 8);
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(text.as_bytes());
            out.extend_from_slice(b"\n\n");
        } else if let Some(v) = self.chunk(d) {
            self.chunks += 1;
            sse(out, &v);
        }
    }

    fn done(&mut self, r: &LlmResponse, out: &mut Vec<u8>) {
        if self.chunks == 0 {
            // Nothing was streamed (an answer from the cache): the whole answer as one
            // chunk.
            for c in whole_answer_chunks(r, &self.id()) {
                sse(out, &c);
            }
        }
        if self.include_usage {
            let u = self.usage_chunk(r);
            sse(out, &u);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    fn fail(&mut self, e: &ApiError, out: &mut Vec<u8>) {
        sse(out, &e.body());
    }
}

#[cfg(test)]
mod tests {
    use super::has_usage_object;

    #[test]
    fn the_usage_probe_sees_a_top_level_usage_object_only() {
        for (body, want) in [
            (
                r#"{"usage": {"prompt_tokens": 1}, "choices": [{"usage": 2}]}"#,
                true,
            ),
            (r#"{"choices": [{"usage": {"prompt_tokens": 1}}]}"#, false),
            (r#"{"usage": null}"#, false),
            (r#"{"usage": 3}"#, false),
            (r#"{"usage": [{}]}"#, false),
            (r#"{"usage": {}, "usage": {}}"#, false),
            (r#"[{"usage": {}}]"#, false),
            ("not json", false),
        ] {
            assert_eq!(has_usage_object(body.as_bytes()), want, "{body}");
        }
    }
}
