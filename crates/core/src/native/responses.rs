//! What OpenAI's Responses events mean to the engine (SPEC §23.4), pure: the first
//! content event (an output item of reasoning, a message or a call being added, or any
//! output delta — `response.in_progress` is not progress), the answer's text, reasoning
//! and calls, its end (`response.completed`, `response.incomplete` with its reason,
//! `response.failed` with its code) and usage (`cached_tokens` a subset of
//! `input_tokens`). The events themselves reach the client unchanged
//! ([`super::NativeEvent`]).

use serde_json::{Map, Value};

use crate::ports::{StreamDelta, ToolCallDelta};
use crate::response::Usage;

use super::{NativeError, PlainAnswer, ReadError};

/// A Responses `usage` object as polygw counts it: `input_tokens` holds the cached and
/// cache-written tokens, `output_tokens` the reasoning.
pub fn usage_of(u: &Map<String, Value>) -> Option<Usage> {
    let n = |v: Option<&Value>| v.and_then(Value::as_u64);
    let input = n(u.get("input_tokens"));
    let output = n(u.get("output_tokens"));
    if input.is_none() && output.is_none() {
        return None;
    }
    let details = u.get("input_tokens_details");
    Some(Usage {
        prompt_tokens: input.unwrap_or(0),
        completion_tokens: output.unwrap_or(0),
        reasoning_tokens: n(u
            .get("output_tokens_details")
            .and_then(|d| d.get("reasoning_tokens"))),
        cached_prompt_tokens: n(details.and_then(|d| d.get("cached_tokens"))),
        cache_write_tokens: n(details.and_then(|d| d.get("cache_write_tokens"))),
        cache_write_1h_tokens: None,
    })
}

/// Chat's finish reason for a finished response: `incomplete` by its reason (`length`
/// for `max_output_tokens`), else `tool_calls` when it holds a call, else `stop`.
fn finish_of(response: &Map<String, Value>) -> String {
    if response.get("status").and_then(Value::as_str) == Some("incomplete") {
        let reason = response
            .get("incomplete_details")
            .and_then(|d| d.get("reason"))
            .and_then(Value::as_str)
            .unwrap_or("incomplete");
        return match reason {
            "max_output_tokens" => "length".into(),
            other => other.into(),
        };
    }
    let calls = response
        .get("output")
        .and_then(Value::as_array)
        .is_some_and(|o| {
            o.iter()
                .any(|i| is_call(i.get("type").and_then(Value::as_str)))
        });
    if calls { "tool_calls" } else { "stop" }.into()
}

/// Whether an output item is a call the client runs (a function, a custom tool, a
/// local shell, …): the answer ends in a tool round.
fn is_call(kind: Option<&str>) -> bool {
    matches!(
        kind,
        Some(
            "function_call"
                | "custom_tool_call"
                | "local_shell_call"
                | "shell_call"
                | "apply_patch_call"
                | "computer_call"
        )
    )
}

/// The error of a `response.failed` event or an `error` event.
fn error_of(obj: &Map<String, Value>) -> NativeError {
    let e = obj
        .get("response")
        .and_then(|r| r.get("error"))
        .and_then(Value::as_object)
        .or_else(|| obj.get("error").and_then(Value::as_object))
        .unwrap_or(obj);
    let s = |k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
    NativeError {
        kind: s("code").or_else(|| s("type")).filter(|k| k != "error"),
        message: s("message"),
    }
}

/// Reads one Responses stream, event by event.
#[derive(Debug, Clone, Default)]
pub struct ResponsesReader {
    /// The output indices of the call items, in order: a call's index is its position
    /// here, as a chat or Messages client numbers its calls (SPEC §23.3).
    call_items: Vec<u32>,
    done: bool,
    events: u64,
}

impl ResponsesReader {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        ResponsesReader::default()
    }

    /// Whether a terminal event (`response.completed` / `.incomplete`) came.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Reads one event: what it means as a [`StreamDelta`] whose `native` is the event
    /// itself. `response.failed` and `error` are the source's error.
    pub fn on_event(&mut self, event: Option<&str>, data: &str) -> Result<StreamDelta, ReadError> {
        self.events += 1;
        let (obj, kind) = super::typed_event(event, data, self.events)?;
        if kind == "error" || kind == "response.failed" || event == Some("error") {
            return Err(ReadError::Provider(error_of(&obj)));
        }
        let mut d = StreamDelta::default();
        let mut progress = false;
        let mut patient = false;
        let mut opaque = false;
        let s = |k: &str| obj.get(k).and_then(Value::as_str);
        let index = obj
            .get("output_index")
            .and_then(Value::as_u64)
            .and_then(|i| u32::try_from(i).ok())
            .unwrap_or(0);
        match kind.as_str() {
            "response.created" | "response.in_progress" | "response.queued" => {
                d.model = obj
                    .get("response")
                    .and_then(|r| r.get("model"))
                    .and_then(Value::as_str)
                    .filter(|m| !m.is_empty())
                    .map(str::to_string);
                if kind == "response.created" {
                    d.role = Some("assistant".into());
                }
            }
            "response.output_item.added" => {
                let item = obj.get("item").and_then(Value::as_object);
                let t = item.and_then(|i| i.get("type")).and_then(Value::as_str);
                progress = true;
                // Reasoning may stream no summary; a hosted tool runs silently.
                patient = t == Some("reasoning")
                    || t.is_some_and(|t| t.ends_with("_call") && !is_call(Some(t)));
                // A hosted tool's item (a web search, …) or a type polygw does not read.
                opaque = !matches!(t, Some("message" | "reasoning")) && !is_call(t);
                if is_call(t) {
                    let g = |k: &str| item.and_then(|i| i.get(k)).and_then(Value::as_str);
                    self.call_items.push(index);
                    d.tool_calls.push(ToolCallDelta {
                        index: self.call_items.len() as u32 - 1,
                        id: g("call_id").or(g("id")).map(Into::into),
                        name: g("name").or(t).map(Into::into),
                        arguments: String::new(),
                    });
                }
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                progress = true;
                d.content = s("delta").map(Into::into);
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                progress = true;
                d.reasoning = s("delta").map(Into::into);
            }
            "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                progress = true;
                let call = self.call_items.iter().position(|&i| i == index);
                d.tool_calls.push(ToolCallDelta {
                    index: call.map_or(index, |c| c as u32),
                    id: None,
                    name: None,
                    arguments: s("delta").unwrap_or_default().to_string(),
                });
            }
            "response.completed" | "response.incomplete" => {
                self.done = true;
                if let Some(r) = obj.get("response").and_then(Value::as_object) {
                    d.finish_reason = Some(finish_of(r));
                    d.usage = r.get("usage").and_then(Value::as_object).and_then(usage_of);
                }
            }
            // Other deltas (audio, code, …) are output too; the rest (`.done`,
            // `content_part.*`, events added after polygw was written) is for the client.
            k => progress = k.ends_with(".delta"),
        }
        d.native = Some(super::as_received(
            crate::source::SourceApi::Responses,
            event,
            data,
            progress,
            patient,
            opaque,
        ));
        Ok(d)
    }
}

/// Reads a plain Responses answer (a `response` object); `Err` when it is an error body
/// or a failed response.
pub fn read_response(obj: &Map<String, Value>) -> Result<PlainAnswer, NativeError> {
    if obj.get("status").and_then(Value::as_str) == Some("failed")
        || obj.get("error").is_some_and(Value::is_object)
    {
        return Err(error_of(obj));
    }
    let mut a = PlainAnswer {
        model: obj.get("model").and_then(Value::as_str).map(str::to_string),
        finish_reason: Some(finish_of(obj)),
        usage: obj
            .get("usage")
            .and_then(Value::as_object)
            .and_then(usage_of),
        ..PlainAnswer::default()
    };
    for item in obj
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(item) = item.as_object() else {
            continue;
        };
        a.has_blocks = true;
        let s = |k: &str| item.get(k).and_then(Value::as_str);
        let texts = |key: &str, kinds: &[&str]| -> String {
            item.get(key)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|p| {
                    kinds.contains(&p.get("type").and_then(Value::as_str).unwrap_or_default())
                })
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect()
        };
        match s("type").unwrap_or_default() {
            "message" => a
                .content
                .push_str(&texts("content", &["output_text", "refusal"])),
            "reasoning" => a.reasoning.push_str(&texts("summary", &["summary_text"])),
            t if is_call(Some(t)) => a.tool_calls.push((
                a.tool_calls.len() as u32,
                s("call_id").or(s("id")).map(Into::into),
                s("name").or(Some(t)).map(Into::into),
                s("arguments")
                    .or(s("input"))
                    .unwrap_or_default()
                    .to_string(),
            )),
            _ => {}
        }
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(r: &mut ResponsesReader, v: Value) -> StreamDelta {
        let name = v["type"].as_str().unwrap().to_string();
        r.on_event(Some(&name), &v.to_string()).unwrap()
    }

    /// SPEC §23.6: a hosted tool's item (a web search) or an item type polygw does not
    /// read is opaque to a prefill; messages, reasoning and the client's calls are not.
    #[test]
    fn items_a_prefill_cannot_carry_are_opaque() {
        let mut r = ResponsesReader::new();
        let mut opaque = |t: &str| {
            ev(
                &mut r,
                json!({"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"type":t,"id":"x"}}),
            )
            .native
            .unwrap()
            .opaque
        };
        for t in ["message", "reasoning", "function_call", "custom_tool_call"] {
            assert!(!opaque(t), "{t}");
        }
        for t in [
            "web_search_call",
            "file_search_call",
            "image_generation_call",
            "something_new",
        ] {
            assert!(opaque(t), "{t}");
        }
    }

    #[test]
    fn a_stream_reads_as_its_text_calls_end_and_usage() {
        let mut r = ResponsesReader::new();
        let d = ev(
            &mut r,
            json!({"type":"response.created","sequence_number":0,"response":{"id":"resp_1","model":"gpt-x","status":"in_progress","output":[]}}),
        );
        assert!(!d.is_incremental());
        assert_eq!(d.model.as_deref(), Some("gpt-x"));
        let d = ev(
            &mut r,
            json!({"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1"}}),
        );
        assert!(!d.is_incremental(), "in_progress is no progress");
        // A reasoning item being added is the first content event, and may be silent.
        let d = ev(
            &mut r,
            json!({"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"reasoning","id":"rs_1","summary":[]}}),
        );
        assert!(d.is_incremental() && d.native.as_ref().unwrap().patient);
        let d = ev(
            &mut r,
            json!({"type":"response.reasoning_summary_text.delta","sequence_number":3,"output_index":0,"summary_index":0,"delta":"hm"}),
        );
        assert_eq!(d.reasoning.as_deref(), Some("hm"));
        let d = ev(
            &mut r,
            json!({"type":"response.output_text.delta","sequence_number":4,"output_index":1,"content_index":0,"delta":"Hi"}),
        );
        assert_eq!(d.content.as_deref(), Some("Hi"));
        let d = ev(
            &mut r,
            json!({"type":"response.output_item.added","sequence_number":5,"output_index":2,"item":{"type":"function_call","id":"fc_1","call_id":"call_1","name":"get","arguments":""}}),
        );
        assert_eq!(d.tool_calls[0].id.as_deref(), Some("call_1"));
        assert_eq!(d.tool_calls[0].name.as_deref(), Some("get"));
        let d = ev(
            &mut r,
            json!({"type":"response.function_call_arguments.delta","sequence_number":6,"output_index":2,"delta":"{}"}),
        );
        assert_eq!(
            (d.tool_calls[0].index, d.tool_calls[0].arguments.as_str()),
            (0, "{}"),
            "the first call, whatever its output index"
        );
        let d = ev(
            &mut r,
            json!({"type":"response.completed","sequence_number":7,"response":{"id":"resp_1","status":"completed",
            "output":[{"type":"function_call","call_id":"call_1","name":"get","arguments":"{}"}],
            "usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":80},"output_tokens":20,"output_tokens_details":{"reasoning_tokens":5},"total_tokens":120}}}),
        );
        assert!(r.done());
        assert_eq!(d.finish_reason.as_deref(), Some("tool_calls"));
        let u = d.usage.unwrap();
        assert_eq!(
            (
                u.prompt_tokens,
                u.completion_tokens,
                u.cached_prompt_tokens,
                u.reasoning_tokens
            ),
            (100, 20, Some(80), Some(5))
        );
    }

    #[test]
    fn failures_and_incomplete_answers_read_as_the_api_says() {
        let mut r = ResponsesReader::new();
        let e = r
            .on_event(Some("response.failed"), r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"boom"}}}"#)
            .unwrap_err();
        assert_eq!(
            e,
            ReadError::Provider(NativeError {
                kind: Some("server_error".into()),
                message: Some("boom".into())
            })
        );
        let e = r
            .on_event(
                Some("error"),
                r#"{"type":"error","code":"rate_limit_exceeded","message":"slow down"}"#,
            )
            .unwrap_err();
        assert_eq!(
            e,
            ReadError::Provider(NativeError {
                kind: Some("rate_limit_exceeded".into()),
                message: Some("slow down".into())
            })
        );
        let d = ev(
            &mut r,
            json!({"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[]}}),
        );
        assert_eq!(d.finish_reason.as_deref(), Some("length"));
        assert!(matches!(
            r.on_event(None, "nope"),
            Err(ReadError::Malformed(_))
        ));
    }

    #[test]
    fn a_plain_answer_reads_as_its_items() {
        let v = json!({"id":"resp_1","object":"response","status":"completed","model":"m",
            "output":[{"type":"reasoning","id":"rs","summary":[{"type":"summary_text","text":"hm"}],"encrypted_content":"x"},
                      {"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok"}]},
                      {"type":"custom_tool_call","call_id":"c","name":"apply","input":"patch"}],
            "usage":{"input_tokens":5,"output_tokens":7}});
        let a = read_response(v.as_object().unwrap()).unwrap();
        assert_eq!((a.content.as_str(), a.reasoning.as_str()), ("ok", "hm"));
        assert_eq!(
            a.tool_calls,
            vec![(0, Some("c".into()), Some("apply".into()), "patch".into())]
        );
        assert_eq!(a.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(a.usage.unwrap().prompt_tokens, 5);
        let failed = json!({"error":{"message":"bad","type":"invalid_request_error","code":"invalid_prompt"}});
        assert_eq!(
            read_response(failed.as_object().unwrap())
                .unwrap_err()
                .kind
                .as_deref(),
            Some("invalid_prompt")
        );
    }
}
