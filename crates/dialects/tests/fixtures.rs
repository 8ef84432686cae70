//! Requests as coding agents send them (Codex CLI's Responses requests, Claude Code's
//! Messages requests; fixtures built from the public API types) parse, translate, and
//! their answers come back in the shapes those clients read.

use polygw_core::ports::{StreamDelta, ToolCallDelta};
use polygw_core::{LlmResponse, ToolCall, Usage, UsageSource};
use polygw_dialects::{messages, responses, sse};
use serde_json::{json, Value};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn roles(req: &polygw_core::ChatRequest) -> Vec<&str> {
    req.messages.iter().map(|m| m.role.as_str()).collect()
}

fn call(index: u32, id: &str, name: &str, args: &str) -> ToolCall {
    ToolCall {
        index,
        id: Some(id.into()),
        name: Some(name.into()),
        arguments: args.into(),
    }
}

#[test]
fn codex_request_translates() {
    let req = responses::parse_request(&fixture("codex_responses.json")).unwrap();
    assert_eq!(req.model(), "gpt-5-codex");
    assert!(req.stream());
    assert!(!req.store());
    assert_eq!(
        req.affinity_key(),
        Some("0199a8f2-7c3e-7b11-9d2a-5e6f7a8b9c0d")
    );
    assert_eq!(req.unsupported_tools(), ["web_search"]);
    assert_eq!(req.ignored(), ["client_metadata"]);
    assert_eq!(req.include(), ["reasoning.encrypted_content"]);

    let t = responses::to_chat(&req, &[]).unwrap();
    let r = &t.request;
    assert!(r.stream);
    assert_eq!(r.reasoning_effort.as_deref(), Some("medium"));
    assert_eq!(
        roles(r),
        [
            "system",
            "system",
            "user",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "user"
        ]
    );
    // Developer items are system messages; no instructions were sent, so none is added.
    assert!(r.messages[0]
        .text()
        .unwrap()
        .starts_with("<permissions instructions>"));
    let calls: Vec<(String, String)> = r
        .messages
        .iter()
        .flat_map(|m| {
            m.extra
                .get("tool_calls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        })
        .map(|c| {
            (
                c["function"]["name"].as_str().unwrap().to_string(),
                c["function"]["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(calls[0].0, "shell");
    assert_eq!(calls[1].0, "apply_patch");
    let patch: Value = serde_json::from_str(&calls[1].1).unwrap();
    assert!(patch["input"]
        .as_str()
        .unwrap()
        .starts_with("*** Begin Patch\n*** Update File: src/lib.rs"));
    assert_eq!(calls[2].0, "local_shell");
    let action: Value = serde_json::from_str(&calls[2].1).unwrap();
    assert_eq!(action["command"], json!(["cargo", "test", "tokenizer"]));
    assert!(action.get("type").is_none());
    assert_eq!(
        calls[3],
        (
            "mcp__github__create_issue".to_string(),
            r#"{"owner":"dev","repo":"parser","title":"Add a test for empty input"}"#.to_string()
        )
    );
    // The tool output given as parts is text.
    assert_eq!(
        r.messages[11].text(),
        Some(r#"{"number":42,"url":"https://github.com/dev/parser/issues/42"}"#)
    );

    let names: Vec<&str> = r
        .tools
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "shell",
            "apply_patch",
            "update_plan",
            "mcp__github__create_issue",
            "mcp__github__get_issue",
            "local_shell",
            "tool_search"
        ]
    );
    let apply_patch = &r.tools.as_ref().unwrap()[1]["function"];
    assert!(apply_patch["description"]
        .as_str()
        .unwrap()
        .contains("lark grammar:\nstart: begin_patch hunk+ end_patch"));
    let o = r.overlay.as_ref().unwrap();
    assert_eq!(o["tool_choice"], "auto");
    assert_eq!(o["parallel_tool_calls"], false);
    assert!(!o.contains_key("verbosity"));
    assert!(!o.contains_key("prompt_cache_key"));
    assert_eq!(t.meta.input_items().len(), 15);
}

#[test]
fn codex_answer_comes_back_as_its_tool_kinds_in_both_forms() {
    let req = responses::parse_request(&fixture("codex_responses.json")).unwrap();
    let meta = responses::to_chat(&req, &[]).unwrap().meta;
    let answer = LlmResponse {
        content: "Let me patch it.".into(),
        reasoning_content: Some("The fix is small.".into()),
        tool_calls: vec![
            call(
                0,
                "call_p",
                "apply_patch",
                r#"{"input":"*** Begin Patch\n*** End Patch\n"}"#,
            ),
            call(
                1,
                "call_g",
                "mcp__github__get_issue",
                r#"{"owner":"dev","repo":"parser","issue_number":42}"#,
            ),
            call(2, "call_s", "tool_search", r#"{"query":"calendar"}"#),
        ],
        finish_reason: Some("tool_calls".into()),
        model: "qwen3-coder".into(),
        usage: Usage {
            cached_prompt_tokens: Some(1024),
            reasoning_tokens: Some(12),
            ..Usage::new(2048, 100)
        },
        usage_source: UsageSource::Measured,
        ..Default::default()
    };
    let plain = responses::response_object("resp_f00d", 1_760_000_000, &meta, &answer);
    let out = plain["output"].as_array().unwrap();
    let kinds: Vec<&str> = out.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "reasoning",
            "message",
            "custom_tool_call",
            "function_call",
            "tool_search_call"
        ]
    );
    assert_eq!(out[2]["input"], "*** Begin Patch\n*** End Patch\n");
    assert_eq!(
        (out[3]["name"].as_str(), out[3]["namespace"].as_str()),
        (Some("get_issue"), Some("mcp__github"))
    );
    assert_eq!(out[4]["arguments"], json!({"query": "calendar"}));
    assert_eq!(out[4]["execution"], "client");
    assert_eq!(
        plain["usage"]["input_tokens_details"]["cached_tokens"],
        1024
    );
    assert_eq!(plain["store"], false);
    assert_eq!(
        plain["prompt_cache_key"],
        "0199a8f2-7c3e-7b11-9d2a-5e6f7a8b9c0d"
    );
    assert_eq!(plain["tools"].as_array().unwrap().len(), 7);

    // The same answer streamed in fragments ends with the same items.
    let mut s = responses::ResponsesStream::new("resp_f00d", 1_760_000_000, meta.clone());
    let mut ev = s.start();
    let deltas = [
        StreamDelta {
            role: Some("assistant".into()),
            ..Default::default()
        },
        StreamDelta {
            reasoning: Some("The fix ".into()),
            ..Default::default()
        },
        StreamDelta {
            reasoning: Some("is small.".into()),
            ..Default::default()
        },
        StreamDelta {
            content: Some("Let me ".into()),
            ..Default::default()
        },
        StreamDelta {
            content: Some("patch it.".into()),
            ..Default::default()
        },
        frag(
            0,
            Some("call_p"),
            Some("apply_patch"),
            r#"{"input":"*** Begin"#,
        ),
        frag(0, None, None, r#" Patch\n*** End Patch\n"}"#),
        frag(
            1,
            Some("call_g"),
            Some("mcp__github__get_issue"),
            r#"{"owner":"dev","#,
        ),
        frag(1, None, None, r#""repo":"parser","issue_number":42}"#),
        frag(
            2,
            Some("call_s"),
            Some("tool_search"),
            r#"{"query":"calendar"}"#,
        ),
        StreamDelta {
            finish_reason: Some("tool_calls".into()),
            ..Default::default()
        },
        StreamDelta {
            usage: Some(answer.usage),
            ..Default::default()
        },
    ];
    for d in &deltas {
        ev.extend(s.delta(d));
    }
    ev.extend(s.finish(&answer));
    // Through the wire format and back.
    let ev = sse::parse_sse(&sse::write_all(&ev));
    let fin = responses::check_stream(&ev).unwrap();
    assert_eq!(fin.status, "completed");
    assert_eq!(fin.text, "Let me patch it.");
    assert_eq!(fin.reasoning, "The fix is small.");
    assert_eq!(fin.response["output"], plain["output"]);
    assert_eq!(fin.response["usage"], plain["usage"]);
    assert_eq!(fin.tool_calls[1].namespace.as_deref(), Some("mcp__github"));
    assert_eq!(s.output_items(), out.as_slice());
}

fn frag(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> StreamDelta {
    StreamDelta {
        tool_calls: vec![ToolCallDelta {
            index,
            id: id.map(str::to_string),
            name: name.map(str::to_string),
            arguments: args.into(),
        }],
        ..Default::default()
    }
}

#[test]
fn codex_lite_namespaces_in_additional_tools_round_trip() {
    let req = responses::parse_request(&fixture("codex_lite_responses.json")).unwrap();
    let t = responses::to_chat(&req, &[]).unwrap();
    let names: Vec<&str> = t
        .request
        .tools
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    // `functions` is the default namespace: its tools keep their bare names.
    assert_eq!(names, ["exec", "wait", "collaboration__spawn_agent"]);
    assert_eq!(
        roles(&t.request),
        ["system", "user", "assistant", "tool", "assistant", "tool"]
    );
    assert_eq!(
        t.request.messages[4].extra["tool_calls"][0]["function"]["name"],
        "collaboration__spawn_agent"
    );
    assert!(t.request.overlay.is_none());
    let answer = LlmResponse {
        tool_calls: vec![
            call(0, "c1", "exec", r#"{"input":"ls"}"#),
            call(1, "c2", "collaboration__spawn_agent", "{}"),
        ],
        finish_reason: Some("tool_calls".into()),
        ..Default::default()
    };
    let items = responses::output_items("resp_l", &t.meta, &answer);
    assert_eq!(
        (
            items[0]["type"].as_str(),
            items[0]["name"].as_str(),
            items[0]["namespace"].as_str(),
            items[0]["input"].as_str()
        ),
        (
            Some("custom_tool_call"),
            Some("exec"),
            Some("functions"),
            Some("ls")
        )
    );
    assert_eq!(
        (items[1]["name"].as_str(), items[1]["namespace"].as_str()),
        (Some("spawn_agent"), Some("collaboration"))
    );
    // The next turn continues from the stored items: tools of the stored
    // additional_tools item stay defined, instructions are not carried over.
    let mut history = t.meta.input_items().to_vec();
    history.extend(items);
    let next = responses::parse_request(
        json!({"model": "m", "previous_response_id": "resp_l", "input": [
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "a b"},
            {"type": "function_call_output", "call_id": "c2", "output": "ok"}]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let t2 = responses::to_chat(&next, &history).unwrap();
    assert_eq!(t2.request.tools.as_ref().unwrap().len(), 3);
    let last_call = &t2.request.messages[6];
    assert_eq!(last_call.extra["tool_calls"][0]["function"]["name"], "exec");
    assert_eq!(
        last_call.extra["tool_calls"][1]["function"]["name"],
        "collaboration__spawn_agent"
    );
    assert_eq!(roles(&t2.request)[7..], ["tool", "tool"]);
}

#[test]
fn claude_code_request_translates() {
    let body = fixture("claude_code_messages.json");
    let raw: Value = serde_json::from_slice(&body).unwrap();
    let tools_bytes = raw["tools"].to_string().len();
    assert!((80_000..100_000).contains(&tools_bytes), "{tools_bytes}");
    let req = messages::parse_request(&body).unwrap();
    assert!(req.stream());
    assert_eq!(req.max_tokens(), Some(32000));
    assert_eq!(req.unsupported_tools(), ["web_search_20250305"]);
    assert_eq!(req.ignored(), ["context_management"]);
    assert!(req
        .affinity_key()
        .unwrap()
        .starts_with("user_4f1c0de5ab_account_"));

    let t = messages::to_chat(&req).unwrap();
    let r = &t.request;
    assert_eq!(r.reasoning_effort.as_deref(), Some("high"));
    assert!(t.meta.thinking_visible());
    assert_eq!(r.tools.as_ref().unwrap().len(), 25);
    assert_eq!(
        roles(r),
        [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "tool",
            "user",
            "system",
            "user"
        ]
    );
    let system = r.messages[0].text().unwrap();
    assert!(
        system.starts_with("You are a command line coding assistant")
            && system.contains("\n\nFollow the user's")
    );
    // Thinking is dropped; text and the call stay in one assistant message.
    assert_eq!(r.messages[2].text(), Some("I'll look at the tokenizer."));
    assert_eq!(
        r.messages[2].extra["tool_calls"][0]["function"]["arguments"],
        r#"{"file_path":"/home/dev/parser/src/tokenizer.rs"}"#
    );
    assert_eq!(r.messages[6].extra["tool_call_id"], "toolu_01MnOpQr");
    assert!(r.messages[6]
        .text()
        .unwrap()
        .starts_with("Error: error[E0425]"));
    assert!(r.messages[7]
        .text()
        .unwrap()
        .contains("The todo list is empty."));
    assert_eq!(
        r.messages[8].text(),
        Some("The user switched the session to auto-accept edits.")
    );
    // A name longer than chat's 64 characters is shortened, and mapped back.
    let long = "mcp__github__create_pull_request_review_with_a_very_long_descriptive_name";
    let chat_name = r.tools.as_ref().unwrap()[20]["function"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(chat_name.len(), 64);
    assert_eq!(t.meta.tool_name(&chat_name), long);

    // count_tokens: the same estimate, without max_tokens.
    let mut no_max = raw.clone();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let n = messages::count_tokens(no_max.to_string().as_bytes()).unwrap();
    assert_eq!(n, t.meta.prompt_estimate());
    assert!(n > 20_000, "{n}");
}

#[test]
fn claude_code_answer_streams_as_the_sdk_accumulates_it() {
    let req = messages::parse_request(&fixture("claude_code_messages.json")).unwrap();
    let t = messages::to_chat(&req).unwrap();
    let long = "mcp__github__create_pull_request_review_with_a_very_long_descriptive_name";
    let chat_long = t.request.tools.as_ref().unwrap()[20]["function"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = LlmResponse {
        content: "Running the tests again.".into(),
        reasoning_content: Some("The helper is missing.".into()),
        tool_calls: vec![
            call(
                0,
                "call_1",
                "Bash",
                r#"{"command":"cargo test","description":"Run tests"}"#,
            ),
            call(
                1,
                "call_2",
                &chat_long,
                r#"{"owner":"dev","repo":"parser","pull_number":1,"event":"COMMENT"}"#,
            ),
        ],
        finish_reason: Some("tool_calls".into()),
        model: "glm-4.6".into(),
        usage: Usage {
            cached_prompt_tokens: Some(20_000),
            cache_write_tokens: Some(1_000),
            cache_write_1h_tokens: None,
            ..Usage::new(25_000, 80)
        },
        usage_source: UsageSource::Measured,
        ..Default::default()
    };
    let plain = messages::message_object("msg_01XyZ", &t.meta, &answer);
    assert_eq!(plain["stop_reason"], "tool_use");
    assert_eq!(
        plain["usage"],
        json!({"input_tokens": 4000, "output_tokens": 80, "cache_read_input_tokens": 20000, "cache_creation_input_tokens": 1000})
    );
    let kinds: Vec<&str> = plain["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"]);
    assert_eq!(plain["content"][3]["name"], long);

    let mut s =
        messages::MessagesStream::new("msg_01XyZ", t.meta.clone(), t.meta.prompt_estimate());
    let mut ev = s.start();
    ev.push(s.ping());
    for d in [
        StreamDelta {
            reasoning: Some("The helper ".into()),
            ..Default::default()
        },
        StreamDelta {
            reasoning: Some("is missing.".into()),
            ..Default::default()
        },
        StreamDelta {
            content: Some("Running the tests again.".into()),
            ..Default::default()
        },
        frag(0, Some("call_1"), Some("Bash"), ""),
        frag(0, None, None, r#"{"command":"cargo test","#),
        frag(0, None, None, r#""description":"Run tests"}"#),
        frag(
            1,
            Some("call_2"),
            Some(&chat_long),
            r#"{"owner":"dev","repo":"parser","pull_number":1,"event":"COMMENT"}"#,
        ),
        StreamDelta {
            finish_reason: Some("tool_calls".into()),
            ..Default::default()
        },
    ] {
        ev.extend(s.delta(&d));
    }
    ev.extend(s.finish(&answer));
    let wire = sse::write_all(&ev);
    assert!(String::from_utf8_lossy(&wire).starts_with("event: message_start\ndata: "));
    let fin = messages::check_stream(&sse::parse_sse(&wire)).unwrap();
    assert_eq!(fin.thinking, "The helper is missing.");
    assert_eq!(fin.text, "Running the tests again.");
    assert_eq!(
        fin.tool_calls[0].input,
        json!({"command": "cargo test", "description": "Run tests"})
    );
    assert_eq!(fin.tool_calls[1].name, long);
    assert_eq!(fin.stop_reason.as_deref(), Some("tool_use"));
    assert_eq!(fin.usage["input_tokens"], 4000);
    assert_eq!(fin.usage["cache_read_input_tokens"], 20000);
    let blocks: Vec<Value> = plain["content"].as_array().unwrap().clone();
    assert_eq!(blocks[2]["input"], fin.tool_calls[0].input);
}

#[test]
fn claude_code_enabled_thinking_maps_by_budget() {
    let mut raw: Value = serde_json::from_slice(&fixture("claude_code_messages.json")).unwrap();
    raw["thinking"] = json!({"type": "enabled", "budget_tokens": 4000});
    raw.as_object_mut().unwrap().remove("output_config");
    let req = messages::parse_request(raw.to_string().as_bytes()).unwrap();
    assert_eq!(
        messages::to_chat(&req)
            .unwrap()
            .request
            .reasoning_effort
            .as_deref(),
        Some("low")
    );
}
