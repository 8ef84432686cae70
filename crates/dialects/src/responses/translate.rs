//! A Responses request (and the stored conversation it continues) as a core
//! [`ChatRequest`], with the [`ResponsesMeta`] needed to write the answer back.

use std::collections::BTreeMap;

use polygw_core::ChatRequest;
use serde_json::{json, Map, Value};

use super::input::{parse_item, Turn};
use super::request::ResponsesRequest;
use super::tools::{chat_choice, Choice, ToolSet, ToolTarget};
use crate::chat::Conversation;
use crate::error::DialectError;
use crate::json::{at, idx};

/// A Responses request translated: the chat request and what writing its answer needs.
pub type Translated = crate::Translated<ResponsesMeta>;

/// What the answer to a Responses request needs: the fields a `response` object
/// echoes, the tool-name map back to the client's tools, and the input as items (what
/// is stored with the response).
#[derive(Debug, Clone)]
pub struct ResponsesMeta {
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) store: bool,
    pub(crate) previous_response_id: Option<String>,
    pub(crate) input_items: Vec<Value>,
    pub(crate) tools: ToolSet,
    /// The `response` object's echoed fields (instructions, tools, tool_choice, …).
    pub(crate) echo: Map<String, Value>,
}

impl ResponsesMeta {
    /// The model the client asked for.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the client asked for a stream.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// `store`: keep the response and its input.
    pub fn store(&self) -> bool {
        self.store
    }

    /// `previous_response_id`.
    pub fn previous_response_id(&self) -> Option<&str> {
        self.previous_response_id.as_deref()
    }

    /// The request's input as items, `item_reference`s resolved: what is stored with
    /// the response (the next call's history is these items followed by the output).
    pub fn input_items(&self) -> &[Value] {
        &self.input_items
    }

    /// The client's tool a chat function name stands for (`None` for a name the
    /// request did not define: its calls come back as `function_call`s by that name).
    pub fn tool_target(&self, chat_name: &str) -> Option<&ToolTarget> {
        self.tools.target(chat_name)
    }

    /// Hosted tools not sent upstream (those of the request and of the history).
    pub fn unsupported_tools(&self) -> &[String] {
        self.tools.unsupported()
    }
}

/// Translates a Responses request. `history` is the stored conversation of
/// `previous_response_id` as items (its input items, then its output items; empty when
/// none). `instructions` apply to this call only (not carried over from history, as
/// OpenAI documents); tools defined by `additional_tools` items of the history stay
/// defined.
pub fn to_chat(req: &ResponsesRequest, history: &[Value]) -> Result<Translated, DialectError> {
    let mut tools = req.tools.clone();
    let mut history_turns = Vec::with_capacity(history.len());
    for (i, item) in history.iter().enumerate() {
        let p = idx("history", i);
        for t in parse_item(item, &p)? {
            if let Turn::Tools(list) = &t {
                tools.add(list, &at(&p, "tools"), false)?;
            }
            history_turns.push(t);
        }
    }
    let (input_items, input_turns) = resolve_references(req, history)?;
    for (i, t) in input_turns.iter() {
        if let Turn::Tools(list) = t {
            // Tools of a referenced item (the request's own were added at parse time).
            tools.add(list, &at(&idx("input", *i), "tools"), false)?;
        }
    }

    let mut conv = Conversation::default();
    if let Some(ins) = req.instructions.as_deref().filter(|s| !s.is_empty()) {
        conv.system(ins.to_string());
    }
    for t in history_turns
        .iter()
        .chain(input_turns.iter().map(|(_, t)| t))
    {
        lay_out(&mut conv, t, &tools);
    }
    let messages = conv.finish();
    if messages.is_empty() {
        return Err(DialectError::invalid(
            "input",
            "input must hold at least one message (or continue a stored response)",
        ));
    }

    let mut overlay = Map::new();
    let mut chat_tools = tools.chat_tools();
    if let Some(choice) = &req.tool_choice {
        match chat_choice(choice, &tools)? {
            Choice::Value(v) => {
                if !chat_tools.is_empty() {
                    overlay.insert("tool_choice".into(), v);
                }
            }
            Choice::Allowed(names, v) => {
                chat_tools = tools.chat_tools_named(&names);
                if !chat_tools.is_empty() {
                    overlay.insert("tool_choice".into(), v);
                }
            }
        }
    }
    if let Some(p) = req.parallel_tool_calls {
        if !chat_tools.is_empty() {
            overlay.insert("parallel_tool_calls".into(), Value::Bool(p));
        }
    }
    if let Some(t) = req.top_p {
        overlay.insert("top_p".into(), json!(t));
    }
    let request = ChatRequest {
        messages,
        stream: req.stream,
        temperature: req.temperature,
        max_tokens: req.max_output_tokens,
        reasoning_effort: req.reasoning_effort.clone(),
        response_format: req.response_format.clone(),
        tools: (!chat_tools.is_empty()).then_some(chat_tools),
        overlay: (!overlay.is_empty()).then_some(overlay),
        native: None,
        translated: Vec::new(),
        native_only: false,
        client_credential: None,
        wire: None,
    };
    request.validate().map_err(|(field, message)| {
        let field = match field.as_str() {
            "messages" => "input".to_string(),
            "max_tokens" => "max_output_tokens".to_string(),
            _ => field,
        };
        DialectError::invalid(&field, format!("{field}: {message}"))
    })?;
    Ok(crate::Translated {
        request,
        meta: ResponsesMeta {
            model: req.model.clone(),
            stream: req.stream,
            store: req.store,
            previous_response_id: req.previous_response_id.clone(),
            input_items,
            tools,
            echo: echo(req),
        },
    })
}

/// Replaces each `item_reference` by the item it names (from the history, or earlier
/// in the input): the input items to store and the turns to send.
#[allow(clippy::type_complexity)]
fn resolve_references(
    req: &ResponsesRequest,
    history: &[Value],
) -> Result<(Vec<Value>, Vec<(usize, Turn)>), DialectError> {
    if !req
        .turns
        .iter()
        .any(|(_, t)| matches!(t, Turn::Reference(_)))
    {
        return Ok((req.input.clone(), req.turns.clone()));
    }
    let mut by_id: BTreeMap<&str, &Value> = BTreeMap::new();
    for item in history {
        if let Some(id) = item.get("id").and_then(Value::as_str) {
            by_id.entry(id).or_insert(item);
        }
    }
    let mut items = req.input.clone();
    let mut turns = Vec::with_capacity(req.turns.len());
    for (i, t) in &req.turns {
        match t {
            Turn::Reference(id) => {
                let p = idx("input", *i);
                let found = by_id.get(id.as_str()).copied().or_else(|| {
                    req.input[..*i]
                        .iter()
                        .find(|it| it.get("id").and_then(Value::as_str) == Some(id.as_str()))
                });
                let item = found.ok_or_else(|| {
                    DialectError::invalid(
                        at(&p, "id"),
                        format!("{p} references item {id:?}, which is neither in the stored conversation nor earlier in input"),
                    )
                })?;
                let resolved = parse_item(item, &p)?;
                if resolved.iter().any(|r| matches!(r, Turn::Reference(_))) {
                    return Err(DialectError::invalid(
                        at(&p, "id"),
                        format!("{p} references another item_reference"),
                    ));
                }
                items[*i] = item.clone();
                turns.extend(resolved.into_iter().map(|r| (*i, r)));
            }
            other => turns.push((*i, other.clone())),
        }
    }
    Ok((items, turns))
}

fn lay_out(conv: &mut Conversation, t: &Turn, tools: &ToolSet) {
    match t {
        Turn::System(text) => conv.system(text.clone()),
        Turn::User(parts) => conv.user(parts.clone()),
        Turn::Assistant(parts) => conv.assistant_parts(parts.clone()),
        Turn::Call {
            kind,
            call_id,
            name,
            namespace,
            arguments,
        } => {
            let chat = tools.call_name(*kind, namespace.as_deref(), name);
            conv.assistant_call(call_id, &chat, arguments);
        }
        Turn::Output {
            call_id,
            text,
            images,
        } => conv.tool_result(call_id, text.clone(), images.clone()),
        Turn::Tools(_) | Turn::Reference(_) => {}
    }
}

/// The fields a `response` object echoes, OpenAI's defaults where the request left
/// them out.
fn echo(req: &ResponsesRequest) -> Map<String, Value> {
    let opt_str = |v: &Option<String>| v.clone().map(Value::String).unwrap_or(Value::Null);
    let mut e = Map::new();
    e.insert("instructions".into(), opt_str(&req.instructions));
    e.insert("tools".into(), Value::Array(req.tools_raw.clone()));
    e.insert(
        "tool_choice".into(),
        req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
    );
    e.insert(
        "temperature".into(),
        req.temperature.map_or(Value::Null, |t| json!(t)),
    );
    e.insert("top_p".into(), req.top_p.map_or(Value::Null, |t| json!(t)));
    e.insert(
        "max_output_tokens".into(),
        req.max_output_tokens.map_or(Value::Null, Value::from),
    );
    e.insert(
        "max_tool_calls".into(),
        req.max_tool_calls.map_or(Value::Null, Value::from),
    );
    e.insert(
        "top_logprobs".into(),
        Value::from(req.top_logprobs.unwrap_or(0)),
    );
    e.insert(
        "text".into(),
        req.text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
    );
    e.insert(
        "reasoning".into(),
        req.reasoning
            .clone()
            .unwrap_or_else(|| json!({"effort": null, "summary": null})),
    );
    e.insert(
        "metadata".into(),
        req.metadata.clone().unwrap_or_else(|| json!({})),
    );
    e.insert(
        "parallel_tool_calls".into(),
        Value::Bool(req.parallel_tool_calls.unwrap_or(true)),
    );
    e.insert(
        "previous_response_id".into(),
        opt_str(&req.previous_response_id),
    );
    e.insert("store".into(), Value::Bool(req.store));
    e.insert("background".into(), Value::Bool(false));
    e.insert(
        "truncation".into(),
        Value::String(req.truncation.clone().unwrap_or_else(|| "disabled".into())),
    );
    e.insert("user".into(), opt_str(&req.user));
    e.insert("prompt_cache_key".into(), opt_str(&req.prompt_cache_key));
    e.insert(
        "prompt_cache_retention".into(),
        opt_str(&req.prompt_cache_retention),
    );
    e.insert("safety_identifier".into(), opt_str(&req.safety_identifier));
    let tier = match req.service_tier.as_deref() {
        None | Some("auto") => "default".to_string(),
        Some(t) => t.to_string(),
    };
    e.insert("service_tier".into(), Value::String(tier));
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::parse_request;

    fn tr(body: Value, history: &[Value]) -> Result<Translated, DialectError> {
        to_chat(&parse_request(body.to_string().as_bytes())?, history)
    }

    fn messages(t: &Translated) -> Value {
        serde_json::to_value(&t.request.messages).unwrap()
    }

    #[test]
    fn instructions_and_items_become_chat_messages() {
        let t = tr(
            json!({"model": "m", "instructions": "be brief", "input": [
                {"type": "message", "role": "developer", "id": "d1", "content": [{"type": "input_text", "text": "rules"}]},
                {"role": "user", "content": "list files"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": null},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
                {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "b"}]}
            ], "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
               "parallel_tool_calls": false, "top_p": 0.5, "max_output_tokens": 100}),
            &[],
        )
        .unwrap();
        assert_eq!(
            messages(&t),
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "system", "content": "rules"},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "Sure.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"ls\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
                {"role": "tool", "tool_call_id": "c2", "content": "b"}
            ])
        );
        assert_eq!(t.request.max_tokens, Some(100));
        let o = t.request.overlay.as_ref().unwrap();
        assert_eq!(o["parallel_tool_calls"], json!(false));
        assert_eq!(o["top_p"], json!(0.5));
    }

    #[test]
    fn history_comes_first_and_instructions_are_not_carried_over() {
        let history = [
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q1"}]}),
            json!({"type": "message", "id": "msg_a_0", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "a1", "annotations": [], "logprobs": []}]}),
        ];
        let t = tr(
            json!({"model": "m", "previous_response_id": "resp_a", "input": "q2"}),
            &history,
        )
        .unwrap();
        assert_eq!(
            messages(&t),
            json!([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}])
        );
        assert_eq!(t.meta.input_items().len(), 1);
        assert_eq!(t.meta.previous_response_id(), Some("resp_a"));
        // An item reference resolves from the history.
        let t = tr(
            json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_a_0"}, {"role": "user", "content": "again"}]}),
            &history,
        )
        .unwrap();
        assert_eq!(t.meta.input_items()[0]["id"], "msg_a_0");
        let e = tr(
            json!({"model": "m", "input": [{"type": "item_reference", "id": "nope"}]}),
            &history,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].id"));
    }

    #[test]
    fn hosted_tools_are_not_sent_and_namespace_calls_map() {
        let t = tr(
            json!({"model": "m", "input": [
                {"type": "function_call", "call_id": "c1", "name": "create_issue", "namespace": "mcp__gh", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
              "tools": [{"type": "web_search"}, {"type": "namespace", "name": "mcp__gh", "description": "", "tools": [{"type": "function", "name": "create_issue"}]}],
              "tool_choice": "auto"}),
            &[],
        )
        .unwrap();
        assert_eq!(t.meta.unsupported_tools(), ["web_search"]);
        let tools = t.request.tools.as_ref().unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0]["function"]["name"], "mcp__gh__create_issue");
        assert_eq!(
            messages(&t)[0]["tool_calls"][0]["function"]["name"],
            "mcp__gh__create_issue"
        );
        let target = t.meta.tool_target("mcp__gh__create_issue").unwrap();
        assert_eq!(target.namespace.as_deref(), Some("mcp__gh"));
        // No tools sent: no tool_choice either (chat sources refuse one alone).
        let t = tr(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"}), &[]).unwrap();
        assert!(t.request.tools.is_none());
        assert!(t.request.overlay.is_none());
        let e = tr(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}), &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn an_empty_conversation_is_refused() {
        let e = tr(json!({"model": "m"}), &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
    }
}
