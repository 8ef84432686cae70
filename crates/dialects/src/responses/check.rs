//! [`check_stream`]: a conformance check of a whole Responses event sequence (order,
//! indices, sequence numbers, every item opened before its deltas and closed, one
//! terminal event, deltas equal to the final texts), returning what a client ends with.

use serde_json::Value;

use crate::sse::SseEvent;

/// What a client ends with after a valid Responses stream.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesFinal {
    /// The response id.
    pub id: String,
    /// `completed`, `incomplete` or `failed`.
    pub status: String,
    /// The answer text: every `output_text` of the message items, concatenated.
    pub text: String,
    /// The reasoning summary text, concatenated.
    pub reasoning: String,
    /// The tool calls, in output order.
    pub tool_calls: Vec<FinalCall>,
    /// The final response's `usage` (`null` when unknown).
    pub usage: Value,
    /// `(code, message)` of a failed response.
    pub error: Option<(String, String)>,
    /// The response object the terminal event carried.
    pub response: Value,
}

/// One tool call of a finished Responses stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalCall {
    /// The item type (`function_call`, `custom_tool_call`, `local_shell_call`, …).
    pub kind: String,
    /// The tool's name (for built-in items, the item type without `_call`).
    pub name: String,
    /// Its namespace, when one.
    pub namespace: Option<String>,
    /// `call_id`.
    pub call_id: String,
    /// The arguments: a function call's JSON text, a custom call's input, a built-in
    /// call's action / operation / arguments as compact JSON.
    pub arguments: String,
}

#[derive(Debug)]
struct Part {
    text: String,
    text_done: bool,
    open: bool,
}

#[derive(Debug)]
struct Item {
    id: String,
    ty: String,
    call_id: Option<String>,
    open: bool,
    parts: Vec<Part>,
    summary: Vec<Part>,
    arguments: String,
    arguments_done: bool,
    input: String,
    input_done: bool,
    done: Option<Value>,
}

fn s<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn u(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// Validates a whole Responses event sequence and returns the final answer. Checks:
/// every event named after its `type`, `sequence_number` 0, 1, 2, …; `response.created`
/// first; one response id; items added at the next output index, one open at a time,
/// their parts and summary parts opened in order, deltas only into open parts, `.done`
/// texts and `output_item.done` items equal to the concatenated deltas; exactly one
/// terminal event (`response.completed` / `response.incomplete` with every item done
/// and `output` equal to the done items, or `response.failed`, which an `error` event
/// may precede), and nothing after it.
pub fn check_stream(events: &[SseEvent]) -> Result<ResponsesFinal, String> {
    let mut items: Vec<Item> = Vec::new();
    let mut id: Option<String> = None;
    let mut terminal: Option<(usize, Value)> = None;
    let mut saw_in_progress = false;
    for (n, e) in events.iter().enumerate() {
        let at = |m: String| format!("event {n} ({}): {m}", e.event);
        if let Some((t, _)) = &terminal {
            return Err(at(format!("after the terminal event {t}")));
        }
        let d = &e.data;
        let ty = s(d, "type").ok_or_else(|| at("data has no type".into()))?;
        if e.event != ty {
            return Err(at(format!(
                "the event line says {:?} but the type is {ty:?}",
                e.event
            )));
        }
        if u(d, "sequence_number") != Some(n as u64) {
            return Err(at(format!(
                "sequence_number is {:?}, expected {n}",
                d.get("sequence_number")
            )));
        }
        if n == 0 && ty != "response.created" {
            return Err(at("the first event must be response.created".into()));
        }
        let lifecycle = matches!(
            ty,
            "response.created"
                | "response.in_progress"
                | "response.completed"
                | "response.incomplete"
                | "response.failed"
        );
        if lifecycle {
            let r = d.get("response").ok_or_else(|| at("no response".into()))?;
            let rid = s(r, "id").ok_or_else(|| at("response has no id".into()))?;
            match &id {
                None => id = Some(rid.to_string()),
                Some(i) if i != rid => return Err(at(format!("response id {rid} is not {i}"))),
                Some(_) => {}
            }
            if s(r, "object") != Some("response") {
                return Err(at("response.object is not \"response\"".into()));
            }
        }
        let open_item = |items: &mut Vec<Item>, want: &str| -> Result<usize, String> {
            let oi = u(d, "output_index").ok_or_else(|| at("no output_index".into()))? as usize;
            let item = items
                .get(oi)
                .ok_or_else(|| at(format!("output_index {oi} was never added")))?;
            if !item.open {
                return Err(at(format!("item {oi} is already done")));
            }
            if !want.is_empty() && item.ty != want {
                return Err(at(format!("item {oi} is a {}, not a {want}", item.ty)));
            }
            if ty != "response.output_item.done" && s(d, "item_id") != Some(item.id.as_str()) {
                return Err(at(format!(
                    "item_id {:?} is not {}",
                    s(d, "item_id"),
                    item.id
                )));
            }
            Ok(oi)
        };
        match ty {
            "response.created" => {
                if n != 0 {
                    return Err(at("response.created again".into()));
                }
                check_lifecycle(d, "in_progress").map_err(at)?;
            }
            "response.in_progress" => {
                if saw_in_progress {
                    return Err(at("response.in_progress again".into()));
                }
                saw_in_progress = true;
                check_lifecycle(d, "in_progress").map_err(at)?;
            }
            "response.output_item.added" => {
                let oi = u(d, "output_index").ok_or_else(|| at("no output_index".into()))? as usize;
                if oi != items.len() {
                    return Err(at(format!("output_index {oi}, expected {}", items.len())));
                }
                if let Some(open) = items.iter().position(|i| i.open) {
                    return Err(at(format!("item {open} is still open")));
                }
                let item = d.get("item").ok_or_else(|| at("no item".into()))?;
                let ity = s(item, "type").ok_or_else(|| at("item has no type".into()))?;
                let iid = s(item, "id")
                    .filter(|i| !i.is_empty())
                    .ok_or_else(|| at("item has no id".into()))?;
                if items.iter().any(|i| i.id == iid) {
                    return Err(at(format!("item id {iid} is used twice")));
                }
                items.push(Item {
                    id: iid.to_string(),
                    ty: ity.to_string(),
                    call_id: s(item, "call_id").map(str::to_string),
                    open: true,
                    parts: Vec::new(),
                    summary: Vec::new(),
                    arguments: String::new(),
                    arguments_done: false,
                    input: String::new(),
                    input_done: false,
                    done: None,
                });
            }
            "response.content_part.added" | "response.reasoning_summary_part.added" => {
                let summary = ty == "response.reasoning_summary_part.added";
                let oi = open_item(&mut items, if summary { "reasoning" } else { "message" })?;
                let (key, list) = if summary {
                    ("summary_index", &mut items[oi].summary)
                } else {
                    ("content_index", &mut items[oi].parts)
                };
                if u(d, key) != Some(list.len() as u64) {
                    return Err(at(format!(
                        "{key} {:?}, expected {}",
                        d.get(key),
                        list.len()
                    )));
                }
                if list.iter().any(|p| p.open) {
                    return Err(at("a part is still open".into()));
                }
                if d.get("part").and_then(|p| s(p, "text")) != Some("") {
                    return Err(at("an added part must be empty".into()));
                }
                list.push(Part {
                    text: String::new(),
                    text_done: false,
                    open: true,
                });
            }
            "response.output_text.delta"
            | "response.output_text.done"
            | "response.content_part.done"
            | "response.reasoning_summary_text.delta"
            | "response.reasoning_summary_text.done"
            | "response.reasoning_summary_part.done" => {
                let summary = ty.starts_with("response.reasoning");
                let oi = open_item(&mut items, if summary { "reasoning" } else { "message" })?;
                let key = if summary {
                    "summary_index"
                } else {
                    "content_index"
                };
                let pi = u(d, key).ok_or_else(|| at(format!("no {key}")))? as usize;
                let list = if summary {
                    &mut items[oi].summary
                } else {
                    &mut items[oi].parts
                };
                let part = list
                    .get_mut(pi)
                    .filter(|p| p.open)
                    .ok_or_else(|| at(format!("part {pi} is not open")))?;
                if ty.ends_with(".delta") {
                    if part.text_done {
                        return Err(at("a delta after the text was done".into()));
                    }
                    part.text
                        .push_str(s(d, "delta").ok_or_else(|| at("no delta".into()))?);
                } else if ty.ends_with("text.done") {
                    if s(d, "text") != Some(part.text.as_str()) {
                        return Err(at(format!(
                            "text {:?} is not the deltas {:?}",
                            s(d, "text"),
                            part.text
                        )));
                    }
                    part.text_done = true;
                } else {
                    if !part.text_done {
                        return Err(at("the part is done before its text".into()));
                    }
                    if d.get("part").and_then(|p| s(p, "text")) != Some(part.text.as_str()) {
                        return Err(at("the done part's text is not the deltas".into()));
                    }
                    part.open = false;
                }
            }
            "response.function_call_arguments.delta" | "response.function_call_arguments.done" => {
                let oi = open_item(&mut items, "function_call")?;
                let item = &mut items[oi];
                if item.arguments_done {
                    return Err(at("arguments after arguments.done".into()));
                }
                if ty.ends_with(".delta") {
                    item.arguments
                        .push_str(s(d, "delta").ok_or_else(|| at("no delta".into()))?);
                } else {
                    if s(d, "arguments") != Some(item.arguments.as_str()) {
                        return Err(at("arguments are not the deltas".into()));
                    }
                    item.arguments_done = true;
                }
            }
            "response.custom_tool_call_input.delta" | "response.custom_tool_call_input.done" => {
                let oi = open_item(&mut items, "custom_tool_call")?;
                let item = &mut items[oi];
                if item.input_done {
                    return Err(at("input after input.done".into()));
                }
                if ty.ends_with(".delta") {
                    item.input
                        .push_str(s(d, "delta").ok_or_else(|| at("no delta".into()))?);
                } else {
                    if s(d, "input") != Some(item.input.as_str()) {
                        return Err(at("input is not the deltas".into()));
                    }
                    item.input_done = true;
                }
            }
            "response.output_item.done" => {
                let oi = open_item(&mut items, "")?;
                let done = d.get("item").ok_or_else(|| at("no item".into()))?;
                check_done(&items[oi], done).map_err(at)?;
                items[oi].open = false;
                items[oi].done = Some(done.clone());
            }
            "error" => {
                let next = events.get(n + 1).map(|e| e.event.as_str());
                if next != Some("response.failed") {
                    return Err(at(
                        "an error event must be followed by response.failed".into()
                    ));
                }
                if s(d, "message").is_none() {
                    return Err(at("an error event needs a message".into()));
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                let r = &d["response"];
                let want = &ty["response.".len()..];
                if s(r, "status") != Some(want) {
                    return Err(at(format!("response.status is {:?}", s(r, "status"))));
                }
                if ty != "response.failed" {
                    if let Some(open) = items.iter().position(|i| i.open) {
                        return Err(at(format!("item {open} was never done")));
                    }
                    let output = r
                        .get("output")
                        .and_then(Value::as_array)
                        .ok_or_else(|| at("no output".into()))?;
                    let done: Vec<&Value> = items.iter().filter_map(|i| i.done.as_ref()).collect();
                    if output.iter().collect::<Vec<_>>() != done {
                        return Err(at("response.output is not the done items".into()));
                    }
                } else if r.get("error").and_then(|e| s(e, "message")).is_none() {
                    return Err(at("a failed response needs error.message".into()));
                }
                terminal = Some((n, r.clone()));
            }
            other => return Err(at(format!("unexpected event type {other:?}"))),
        }
    }
    let (_, response) = terminal.ok_or("the stream has no terminal event")?;
    let status = s(&response, "status").unwrap_or_default().to_string();
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut tool_calls = Vec::new();
    for item in &items {
        match item.ty.as_str() {
            "message" => item.parts.iter().for_each(|p| text.push_str(&p.text)),
            "reasoning" => item
                .summary
                .iter()
                .for_each(|p| reasoning.push_str(&p.text)),
            _ => {
                if let Some(done) = &item.done {
                    tool_calls.push(final_call(done));
                }
            }
        }
    }
    let error = response.get("error").filter(|e| !e.is_null()).map(|e| {
        (
            s(e, "code").unwrap_or_default().to_string(),
            s(e, "message").unwrap_or_default().to_string(),
        )
    });
    Ok(ResponsesFinal {
        id: id.unwrap_or_default(),
        status,
        text,
        reasoning,
        tool_calls,
        usage: response.get("usage").cloned().unwrap_or(Value::Null),
        error,
        response,
    })
}

fn check_lifecycle(d: &Value, status: &str) -> Result<(), String> {
    let r = &d["response"];
    if s(r, "status") != Some(status) {
        return Err(format!(
            "response.status is {:?}, expected {status}",
            s(r, "status")
        ));
    }
    if r.get("output")
        .and_then(Value::as_array)
        .is_none_or(|o| !o.is_empty())
    {
        return Err("the output of a starting response must be []".into());
    }
    Ok(())
}

fn check_done(item: &Item, done: &Value) -> Result<(), String> {
    if s(done, "id") != Some(item.id.as_str()) || s(done, "type") != Some(item.ty.as_str()) {
        return Err(format!(
            "the done item is not item {} ({})",
            item.id, item.ty
        ));
    }
    if s(done, "call_id").map(str::to_string) != item.call_id && item.call_id.is_some() {
        return Err("the done item's call_id changed".into());
    }
    if item.parts.iter().chain(&item.summary).any(|p| p.open) {
        return Err("a part is still open".into());
    }
    match item.ty.as_str() {
        "message" => {
            let texts: Vec<&str> = done["content"]
                .as_array()
                .map(|c| c.iter().filter_map(|p| s(p, "text")).collect())
                .unwrap_or_default();
            let streamed: Vec<&str> = item.parts.iter().map(|p| p.text.as_str()).collect();
            if texts != streamed {
                return Err(format!(
                    "the message's content {texts:?} is not the deltas {streamed:?}"
                ));
            }
        }
        "reasoning" => {
            let texts: Vec<&str> = done["summary"]
                .as_array()
                .map(|c| c.iter().filter_map(|p| s(p, "text")).collect())
                .unwrap_or_default();
            let streamed: Vec<&str> = item.summary.iter().map(|p| p.text.as_str()).collect();
            if texts != streamed {
                return Err("the reasoning summary is not the deltas".into());
            }
        }
        "function_call" => {
            if (!item.arguments.is_empty() || item.arguments_done)
                && s(done, "arguments") != Some(item.arguments.as_str())
            {
                return Err("the call's arguments are not the deltas".into());
            }
            if !item.arguments.is_empty() && !item.arguments_done {
                return Err("arguments were streamed without arguments.done".into());
            }
            if s(done, "arguments").is_none() || s(done, "name").is_none() {
                return Err("a function_call needs name and arguments".into());
            }
        }
        "custom_tool_call" if !item.input_done || s(done, "input") != Some(item.input.as_str()) => {
            return Err("the custom call's input is not the streamed input".into());
        }
        _ => {}
    }
    Ok(())
}

fn final_call(done: &Value) -> FinalCall {
    let kind = s(done, "type").unwrap_or_default().to_string();
    let payload = |k: &str| done.get(k).map(Value::to_string).unwrap_or_default();
    let (name, arguments) = match kind.as_str() {
        "function_call" => (
            s(done, "name").unwrap_or_default().to_string(),
            s(done, "arguments").unwrap_or_default().to_string(),
        ),
        "custom_tool_call" => (
            s(done, "name").unwrap_or_default().to_string(),
            s(done, "input").unwrap_or_default().to_string(),
        ),
        "apply_patch_call" => ("apply_patch".to_string(), payload("operation")),
        "tool_search_call" => ("tool_search".to_string(), payload("arguments")),
        other => (
            other.trim_end_matches("_call").to_string(),
            payload("action"),
        ),
    };
    FinalCall {
        kind,
        name,
        namespace: s(done, "namespace").map(str::to_string),
        call_id: s(done, "call_id").unwrap_or_default().to_string(),
        arguments,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(n: u64, ty: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(ty);
        data["sequence_number"] = json!(n);
        SseEvent::new(ty, data)
    }

    fn resp(status: &str, output: Value) -> Value {
        json!({"response": {"id": "r", "object": "response", "status": status, "output": output, "usage": null}})
    }

    #[test]
    fn a_minimal_stream_passes_and_broken_ones_say_why() {
        let item = json!({"type": "message", "id": "m", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}]});
        let good = vec![
            ev(0, "response.created", resp("in_progress", json!([]))),
            ev(
                1,
                "response.output_item.added",
                json!({"output_index": 0, "item": {"type": "message", "id": "m", "content": []}}),
            ),
            ev(
                2,
                "response.content_part.added",
                json!({"output_index": 0, "item_id": "m", "content_index": 0, "part": {"type": "output_text", "text": ""}}),
            ),
            ev(
                3,
                "response.output_text.delta",
                json!({"output_index": 0, "item_id": "m", "content_index": 0, "delta": "hi"}),
            ),
            ev(
                4,
                "response.output_text.done",
                json!({"output_index": 0, "item_id": "m", "content_index": 0, "text": "hi"}),
            ),
            ev(
                5,
                "response.content_part.done",
                json!({"output_index": 0, "item_id": "m", "content_index": 0, "part": {"type": "output_text", "text": "hi"}}),
            ),
            ev(
                6,
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ),
            ev(7, "response.completed", resp("completed", json!([item]))),
        ];
        assert_eq!(check_stream(&good).unwrap().text, "hi");
        let mut skipped = good.clone();
        skipped.remove(6);
        for (i, e) in skipped.iter_mut().enumerate() {
            e.data["sequence_number"] = json!(i);
        }
        assert!(check_stream(&skipped).unwrap_err().contains("never done"));
        let mut wrong_text = good.clone();
        wrong_text[4].data["text"] = json!("h");
        assert!(check_stream(&wrong_text)
            .unwrap_err()
            .contains("is not the deltas"));
        let mut seq = good.clone();
        seq[3].data["sequence_number"] = json!(9);
        assert!(check_stream(&seq).unwrap_err().contains("sequence_number"));
        let mut after = good.clone();
        after.push(ev(8, "response.completed", resp("completed", json!([]))));
        assert!(check_stream(&after)
            .unwrap_err()
            .contains("after the terminal"));
        let mut no_line = good.clone();
        no_line[1].event = String::new();
        assert!(check_stream(&no_line).is_err());
        assert!(check_stream(&good[..7])
            .unwrap_err()
            .contains("no terminal"));
    }
}
