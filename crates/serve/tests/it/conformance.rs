//! Conformance of streamed pass-through (SPEC §15) on the shared corpus of real
//! provider streams (`crates/transport-openai/tests/fixtures/real-streams`, 24 recorded
//! streams of 13 providers): each is replayed by the mock upstream through the proxy,
//! and every field of every chunk must reach the client unchanged, except
//!
//! - `id`, `created` (one pair for the whole stream) and `model` (the upstream's, or the
//!   committed source's when the frame has none), as §15 says;
//! - usage: a frame's non-null `usage` (top level or in a choice) reaches the client as
//!   `null`, and the usage is sent once, in the final chunk (`choices: []`), as the
//!   upstream reported it (the last usage object of the stream);
//! - frames that tell a client nothing (an empty delta without finish_reason, a
//!   usage-only frame) may be left out — and only those.
//!
//! A repeated `delta.role` (cerebras, neon, perplexity send one on several chunks)
//! passes unchanged: only a *resumed* stream drops the role of the legs that take over.

use std::path::PathBuf;

use polygw_mock_upstream::Behavior;
use serde_json::{json, Value};

use crate::support::*;

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../transport-openai/tests/fixtures/real-streams")
}

fn fixture_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".chunks.jsonl"))
        .collect();
    v.sort();
    v
}

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

/// The frame as the client may see it: usage objects nulled, `id`/`created`/`model`
/// removed (they may differ by design).
fn normalized(frame: &Value) -> Value {
    let mut f = frame.clone();
    let o = f.as_object_mut().unwrap();
    for k in ["id", "created", "model"] {
        o.remove(k);
    }
    if o.get("usage").is_some_and(Value::is_object) {
        o.insert("usage".into(), Value::Null);
    }
    if let Some(choices) = o.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            if let Some(u) = c.get_mut("usage").filter(|u| u.is_object()) {
                *u = Value::Null;
            }
        }
    }
    f
}

fn nonempty(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

/// Whether a frame tells a client nothing (after usage went to the final chunk): the
/// only frames the proxy may leave out.
fn tells_nothing(frame: &Value) -> bool {
    let o = frame.as_object().unwrap();
    if o.iter()
        .any(|(k, v)| !ENVELOPE.contains(&k.as_str()) && !v.is_null())
    {
        return false;
    }
    let Some(choices) = o.get("choices").and_then(Value::as_array) else {
        return true;
    };
    choices.iter().all(|c| {
        let c = c.as_object().unwrap();
        let delta_says = c.get("delta").and_then(Value::as_object).is_some_and(|d| {
            d.iter().any(|(k, v)| {
                if k == "role" {
                    return !v.is_null();
                }
                if k == "tool_calls" {
                    return v.as_array().is_some_and(|calls| {
                        calls.iter().any(|t| {
                            nonempty(&t["function"]["name"])
                                || nonempty(&t["function"]["arguments"])
                        })
                    });
                }
                nonempty(v)
            })
        });
        let choice_says = c
            .iter()
            .any(|(k, v)| !matches!(k.as_str(), "index" | "delta" | "usage") && !v.is_null());
        !delta_says && !choice_says
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_field_of_every_real_chunk_reaches_the_client() {
    let files = fixture_files();
    assert_eq!(files.len(), 24, "the shared corpus");
    let m = mock(Behavior::default()).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut compared = 0usize;
    let mut verbatim = 0usize;
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: std::collections::BTreeSet<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let upstream: Vec<Value> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        m.push_script(Behavior::jsonl(&file));
        let r = http()
            .post(format!("{}/chat/completions", s.v1()))
            .json(
                &json!({"model": "llm", "stream": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "replay"}]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{name}");
        let body = r.text().await.unwrap();
        let mut data = sse_data(&body);
        assert_eq!(data.pop().as_deref(), Some("[DONE]"), "{name}: {body}");
        let usage_chunk: Value = serde_json::from_str(&data.pop().unwrap()).unwrap();
        let got: Vec<Value> = data
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        // Frames that need no edit go out as the upstream's own bytes (no `Value`
        // tree, key order and number spelling as received).
        verbatim += data.iter().filter(|d| lines.contains(d.as_str())).count();

        // One id and one created for the whole stream, usage chunk included; the
        // model is the upstream's own (not the proxy's model alias `llm`).
        let id = &got[0]["id"];
        assert!(id.as_str().is_some_and(|s| !s.is_empty()), "{name}");
        let upstream_models: std::collections::BTreeSet<&str> = upstream
            .iter()
            .filter_map(|f| f["model"].as_str())
            .filter(|m| !m.is_empty())
            .collect();
        // (A frame before the upstream first named its model carries the source's
        // configured MODEL: nothing better is known yet.)
        let mut named = false;
        for (i, f) in got.iter().chain(std::iter::once(&usage_chunk)).enumerate() {
            assert_eq!(&f["id"], id, "{name}");
            assert_eq!(f["created"], got[0]["created"], "{name}");
            let model = f["model"].as_str().unwrap_or_default();
            assert!(!model.is_empty() && model != "llm", "{name}: {f}");
            if upstream_models.is_empty() || upstream_models.contains(model) {
                named |= !upstream_models.is_empty();
            } else {
                assert!(
                    !named && i < got.len(),
                    "{name}: model {model:?} is not the upstream's {upstream_models:?}: {f}"
                );
            }
        }

        // Every client frame is the next upstream frame that tells something, with
        // every field unchanged.
        let mut up = upstream.iter();
        for (i, g) in got.iter().enumerate() {
            loop {
                let u = up.next().unwrap_or_else(|| {
                    panic!("{name}: client frame {i} has no upstream frame: {g}")
                });
                let n = normalized(u);
                if normalized(g) == n {
                    break;
                }
                assert!(
                    tells_nothing(&n),
                    "{name}: upstream frame left out or changed:\n upstream {u}\n client   {g}"
                );
            }
            compared += 1;
        }
        for u in up {
            let n = normalized(u);
            assert!(tells_nothing(&n), "{name}: trailing frame left out: {u}");
        }

        // Usage once, at the end, as the upstream reported it (its last usage object).
        let last_usage = upstream.iter().rev().find_map(|f| {
            f.get("usage")
                .filter(|u| u.is_object())
                .or_else(|| {
                    f["choices"].as_array().and_then(|cs| {
                        cs.iter()
                            .find_map(|c| c.get("usage").filter(|u| u.is_object()))
                    })
                })
                .cloned()
        });
        assert_eq!(usage_chunk["choices"], json!([]), "{name}");
        match last_usage {
            Some(u) => assert_eq!(usage_chunk["usage"], u, "{name}"),
            None => assert!(
                usage_chunk["polygw"]["usage_source"].is_string(),
                "{name}: {usage_chunk}"
            ),
        }
    }
    assert!(compared > 500, "{compared} frames compared");
    assert!(
        verbatim * 2 > compared,
        "only {verbatim} of {compared} frames passed through as received"
    );
    eprintln!("{verbatim} of {compared} frames passed through as received");
}
