//! Signature families (SPEC §23.5) through `polygw serve`: a conversation whose history
//! one family signed fails over to a source of another family with no 400 — in a tool
//! loop and between turns, plain and streamed, on Messages and on Responses — and
//! reaches its own family with its signatures intact. The mock signs per group and
//! refuses what the providers refuse (another group's signature or encrypted content, a
//! modified latest-assistant thinking block, an open tool loop without its thinking
//! under manual thinking), with their wording: any 400 shows in its request log.

use polygw::core::source::SourceApi;
use polygw::SourceConfig;
use polygw_mock_upstream::{thinking_signature, Behavior, MockUpstream, ToolCallSpec};
use serde_json::{json, Value};

use crate::native::{
    events, messages_scope, messages_source, post_messages, recording_mock, responses_source,
};
use crate::support::*;

/// A source of signature group `group` answering with `b`, its mock signing as `group`.
async fn signer(
    name: &str,
    group: &str,
    api: SourceApi,
    b: Behavior,
) -> (MockUpstream, SourceConfig) {
    let m = recording_mock(Behavior {
        signing_group: Some(group.to_string()),
        ..b
    })
    .await;
    let mut s = match api {
        SourceApi::Responses => responses_source(name, &m),
        _ => messages_source(name, &m),
    };
    s.signature_group = Some(group.to_string());
    (m, s)
}

fn thinking_tool() -> Behavior {
    Behavior {
        reasoning: vec!["I should".into(), " call the tool".into()],
        tool_call: Some(ToolCallSpec {
            id: "toolu_1".into(),
            ..ToolCallSpec::default()
        }),
        ..Behavior::text(&[])
    }
}

fn thinking_text(chunks: &[&str]) -> Behavior {
    Behavior {
        reasoning: vec!["Thinking it over".into()],
        ..Behavior::text(chunks)
    }
}

/// The assistant message's content blocks of a Messages answer, plain or streamed
/// (rebuilt from its events as an SDK does).
fn content_of(stream: bool, text: &str) -> Vec<Value> {
    if !stream {
        let v: Value = serde_json::from_str(text).unwrap();
        return v["content"].as_array().unwrap().clone();
    }
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    for (name, d) in events(text) {
        match name.as_str() {
            "content_block_start" => {
                blocks.push(d["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                let i = d["index"].as_u64().unwrap() as usize;
                let delta = &d["delta"];
                let b = &mut blocks[i];
                match delta["type"].as_str().unwrap() {
                    "thinking_delta" => {
                        let t = b["thinking"].as_str().unwrap().to_string();
                        b["thinking"] = json!(t + delta["thinking"].as_str().unwrap());
                    }
                    "signature_delta" => b["signature"] = delta["signature"].clone(),
                    "text_delta" => {
                        let t = b["text"].as_str().unwrap().to_string();
                        b["text"] = json!(t + delta["text"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        json_parts[i].push_str(delta["partial_json"].as_str().unwrap())
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                let i = d["index"].as_u64().unwrap() as usize;
                if blocks[i]["type"] == "tool_use" && !json_parts[i].is_empty() {
                    blocks[i]["input"] = serde_json::from_str(&json_parts[i]).unwrap();
                }
            }
            _ => {}
        }
    }
    blocks
}

fn statuses(m: &MockUpstream) -> Vec<u16> {
    m.requests().iter().map(|r| r.status).collect()
}

/// Messages: turn 1 and its tool round on A (signatures intact), A down: the tool
/// round and the next turn on B (another family) with no 400 — A's thinking gone from
/// what B receives, manual thinking off for the open tool loop — then A back: A's own
/// turn reaches it intact, B's latest thinking cleared whole.
#[tokio::test]
async fn a_messages_conversation_keeps_its_signatures_in_their_family() {
    for stream in [false, true] {
        let (a, mut sa) = signer(
            &format!("a{stream}"),
            "fam-a",
            SourceApi::Messages,
            thinking_tool(),
        )
        .await;
        let (b, sb) = signer(
            &format!("b{stream}"),
            "fam-b",
            SourceApi::Messages,
            thinking_tool(),
        )
        .await;
        sa.priority = 0;
        let sb = sb.with_priority(1);
        let s = messages_scope(vec![sa, sb], None).await;
        let mut messages = vec![json!({"role": "user", "content": "weather in Paris?"})];
        let request = |messages: &Vec<Value>| {
            json!({
                "model": "llm", "max_tokens": 2000, "stream": stream,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                "messages": messages,
            })
        };
        // Turn 1 on A.
        let r = post_messages(&s, &request(&messages)).await;
        assert_eq!(r.status(), 200, "stream={stream}");
        let turn1 = content_of(stream, &r.text().await.unwrap());
        assert_eq!(turn1[0]["type"], "thinking", "{turn1:?}");
        assert_eq!(
            turn1[0]["signature"],
            thinking_signature("fam-a", "I should call the tool")
        );
        messages.push(json!({"role": "assistant", "content": turn1.clone()}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 °C"}]}));
        // The tool round with A up: A receives its own history unchanged.
        let r = post_messages(&s, &request(&messages)).await;
        assert_eq!(r.status(), 200);
        let sent = &a.requests()[1].body;
        assert_eq!(
            sent["messages"][1]["content"],
            json!(turn1),
            "stream={stream}"
        );
        assert_eq!(sent["thinking"]["type"], "enabled");
        let round_a = content_of(stream, &r.text().await.unwrap());
        assert_eq!(statuses(&a), [200, 200]);
        // A down: the same tool round goes to B, without A's thinking, at once.
        a.set_default(Behavior::status(503));
        let r = post_messages(&s, &request(&messages)).await;
        assert_eq!(r.status(), 200, "stream={stream}");
        let round_b = content_of(stream, &r.text().await.unwrap());
        assert_eq!(statuses(&b), [200], "no signature 400 on failover");
        let sent = &b.requests()[0].body;
        assert_eq!(
            sent["messages"][1]["content"],
            json!([turn1[1].clone()]),
            "A's thinking removed, the tool call kept"
        );
        assert!(
            sent.get("thinking").is_none(),
            "manual thinking off for the open loop"
        );
        assert_eq!(
            round_b[0]["signature"],
            thinking_signature("fam-b", "I should call the tool")
        );
        // Between turns: B's answer, then a new question, still on B.
        messages.push(json!({"role": "assistant", "content": round_b.clone()}));
        messages.push(json!({"role": "user", "content": "and tomorrow?"}));
        let r = post_messages(&s, &request(&messages)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(statuses(&b), [200, 200]);
        let sent = &b.requests()[1].body;
        assert_eq!(sent["messages"][1]["content"], json!([turn1[1].clone()]));
        assert_eq!(
            sent["messages"][3]["content"],
            json!(round_b),
            "B's own turn intact"
        );
        assert_eq!(sent["thinking"]["type"], "enabled", "not an open tool loop");
        // A back: its own turn intact, B's latest turn without its thinking.
        a.set_default(Behavior {
            signing_group: Some("fam-a".into()),
            ..thinking_tool()
        });
        let r = post_messages(&s, &request(&messages)).await;
        assert_eq!(r.status(), 200);
        let log = a.requests();
        let last = log.last().unwrap();
        assert_eq!(last.status, 200, "{:?}", statuses(&a));
        assert_eq!(last.body["messages"][1]["content"], json!(turn1));
        assert_eq!(
            last.body["messages"][3]["content"],
            json!([round_b[1].clone()]),
            "B's thinking gone whole from the latest assistant message"
        );
        let _ = round_a;
    }
}

/// Responses, as Codex sends it (stateless, its reasoning items sent back): A's
/// encrypted reasoning does not reach B when A is down; a request without `store` or
/// `include` is sent stateless all the same; `previous_response_id` continues on B.
#[tokio::test]
async fn encrypted_reasoning_stays_in_its_family_and_any_source_continues() {
    for stream in [false, true] {
        let talk = || thinking_text(&["Hi", " there"]);
        let (a, mut sa) = signer(
            &format!("ra{stream}"),
            "org-a",
            SourceApi::Responses,
            talk(),
        )
        .await;
        let (b, sb) = signer(
            &format!("rb{stream}"),
            "org-b",
            SourceApi::Responses,
            talk(),
        )
        .await;
        sa.priority = 0;
        let s = messages_scope(vec![sa, sb.with_priority(1)], None).await;
        let post = |body: Value| {
            let url = format!("{}/responses", s.v1());
            async move {
                http()
                    .post(url)
                    .bearer_auth("k")
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
            }
        };
        // Turn 1 on A, stored by polygw (the client's default `store`).
        let r = post(json!({"model": "llm", "input": "My name is Ann.", "stream": stream})).await;
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let response = if stream {
            events(&text)
                .into_iter()
                .find(|(n, _)| n == "response.completed")
                .unwrap()
                .1["response"]
                .clone()
        } else {
            serde_json::from_str::<Value>(&text).unwrap()
        };
        let sent = &a.requests()[0].body;
        assert_eq!(
            sent["store"], false,
            "a responses source is called stateless"
        );
        assert_eq!(sent["include"], json!(["reasoning.encrypted_content"]));
        let reasoning = response["output"][0].clone();
        assert_eq!(reasoning["type"], "reasoning");
        assert!(reasoning["encrypted_content"]
            .as_str()
            .unwrap()
            .starts_with("enc-org-a-"));
        let id = response["id"].as_str().unwrap().to_string();
        // A down: previous_response_id continues on B, A's reasoning left out.
        a.set_default(Behavior::status(503));
        let r = post(
            json!({"model": "llm", "input": "Who am I?", "previous_response_id": id,
            "stream": stream}),
        )
        .await;
        assert_eq!(r.status(), 200, "stream={stream}");
        assert_eq!(
            statuses(&b),
            [200],
            "no invalid_encrypted_content on failover"
        );
        let input = b.requests()[0].body["input"].as_array().unwrap().clone();
        let kinds: Vec<&str> = input.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["message", "message", "message"], "{input:#?}");
        // Codex-style: the client sends A's items back itself; B gets them without A's
        // encrypted reasoning; its own pass.
        let b_reasoning = {
            let r = post(json!({"model": "llm", "store": false, "stream": false,
                "include": ["reasoning.encrypted_content"], "input": "hello"}))
            .await;
            let v: Value = r.json().await.unwrap();
            v["output"][0].clone()
        };
        assert!(b_reasoning["encrypted_content"]
            .as_str()
            .unwrap()
            .starts_with("enc-org-b-"));
        let input = json!([
            {"type": "message", "role": "user", "content": "My name is Ann."},
            reasoning,
            {"type": "message", "role": "user", "content": "hello"},
            b_reasoning,
            {"type": "message", "role": "user", "content": "Who am I?"}
        ]);
        let r = post(json!({"model": "llm", "store": false, "stream": stream,
            "include": ["reasoning.encrypted_content"], "input": input}))
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(statuses(&b), [200, 200, 200]);
        let sent = b.requests()[2].body["input"].clone();
        assert_eq!(
            sent,
            json!([input[0], input[2], input[3], input[4]]),
            "only A's reasoning removed"
        );
    }
}

/// Hedge legs prefer the conversation's family: with A slow to its first token, the
/// hedge goes to A's sibling A2 (same family), not to B listed before it.
#[tokio::test]
async fn a_hedge_prefers_the_conversations_family() {
    let (a, sa) = signer("ha", "fam-a", SourceApi::Messages, thinking_text(&["one"])).await;
    let (b, sb) = signer("hb", "fam-b", SourceApi::Messages, thinking_text(&["two"])).await;
    let (a2, sa2) = signer(
        "ha2",
        "fam-a",
        SourceApi::Messages,
        thinking_text(&["three"]),
    )
    .await;
    let scope = scope_with(
        "LLM",
        polygw::ScopeKind::Chat,
        vec![sa, sb.with_priority(1), sa2.with_priority(1)],
        None,
        |s| {
            s.hedge.after = polygw::core::hedge::ThresholdSetting::Static(
                std::time::Duration::from_millis(200),
            );
            s.hedge.max_extra = 1;
        },
    )
    .await;
    let s = serve(vec![scope]).await;
    // Turn 1 on A: its signature is remembered as fam-a's.
    let q = |messages: Value| {
        json!({"model": "llm", "max_tokens": 500, "stream": true,
            "thinking": {"type": "adaptive"}, "messages": messages})
    };
    let r = post_messages(&s, &q(json!([{"role": "user", "content": "hi"}]))).await;
    let turn1 = content_of(true, &r.text().await.unwrap());
    assert_eq!(
        turn1[0]["signature"],
        thinking_signature("fam-a", "Thinking it over")
    );
    // Turn 2: A slow; the hedge goes to A2.
    a.set_default(Behavior {
        signing_group: Some("fam-a".into()),
        ttft_ms: 3000.0,
        ..thinking_text(&["one"])
    });
    let r = post_messages(
        &s,
        &q(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": turn1},
            {"role": "user", "content": "more"}
        ])),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("three"), "{text}");
    assert_eq!(a2.requests().len(), 1);
    assert!(b.requests().is_empty(), "the other family was not picked");
    assert_eq!(
        a2.requests()[0].body["messages"][1]["content"][0]["type"],
        "thinking"
    );
}

/// Shared across replicas (SPEC §23.5, like affinity): two proxies on one Redis — what
/// the first passed from A is known to the second, whose failover to B removes it.
#[tokio::test]
async fn a_second_replica_knows_the_families_the_first_passed() {
    let Some(redis) = polygw_testkit::services::redis_url() else {
        return;
    };
    let (a, sa) = signer("pa", "fam-a", SourceApi::Messages, thinking_tool()).await;
    let (b, sb) = signer("pb", "fam-b", SourceApi::Messages, thinking_tool()).await;
    let name = polygw_testkit::services::unique_name("FAMR");
    let replica = || {
        let (sources, redis, name) = (
            vec![sa.clone(), sb.clone().with_priority(1)],
            redis.clone(),
            name.clone(),
        );
        async move {
            let scope = scope_with(&name, polygw::ScopeKind::Chat, sources, None, |s| {
                s.redis_url = Some(redis.into());
            })
            .await;
            serve(vec![scope]).await
        }
    };
    let (one, two) = (replica().await, replica().await);
    let model = name.to_lowercase();
    let request = |messages: &Value| {
        json!({"model": model, "max_tokens": 2000,
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": messages})
    };
    let mut messages = json!([{"role": "user", "content": "weather?"}]);
    let r = post_messages(&one, &request(&messages)).await;
    assert_eq!(r.status(), 200);
    let turn = content_of(false, &r.text().await.unwrap());
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": turn.clone()}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"}]}),
    ]);
    a.set_default(Behavior::status(503));
    let r = post_messages(&two, &request(&messages)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        statuses(&b),
        [200],
        "the second replica removed A's thinking up front"
    );
    assert_eq!(
        b.requests()[0].body["messages"][1]["content"],
        json!([turn[1].clone()])
    );
}
