//! The recorded real provider streams (`crates/transport-openai/tests/fixtures/
//! real-streams`, a copy of the shared corpus, with `expected.json`) through
//! `/v1/responses` and `/v1/messages` (SPEC §18, issue 23 "done when"):
//!
//! - each stream replayed as the upstream (the mock's `raw_sse`, built from the
//!   `.jsonl` lines as MANIFEST.md says) and streamed to the client gives an event
//!   sequence that passes the dialect's conformance check (`check_stream`), whose final
//!   text, reasoning and tool calls are expected.json's;
//! - one recorded stream cut at every chunk position (the primary's body ends after k
//!   of its lines, the fallback serves the whole stream) is rescued in both APIs: a
//!   valid sequence with the exact text, and the fallback was used.

use std::path::PathBuf;
use std::time::Duration;

use polygw::SourceConfig;
use polygw_dialects::{messages, parse_sse, responses, SseEvent};
use polygw_mock_upstream::{Behavior, MockUpstream};
use serde_json::{json, Value};

use crate::support::*;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../transport-openai/tests/fixtures/real-streams")
}

/// (file name, expected entry), sorted.
fn fixtures() -> Vec<(String, Value)> {
    let text = std::fs::read_to_string(dir().join("expected.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut out: Vec<(String, Value)> = v
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(out.len(), 24, "the shared corpus");
    out
}

/// The recording's non-empty lines (one chunk each).
fn lines(name: &str) -> Vec<String> {
    std::fs::read_to_string(dir().join(name))
        .unwrap()
        .split('\n')
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// The first `k` lines as a provider's SSE body; the whole recording ends with
/// `data: [DONE]` (MANIFEST.md's replay), a cut one just ends.
fn sse(lines: &[String], k: usize) -> String {
    let mut out = String::new();
    for l in &lines[..k] {
        out.push_str("data: ");
        out.push_str(l);
        out.push_str("\n\n");
    }
    if k == lines.len() {
        out.push_str("data: [DONE]\n\n");
    }
    out
}

fn raw(body: String) -> Behavior {
    Behavior {
        raw_sse: Some(body),
        ..Behavior::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Responses,
    Messages,
}

impl Api {
    const BOTH: [Api; 2] = [Api::Responses, Api::Messages];

    fn path(self) -> &'static str {
        match self {
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// A streamed request asking for reasoning to be shown, with the recordings' tools
    /// declared.
    fn body(self, prompt: &str) -> Value {
        let names = ["weather", "nonUsefulTool", "webSearchTool"];
        match self {
            Api::Responses => json!({
                "model": "llm", "stream": true, "input": prompt,
                "reasoning": {"effort": "low", "summary": "auto"},
                "tools": names.iter().map(|n| json!({"type": "function", "name": n,
                    "parameters": {"type": "object", "properties": {}}})).collect::<Vec<_>>(),
            }),
            Api::Messages => json!({
                "model": "llm", "stream": true, "max_tokens": 4096,
                "messages": [{"role": "user", "content": prompt}],
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "tools": names.iter().map(|n| json!({"name": n,
                    "input_schema": {"type": "object", "properties": {}}})).collect::<Vec<_>>(),
            }),
        }
    }
}

/// What a client ends with, whichever the API.
#[derive(Debug, PartialEq)]
struct Final {
    /// Whether the answer was cut by the length limit (Responses `incomplete`,
    /// Messages `max_tokens`), or ended normally.
    length: bool,
    text: String,
    reasoning: String,
    /// (name, id, arguments as the API carries them)
    calls: Vec<(String, String, Value)>,
}

/// Streams `api` through the proxy; the events must pass the API's check.
async fn stream(s: &Served, api: Api, prompt: &str, what: &str) -> (Final, Vec<SseEvent>) {
    match try_stream(s, api, prompt).await {
        Ok(x) => x,
        Err(e) => panic!("{what} {api:?}: {e}"),
    }
}

/// Streams `api` through the proxy: what the client ends with, or why the stream is
/// not a valid, complete one (with the body).
async fn try_stream(s: &Served, api: Api, prompt: &str) -> Result<(Final, Vec<SseEvent>), String> {
    let r = http()
        .post(format!("{}{}", s.base, api.path()))
        .json(&api.body(prompt))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    let bytes = r.bytes().await.unwrap();
    let body = || String::from_utf8_lossy(&bytes).into_owned();
    if status != 200 || !ct.starts_with("text/event-stream") {
        return Err(format!("{status} {ct}: {}", body()));
    }
    let events = parse_sse(&bytes);
    let fin = match api {
        Api::Responses => {
            let f = responses::check_stream(&events).map_err(|e| format!("{e}\n{}", body()))?;
            if f.status != "completed" && f.status != "incomplete" {
                return Err(format!("status {}: {:?}", f.status, f.error));
            }
            Final {
                length: f.status == "incomplete",
                text: f.text,
                reasoning: f.reasoning,
                calls: f
                    .tool_calls
                    .into_iter()
                    .map(|c| (c.name, c.call_id, Value::String(c.arguments)))
                    .collect(),
            }
        }
        Api::Messages => {
            let f = messages::check_stream(&events).map_err(|e| format!("{e}\n{}", body()))?;
            if let Some(e) = f.error {
                return Err(format!("error event {e:?}"));
            }
            Final {
                length: f.stop_reason.as_deref() == Some("max_tokens"),
                text: f.text,
                reasoning: f.thinking,
                calls: f
                    .tool_calls
                    .into_iter()
                    .map(|c| (c.name, c.id, c.input))
                    .collect(),
            }
        }
    };
    Ok((fin, events))
}

/// expected.json's entry as `api` carries it: a tool call's arguments as text
/// (Responses) or as the input object (Messages, `tool_input`).
fn expected(api: Api, exp: &Value) -> Final {
    let calls = exp["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let args = c["arguments"].as_str().unwrap();
            let carried = match api {
                Api::Responses => Value::String(args.to_string()),
                Api::Messages => messages::tool_input(args),
            };
            (
                c["name"].as_str().unwrap().to_string(),
                c["id"].as_str().unwrap().to_string(),
                carried,
            )
        })
        .collect();
    Final {
        length: exp["finish_reason"] == "length",
        text: exp["content"].as_str().unwrap().to_string(),
        reasoning: exp["reasoning"].as_str().unwrap().to_string(),
        calls,
    }
}

/// Two answers recorded back to back in one file (MANIFEST.md): the second starts
/// tool call 0 again, with another id, after the first answer's call and a text. A
/// Responses or Messages stream cannot reopen a finished call, so polygw ends such a
/// stream with a valid failure event naming the reason instead of merging the two
/// calls into one (expected.json's chat-completions aggregate: `{}{}`).
const TWO_ANSWERS: &str = "cerebras--cererebras-structured-output-tools.1.chunks.jsonl";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_recorded_stream_is_a_valid_responses_and_messages_stream() {
    let m = mock(Behavior::default()).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut failures = Vec::new();
    for (name, exp) in fixtures() {
        let all = lines(&name);
        for api in Api::BOTH {
            m.push_script(raw(sse(&all, all.len())));
            let want = expected(api, &exp);
            if name == TWO_ANSWERS {
                let e = try_stream(&s, api, "replay").await.unwrap_err();
                assert!(
                    e.contains("went back to tool call 0"),
                    "{name} {api:?}: {e}"
                );
                continue;
            }
            match try_stream(&s, api, "replay").await {
                Ok((got, _)) if got == want => {}
                Ok((got, _)) => {
                    failures.push(format!("{name} {api:?}:\n  got  {got:?}\n  want {want:?}"))
                }
                Err(e) => failures.push(format!("{name} {api:?}: {e}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 46 differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The recording cut at every position, in both APIs.
const CUT: &str = "openai--openai-text.chunks.jsonl";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_stream_cut_at_every_chunk_is_rescued_in_both_apis() {
    let all = lines(CUT);
    let exp = fixtures().into_iter().find(|(n, _)| n == CUT).unwrap().1;
    let text = exp["content"].as_str().unwrap().to_string();
    // The primary is cut (its body ends after k lines, without finish_reason or
    // [DONE]); the fallback serves the whole recording.
    let a = mock(Behavior::default()).await;
    let b = mock(raw(sse(&all, all.len()))).await;
    let scope = scope_cut_on_purpose(vec![
        SourceConfig::new("a", 0, a.base_url(), UPSTREAM_KEY, "model-a").with_priority(0),
        SourceConfig::new("b", 0, b.base_url(), UPSTREAM_KEY, "model-b").with_priority(1),
    ])
    .await;
    let s = serve(vec![scope]).await;
    // The line with the finish_reason: cut before it, the stream is incomplete.
    let finish = all
        .iter()
        .position(|l| l.contains(r#""finish_reason":"stop""#))
        .unwrap();
    let mut rescued = 0;
    for k in 0..all.len() {
        for api in Api::BOTH {
            a.reset_log();
            b.reset_log();
            a.push_script(raw(sse(&all, k)));
            let what = format!("{CUT} cut after {k} of {} lines", all.len());
            let (got, _) = stream(&s, api, &format!("cut {k}"), &what).await;
            assert_eq!(got.text, text, "{what} {api:?}: the exact text");
            assert_eq!(a.requests().len(), 1, "{what} {api:?}: the primary was cut");
            if k <= finish {
                let rb = b.wait_for_ended(1, Duration::from_secs(10)).await;
                assert_eq!(rb.len(), 1, "{what} {api:?}: rescued by the fallback");
                rescued += 1;
            }
        }
    }
    assert_eq!(rescued, 2 * (finish + 1));
}

/// The proxy's keepalive for Messages is Anthropic's `ping`, and a stream whose
/// upstream sends its first chunk late still passes the check (pings before
/// `message_start` are allowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_chunk_gets_pings_and_stays_valid() {
    let m: MockUpstream = mock(Behavior {
        ttft_ms: 1_500.0,
        ..Behavior::text(&["late", " but", " here"])
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        polygw_serve::ProxyConfig {
            keepalive: Duration::from_millis(300),
            ..polygw_serve::ProxyConfig::default()
        },
        polygw_serve::ServerLimits::default(),
    )
    .await;
    for api in Api::BOTH {
        let (got, events) = stream(&s, api, "late", "late first chunk").await;
        assert_eq!(got.text, "late but here", "{api:?}");
        if api == Api::Messages {
            assert!(
                events.iter().any(|e| e.event == "ping"),
                "{:?}",
                events.iter().map(|e| &e.event).collect::<Vec<_>>()
            );
        }
    }
}
