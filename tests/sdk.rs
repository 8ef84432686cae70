//! The official client SDKs against `polygw serve` (the spawned program), as real
//! clients (SPEC §18, issue 23): openai-python's Responses API, anthropic-python's
//! Messages API, both against faulty upstreams (a cut, a stall, a malformed event, a
//! 429 with Retry-After, 500 everywhere), and a smaller set with openai-node and
//! anthropic-node. The SDKs are the pinned ones `.ci/run` installs
//! (tests/python/requirements.txt into target/sdk-venv, tests/node/package-lock.json
//! into tests/node/node_modules); without them a test prints why and skips, and under
//! `CI=true` it fails.
//!
//! Each test starts its mock upstreams and one `polygw serve`, runs one script
//! (tests/python/*.py, tests/node/sdk.mjs) that asserts what the SDK sees and prints a
//! JSON summary, and checks that summary against the mocks' request logs: what reached
//! the upstream, and the exact answer the faulty primary had planned.
//!
//! Faults are decided by the scripts, never by a race: stalls are 30 s against a 0.3 s
//! `STALL_AFTER_S`; a 429's Retry-After is either beyond `--max-wait-s` (answered at
//! once) or 4 s within it (waited out by polygw, then answered).

mod support;

use std::path::PathBuf;
use std::time::Duration;

use polygw_mock_upstream::{
    Behavior, EndKind, Fault, MockUpstream, PrefillOutcome, PrefillPolicy, RecordedRequest,
    RetryAfter, Stall, ToolCallSpec,
};
use serde_json::{json, Value};
use support::sdk::{self, ScriptRun};
use support::{mock, serve_args, source, Serve};

const KEY: &str = "sdk-client-key";
/// The most one script may take (they take seconds).
const SCRIPT_LIMIT: Duration = Duration::from_secs(90);

fn var(k: &str, v: &str) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// `polygw serve ARGS…` over this environment, with the client key.
fn start(args: &[&str], mut env: Vec<(String, String)>) -> Serve {
    env.push(var("POLYGW_PROXY_KEYS", KEY));
    let mut all = vec!["--grace-s", "5"];
    all.extend_from_slice(args);
    serve_args(&all, &env)
}

/// Runs `tests/python/SCRIPT ARGS…` with the venv's Python against `s`.
async fn python(py: PathBuf, test: &str, script: &str, args: &[&str], s: &Serve) -> ScriptRun {
    let mut argv = vec![sdk::python_script(script).display().to_string()];
    argv.extend(args.iter().map(|a| a.to_string()));
    let run = sdk::run(
        py,
        argv,
        vec![
            var("POLYGW_BASE", &format!("{}/v1", s.base)),
            var("POLYGW_ROOT", &s.base),
            var("POLYGW_KEY", KEY),
        ],
        SCRIPT_LIMIT,
    )
    .await;
    eprintln!("{test}: {script} {args:?} took {:?}", run.took);
    run
}

/// The text the SDK scripts' `plain` scope answers.
fn hello() -> Behavior {
    Behavior::text(&["Hello", " from", " polygw"])
}

/// A `tools` mock: get_weather({"city": "Paris"}) in 3 fragments for the next request,
/// then the answer.
async fn tools_mock() -> MockUpstream {
    let m = mock(Behavior::text(&["It is 21 °C", " in Paris."])).await;
    m.push_script(Behavior {
        chunk_count: Some(0),
        tool_call: Some(ToolCallSpec {
            id: "call_weather_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
            fragments: 3,
        }),
        ..Behavior::default()
    });
    m
}

fn messages(r: &RecordedRequest) -> Vec<Value> {
    r.body["messages"].as_array().cloned().unwrap_or_default()
}

fn roles(r: &RecordedRequest) -> Vec<String> {
    messages(r)
        .iter()
        .map(|m| m["role"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// The text of a chat message (a string, or text parts).
fn text_of(m: &Value) -> String {
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The tool loop's second upstream request: the question, the assistant's call, the
/// tool's result under the same id.
fn assert_tool_round_trip(second: &RecordedRequest, call_id: &str) {
    let msgs = messages(second);
    assert_eq!(roles(second), ["user", "assistant", "tool"], "{msgs:#?}");
    let call = &msgs[1]["tool_calls"][0];
    assert_eq!(call["id"], call_id, "{msgs:#?}");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(msgs[2]["tool_call_id"], call_id);
    assert_eq!(text_of(&msgs[2]), r#"{"temp_c": 21}"#);
    let tools = second.body["tools"]
        .as_array()
        .expect("tools sent upstream");
    assert_eq!(tools[0]["function"]["name"], "get_weather");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_responses_api() {
    let test = "openai_python_responses_api";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let tools = tools_mock().await;
    let json_mock = mock(Behavior::text(&[
        r#"{"city": "Paris", "#,
        r#""temp_c": 21}"#,
    ]))
    .await;
    let mut env = source("PLAIN", "p", &plain, &[]);
    env.extend(source("TOOLS", "t", &tools, &[]));
    env.extend(source("JSON", "j", &json_mock, &[]));
    let s = start(&[], env);
    let run = python(py, test, "responses.py", &[], &s).await;
    let out = run.json();

    // Plain, streamed, then the two turns of previous_response_id: 4 requests.
    let log = plain.wait_for_ended(4, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 4, "{log:#?}");
    assert!(!log[0].stream && log[1].stream);
    assert_eq!(roles(&log[0]), ["system", "user"], "instructions → system");
    assert_eq!(text_of(&messages(&log[0])[0]), "Be brief.");
    // previous_response_id: the stored first turn (question and answer), then the
    // new question.
    let second = &log[3];
    let msgs = messages(second);
    assert_eq!(roles(second), ["user", "assistant", "user"], "{msgs:#?}");
    assert_eq!(text_of(&msgs[0]), "My name is Ann.");
    assert_eq!(text_of(&msgs[1]), "Hello from polygw");
    assert_eq!(text_of(&msgs[2]), "What is my name?");
    assert!(out["first_id"].as_str().unwrap().starts_with("resp_"));

    // The tool loop.
    let tlog = tools.wait_for_ended(2, Duration::from_secs(10)).await;
    assert_eq!(tlog.len(), 2);
    assert_eq!(out["tool_call_id"], "call_weather_1");
    assert_tool_round_trip(&tlog[1], "call_weather_1");

    // responses.parse: the Pydantic model's schema went upstream as json_schema.
    let jlog = json_mock.wait_for_ended(1, Duration::from_secs(10)).await;
    let rf = &jlog[0].body["response_format"];
    assert_eq!(rf["type"], "json_schema", "{:#}", jlog[0].body);
    assert_eq!(rf["json_schema"]["name"], "Weather");
    let props = &rf["json_schema"]["schema"]["properties"];
    assert!(
        props["city"].is_object() && props["temp_c"].is_object(),
        "{rf:#}"
    );
    assert_eq!(out["parsed"], json!({"city": "Paris", "temp_c": 21}));
}

/// The Responses API against sources that speak it (issue 35): the same script,
/// passed through — what reached the mocks is the SDK's own body (`instructions`, the
/// tool loop's items, `text.format`), a `previous_response_id` polygw stored expanded
/// into the stateless request's input, and the SDK's checks of ids, events, stored
/// responses and parsing pass on the sources' own answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_to_responses_sources() {
    let test = "openai_python_to_responses_sources";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let tools = tools_mock().await;
    let json_mock = mock(Behavior::text(&[
        r#"{"city": "Paris", "#,
        r#""temp_c": 21}"#,
    ]))
    .await;
    let api = ("API", "responses");
    let mut env = source("PLAIN", "p", &plain, &[api]);
    env.extend(source("TOOLS", "t", &tools, &[api]));
    env.extend(source("JSON", "j", &json_mock, &[api]));
    let s = start(&[], env);
    let run = python(py, test, "responses.py", &[], &s).await;
    let out = run.json();

    let log = plain.wait_for_ended(4, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 4, "{log:#?}");
    assert!(log
        .iter()
        .all(|r| r.path == "/v1/responses" && r.authorization));
    assert!(!log[0].stream && log[1].stream);
    assert_eq!(
        log[0].body["instructions"], "Be brief.",
        "as sent: {:#}",
        log[0].body
    );
    assert_eq!(log[0].body["input"], "hi");
    assert_eq!(log[0].body["model"], "model-p");
    // previous_response_id: expanded from polygw's store into the input.
    let second = &log[3].body;
    assert!(second.get("previous_response_id").is_none(), "{second:#}");
    let input = second["input"].as_array().expect("expanded input");
    let kinds: Vec<(&str, &str)> = input
        .iter()
        .map(|i| {
            (
                i["type"].as_str().unwrap_or("message"),
                i["role"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("message", "user"),
            ("message", "assistant"),
            ("message", "user")
        ],
        "{second:#}"
    );
    assert!(out["first_id"].as_str().unwrap().starts_with("resp_mock-"));

    let tlog = tools.wait_for_ended(2, Duration::from_secs(10)).await;
    assert_eq!(tlog.len(), 2);
    assert_eq!(out["tool_call_id"], "call_weather_1");
    let items = tlog[1].body["input"].as_array().unwrap();
    assert!(
        items
            .iter()
            .any(|i| i["type"] == "function_call_output" && i["call_id"] == "call_weather_1"),
        "{items:#?}"
    );
    assert_eq!(tlog[1].body["store"], false);

    let jlog = json_mock.wait_for_ended(1, Duration::from_secs(10)).await;
    assert_eq!(
        jlog[0].body["text"]["format"]["type"], "json_schema",
        "{:#}",
        jlog[0].body
    );
    assert_eq!(out["parsed"], json!({"city": "Paris", "temp_c": 21}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_messages_api() {
    let test = "anthropic_python_messages_api";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let tools = tools_mock().await;
    let mut env = source("PLAIN", "p", &plain, &[]);
    env.extend(source("TOOLS", "t", &tools, &[]));
    let s = start(&[], env);
    let run = python(py, test, "messages.py", &[], &s).await;
    let out = run.json();

    let log = plain.wait_for_ended(2, Duration::from_secs(10)).await;
    assert_eq!(
        log.len(),
        2,
        "count_tokens makes no upstream call: {log:#?}"
    );
    assert_eq!(roles(&log[0]), ["system", "user"]);
    assert_eq!(text_of(&messages(&log[0])[0]), "You are terse.");
    assert_eq!(log[0].body["max_tokens"], 64, "{:#}", log[0].body);
    assert!(!log[0].stream && log[1].stream);

    let tlog = tools.wait_for_ended(2, Duration::from_secs(10)).await;
    assert_eq!(tlog.len(), 2);
    assert_eq!(out["tool_use_id"], "call_weather_1");
    assert_tool_round_trip(&tlog[1], "call_weather_1");
    assert!(out["count_tokens"].as_u64().unwrap() > 0);
}

/// The Messages API against sources that speak it (issue 35): the same script as
/// above, now passed through — what reached the mocks is the SDK's own body, tools and
/// tool results in Anthropic's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_to_messages_sources() {
    let test = "anthropic_python_to_messages_sources";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let tools = tools_mock().await;
    let mut env = source("PLAIN", "p", &plain, &[("API", "messages")]);
    env.extend(source("TOOLS", "t", &tools, &[("API", "messages")]));
    let s = start(&[], env);
    let run = python(py, test, "messages.py", &[], &s).await;
    let out = run.json();

    // Two turns, then count_tokens forwarded to the source (SPEC §23.7).
    let log = plain.wait_for_ended(3, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 3, "{log:#?}");
    assert!(log[..2]
        .iter()
        .all(|r| r.path == "/v1/messages" && r.x_api_key));
    assert_eq!(log[2].path, "/v1/messages/count_tokens");
    assert_eq!(
        out["count_tokens"], 9,
        "the mock source counts the messages: ⌈33 / 4⌉"
    );
    // The SDK's body as it sent it: `system` a string, the model the source's.
    assert_eq!(log[0].body["system"], "You are terse.", "{:#}", log[0].body);
    assert_eq!(log[0].body["model"], "model-p");
    assert_eq!(
        log[0].body["messages"],
        json!([{"role": "user", "content": "hi"}])
    );
    assert!(!log[0].stream && log[1].stream);
    assert!(
        log[0]
            .anthropic_headers
            .iter()
            .any(|(k, _)| k == "anthropic-version"),
        "{:?}",
        log[0].anthropic_headers
    );

    let tlog = tools.wait_for_ended(2, Duration::from_secs(10)).await;
    assert_eq!(tlog.len(), 2);
    assert_eq!(out["tool_use_id"], "call_weather_1");
    let msgs = messages(&tlog[1]);
    assert_eq!(roles(&tlog[1]), ["user", "assistant", "user"], "{msgs:#?}");
    assert_eq!(msgs[1]["content"][0]["type"], "tool_use", "{msgs:#?}");
    assert_eq!(msgs[1]["content"][0]["input"], json!({"city": "Paris"}));
    assert_eq!(msgs[2]["content"][0]["type"], "tool_result");
    assert_eq!(msgs[2]["content"][0]["tool_use_id"], "call_weather_1");
    assert_eq!(tlog[1].body["tools"][0]["name"], "get_weather");
}

/// Faults before the first content event on native sources, through the official SDK
/// of their API: each is rescued by the fallback (the first token's hedge included); a
/// content rejection reaches the SDK with the source's wording; a source's 401 is a 502
/// the SDK must not retry.
async fn sdk_to_faulty_native_sources(test: &str, sdk_name: &str, api: &str) {
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let rescued = || Behavior::text(&["Rescued", " by", " the", " fallback"]);
    let wording = "prompt is too long: 210000 tokens > 200000 maximum";
    let overloaded = if api == "messages" { 529 } else { 500 };
    let primaries = [
        ("OVERLOADED", Behavior::status(overloaded)),
        (
            "OVERLOADED_EVENT",
            Behavior::fault(Fault::ErrorFrameAt {
                chunk: 0,
                error: None,
            }),
        ),
        (
            "LIMITED",
            Behavior {
                retry_after: Some(RetryAfter::Seconds(30.0)),
                ..Behavior::status(429)
            },
        ),
        (
            "CUT_EARLY",
            Behavior::fault(Fault::ResetAfter { chunks: 0 }),
        ),
        (
            "SLOW_FIRST",
            Behavior {
                ttft_ms: 20_000.0,
                ..rescued()
            },
        ),
        // Mid-answer (SPEC §23.6): two chunks reach the client (40 ms apart), then the
        // cut or the error event; the fallback's replay of the same answer continues it.
        (
            "CUT_MID",
            Behavior {
                fault: Some(Fault::ResetAfter { chunks: 2 }),
                gap_ms: 40.0,
                ..rescued()
            },
        ),
        (
            "OVERLOADED_MID",
            Behavior {
                fault: Some(Fault::ErrorFrameAt {
                    chunk: 2,
                    error: None,
                }),
                gap_ms: 40.0,
                ..rescued()
            },
        ),
    ];
    let mut env = Vec::new();
    let mut mocks = Vec::new();
    for (scope, primary) in primaries {
        let a = mock(primary).await;
        let b = mock(rescued()).await;
        env.extend(source(scope, "a", &a, &[("API", api), ("PRIORITY", "0")]));
        env.extend(source(scope, "b", &b, &[("API", api), ("PRIORITY", "1")]));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_BASE_S"), "0.01"));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_MAX_S"), "0.02"));
        mocks.push((scope, a, b));
    }
    env.push(var("SLOW_FIRST__HEDGE__AFTER_S", "0.5"));
    // Mid-answer on a fallback with `PREFILL=assistant` (SPEC §23.6): a `messages`
    // fallback continues the delivered text by prefill (thinking is off and "Rescued
    // by" ends in no whitespace); one that refuses prefill is replayed after its 400.
    // A `responses` fallback has no prefill: both are replays.
    let mid_cut = || Behavior {
        fault: Some(Fault::ResetAfter { chunks: 2 }),
        gap_ms: 40.0,
        ..rescued()
    };
    let prefill_scopes = [
        ("PREFILL_MID", rescued()),
        (
            "PREFILL_REFUSED",
            rescued().with_prefill(PrefillPolicy::reject()),
        ),
    ];
    for (scope, fallback) in prefill_scopes {
        let a = mock(mid_cut()).await;
        let b = mock(fallback).await;
        env.extend(source(scope, "a", &a, &[("API", api), ("PRIORITY", "0")]));
        env.extend(source(
            scope,
            "b",
            &b,
            &[("API", api), ("PRIORITY", "1"), ("PREFILL", "assistant")],
        ));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_BASE_S"), "0.01"));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_MAX_S"), "0.02"));
        mocks.push((scope, a, b));
    }
    let rejected = mock(Behavior {
        error_message: Some(wording.into()),
        ..Behavior::status(400)
    })
    .await;
    env.extend(source("REJECTED", "r", &rejected, &[("API", api)]));
    let badkey = mock(Behavior::status(401)).await;
    env.extend(source("BADKEY", "k", &badkey, &[("API", api)]));
    let s = start(&["--max-wait-s", "10"], env);
    let run = python(py, test, "native_faults.py", &[sdk_name], &s).await;
    let out = run.json();
    assert!(
        run.took < Duration::from_secs(20),
        "the 20 s first token was hedged"
    );
    for (scope, a, b) in &mocks {
        let e = &out[scope.to_ascii_lowercase()];
        assert_eq!(e["stream"], "Rescued by the fallback", "{scope}: {out:#}");
        if *scope != "SLOW_FIRST" {
            assert_eq!(e["plain"], "Rescued by the fallback", "{scope}: {out:#}");
        }
        assert!(!a.requests().is_empty(), "{scope}: the primary was tried");
        assert!(!b.requests().is_empty(), "{scope}: the fallback answered");
    }
    assert!(
        out["slow_first"]["stream_s"].as_f64().unwrap() < 10.0,
        "{out:#}"
    );
    let prefills = |scope: &str| -> Vec<(u16, Option<PrefillOutcome>)> {
        let (_, _, b) = mocks.iter().find(|(s, _, _)| *s == scope).unwrap();
        b.requests()
            .iter()
            .map(|r| (r.status, r.prefill.as_ref().map(|p| p.outcome)))
            .collect()
    };
    let (mid, refused) = (prefills("PREFILL_MID"), prefills("PREFILL_REFUSED"));
    if api == "messages" {
        assert!(
            mid.contains(&(200, Some(PrefillOutcome::Continued))),
            "the streamed cut is continued by prefill: {mid:?}"
        );
        assert!(
            mid.iter().all(|(status, _)| *status == 200),
            "never a 400: {mid:?}"
        );
        assert_eq!(
            refused.first(),
            Some(&(400, Some(PrefillOutcome::Rejected))),
            "{refused:?}"
        );
        assert!(
            refused[1..].iter().all(|r| *r == (200, None)),
            "refused once, replayed since: {refused:?}"
        );
    } else {
        assert!(
            mid.iter().chain(&refused).all(|r| *r == (200, None)),
            "a responses source is replayed: {mid:?} {refused:?}"
        );
    }
    for how in ["plain", "stream"] {
        let e = &out[format!("rejected_{how}")];
        assert_eq!(e["class"], "BadRequestError", "{e:#}");
        assert_eq!(e["status"], 400);
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["message"], wording, "unmodified: {e:#}");
        let e = &out[format!("badkey_{how}")];
        assert_eq!(e["status"], 502, "{e:#}");
        assert_eq!(e["should_retry"], "false", "{e:#}");
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains("k-0") && !msg.contains("upstream-secret"),
            "{msg}"
        );
    }
}

/// [`sdk_to_faulty_native_sources`]: anthropic-python to `messages` sources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_to_faulty_messages_sources() {
    let test = "anthropic_python_to_faulty_messages_sources";
    sdk_to_faulty_native_sources(test, "anthropic", "messages").await;
}

/// [`sdk_to_faulty_native_sources`]: openai-python's Responses API to `responses`
/// sources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_to_faulty_responses_sources() {
    let test = "openai_python_to_faulty_responses_sources";
    sdk_to_faulty_native_sources(test, "openai", "responses").await;
}

/// anthropic-node to `messages` sources (issue 35): plain and streamed answers as the
/// source sent them, a 529 rescued by the fallback, a streamed tool round passed
/// through, a 429 with its hint; and openai-node's Responses API to a `responses`
/// source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_sdks_to_native_sources() {
    let test = "node_sdks_to_native_sources";
    let Some(node) = sdk::node_sdks(test) else {
        return;
    };
    let native = mock(hello()).await;
    let tools = tools_mock().await;
    let overloaded = mock(Behavior::status(529)).await;
    let fallback = mock(hello()).await;
    let limited = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    })
    .await;
    let api = ("API", "messages");
    let mut env = source("NATIVE", "n", &native, &[api]);
    env.extend(source("TOOLS", "t", &tools, &[api]));
    env.extend(source(
        "OVERLOADED",
        "a",
        &overloaded,
        &[api, ("PRIORITY", "0")],
    ));
    env.extend(source(
        "OVERLOADED",
        "b",
        &fallback,
        &[api, ("PRIORITY", "1")],
    ));
    env.push(var("OVERLOADED__RETRY__BACKOFF_BASE_S", "0.01"));
    env.extend(source("LIMITED", "l", &limited, &[api]));
    let responses = mock(hello()).await;
    env.extend(source(
        "RESPONSES",
        "r",
        &responses,
        &[("API", "responses")],
    ));
    let s = start(&["--max-wait-s", "10"], env);
    let run = sdk::run(
        node,
        vec![sdk::node_dir().join("native.mjs").display().to_string()],
        vec![var("POLYGW_ROOT", &s.base), var("POLYGW_KEY", KEY)],
        SCRIPT_LIMIT,
    )
    .await;
    eprintln!("{test}: native.mjs took {:?}", run.took);
    let out = run.json();
    assert_eq!(out["plain_text"], "Hello from polygw");
    assert_eq!(out["stream_text"], "Hello from polygw");
    assert_eq!(out["tool_use_id"], "call_weather_1");
    assert_eq!(out["tool_answer"], "It is 21 °C in Paris.");
    assert_eq!(out["limited"]["status"], 429, "{out:#}");
    let ra: u64 = out["limited"]["retry_after"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((20..=30).contains(&ra), "{out:#}");
    assert_eq!(overloaded.requests().len(), 1);
    let tlog = tools.wait_for_ended(2, Duration::from_secs(10)).await;
    let msgs = messages(&tlog[1]);
    assert_eq!(msgs[1]["content"][0]["type"], "tool_use", "{msgs:#?}");
    assert!(tlog.iter().all(|r| r.path == "/v1/messages" && r.stream));
    assert_eq!(out["responses_text"], "Hello from polygw");
    assert!(responses
        .requests()
        .iter()
        .all(|r| r.path == "/v1/responses"));
}

/// An agent's world: a scope `LLM` of a primary (answers "Hello from polygw") and a
/// fallback (answers "Answered by the fallback") that speak `api`, its models named by
/// `aliases`, served by `polygw serve`; a home directory and a work directory holding
/// `note.txt` (whose secret word is "tangerine").
struct AgentWorld {
    primary: MockUpstream,
    fallback: MockUpstream,
    serve: Serve,
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    /// The scope's telemetry database (SQLite).
    db: String,
    _db_dir: tempfile::TempDir,
}

impl AgentWorld {
    /// The agent sessions and agents on the rows so far (SPEC §24.6), waiting for the
    /// writer: (agent_session_id, agent_id) of each attempt row.
    async fn attribution(&self) -> Vec<(Option<String>, Option<String>)> {
        for _ in 0..100 {
            let rows = polygw_telemetry_sql::read_rows(&self.db, None)
                .await
                .unwrap_or_default();
            if !rows.is_empty() {
                return rows
                    .into_iter()
                    .map(|r| (r.agent_session_id, r.agent_id))
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Vec::new()
    }
}

/// The agents' world: a primary and a fallback of different signature families
/// (fam-a, fam-b; SPEC §23.5), each mock signing as its own and refusing the other's.
async fn agent_world(api: &str, aliases: &str) -> AgentWorld {
    let primary = mock(Behavior {
        signing_group: Some("fam-a".into()),
        ..hello()
    })
    .await;
    let fallback = mock(Behavior {
        signing_group: Some("fam-b".into()),
        ..Behavior::text(&["Answered", " by", " the", " fallback"])
    })
    .await;
    let mut env = source(
        "LLM",
        "a",
        &primary,
        &[
            ("API", api),
            ("PRIORITY", "0"),
            ("SIGNATURE_GROUP", "fam-a"),
        ],
    );
    env.extend(source(
        "LLM",
        "b",
        &fallback,
        &[
            ("API", api),
            ("PRIORITY", "1"),
            ("SIGNATURE_GROUP", "fam-b"),
        ],
    ));
    env.push(var("LLM__MODEL_ALIASES", aliases));
    env.push(var("LLM__RETRY__BACKOFF_BASE_S", "0.01"));
    let db_dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", db_dir.path().join("rows.db").display());
    env.push(var("LLM__TELEMETRY__URL", &db));
    let serve = start(&["--max-wait-s", "10"], env);
    let work = tempfile::tempdir().unwrap();
    std::fs::write(
        work.path().join("note.txt"),
        "the secret word is tangerine\n",
    )
    .unwrap();
    AgentWorld {
        primary,
        fallback,
        serve,
        home: tempfile::tempdir().unwrap(),
        work,
        db,
        _db_dir: db_dir,
    }
}

/// Two sources of different signature families (SPEC §23.5): A (priority 0, fam-a)
/// and B (fam-b), each mock signing as its group and refusing the other's signatures
/// with the provider's 400. Behavior `b` for both, signed.
async fn families_world(api: &str, b: Behavior) -> (MockUpstream, MockUpstream, Serve) {
    let signed = |g: &str| Behavior {
        signing_group: Some(g.to_string()),
        ..b.clone()
    };
    let a = mock(signed("fam-a")).await;
    let bm = mock(signed("fam-b")).await;
    let mut env = source(
        "FAM",
        "a",
        &a,
        &[
            ("API", api),
            ("PRIORITY", "0"),
            ("SIGNATURE_GROUP", "fam-a"),
        ],
    );
    env.extend(source(
        "FAM",
        "b",
        &bm,
        &[
            ("API", api),
            ("PRIORITY", "1"),
            ("SIGNATURE_GROUP", "fam-b"),
        ],
    ));
    env.push(var("FAM__RETRY__BACKOFF_BASE_S", "0.01"));
    (a, bm, start(&[], env))
}

/// The bodies a mock received, as text, and their statuses.
fn bodies(m: &MockUpstream) -> Vec<(u16, String)> {
    m.requests()
        .iter()
        .map(|r| (r.status, r.body.to_string()))
        .collect()
}

/// SPEC §23.5 with the official Python SDKs: a conversation whose history A signed is
/// served by B when A is down — in a tool loop and on the next round, plain and
/// streamed — with no 400 reaching the SDK or sent by B; with A back, A receives its
/// own signatures intact. For Responses: A's encrypted reasoning never reaches B,
/// whether the conversation continues by `previous_response_id` (polygw's store) or
/// the client sends the items back (Codex's way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdks_keep_signatures_in_their_family() {
    let test = "python_sdks_keep_signatures_in_their_family";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Messages: thinking and a tool call in every answer.
    let tool_round = Behavior {
        reasoning: vec!["I should".into(), " call the tool".into()],
        tool_call: Some(ToolCallSpec::default()),
        chunk_count: Some(0),
        ..Behavior::default()
    };
    let (a, b, s) = families_world("messages", tool_round).await;
    let state = dir.path().join("messages.json").display().to_string();
    let phase = |p: &'static str| {
        let (py, state, s) = (py.clone(), state.clone(), &s);
        async move {
            let run = python(py, test, "families.py", &["anthropic", p, &state], s).await;
            assert!(run.ok, "{p}: {}\n{}", run.stdout, run.stderr);
            run.json()
        }
    };
    let start_out = phase("start").await;
    let own_a = polygw_mock_upstream::thinking_signature("fam-a", "I should call the tool");
    assert_eq!(start_out["plain"][0], own_a.as_str());
    assert!(bodies(&a).iter().all(|(st, _)| *st == 200));
    a.set_default(Behavior::status(503));
    let out = phase("failover").await;
    let own_b = polygw_mock_upstream::thinking_signature("fam-b", "I should call the tool");
    assert_eq!(out["stream"][1], own_b.as_str(), "{out}");
    let at_b = bodies(&b);
    assert_eq!(at_b.len(), 4, "two rounds, plain and streamed: {at_b:#?}");
    for (status, body) in &at_b {
        assert_eq!(*status, 200, "B never refused a signature: {body}");
        assert!(!body.contains(&own_a), "A's signature reached B: {body}");
    }
    // The second round on B carries B's own latest turn, intact, with thinking on.
    assert!(at_b[1].1.contains(&own_b) && at_b[1].1.contains(r#""type":"enabled""#));
    a.reset_log();
    a.set_default(Behavior {
        signing_group: Some("fam-a".into()),
        reasoning: vec!["I should".into(), " call the tool".into()],
        tool_call: Some(ToolCallSpec::default()),
        chunk_count: Some(0),
        ..Behavior::default()
    });
    phase("back").await;
    let at_a = bodies(&a);
    assert_eq!(at_a.len(), 2, "{at_a:#?}");
    for (status, body) in &at_a {
        assert_eq!(*status, 200, "{body}");
        assert!(body.contains(&own_a), "A's own signature, intact: {body}");
        assert!(!body.contains(&own_b), "B's signature reached A: {body}");
    }

    // Responses.
    let talk = Behavior {
        reasoning: vec!["Thinking".into()],
        ..Behavior::text(&["Hello", " there"])
    };
    let (a, b, s) = families_world("responses", talk).await;
    let state = dir.path().join("responses.json").display().to_string();
    let run = python(
        py.clone(),
        test,
        "families.py",
        &["openai", "start", &state],
        &s,
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    for (_, body) in bodies(&a) {
        assert!(
            body.contains(r#""store":false"#),
            "called stateless: {body}"
        );
        assert!(body.contains("reasoning.encrypted_content"), "{body}");
    }
    a.set_default(Behavior::status(503));
    let run = python(py, test, "families.py", &["openai", "failover", &state], &s).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    let out = run.json();
    assert!(
        out["plain"][0].as_str().unwrap().starts_with("enc-fam-b-"),
        "{out}"
    );
    let at_b = bodies(&b);
    assert_eq!(at_b.len(), 4, "{at_b:#?}");
    for (status, body) in &at_b {
        assert_eq!(*status, 200, "{body}");
        assert!(
            !body.contains("enc-fam-a-"),
            "A's encrypted reasoning reached B: {body}"
        );
        assert!(
            body.contains("My name is Ann."),
            "the conversation went along: {body}"
        );
    }
}

/// Every client API on every source API with the official SDKs (SPEC §23.3, the 3 × 3
/// table of docs/SERVE.md): openai-python's chat completions and Responses and
/// anthropic-python's Messages, each against scopes of `chat`, `messages` and
/// `responses` sources — a tool round plain and streamed, a 429 on the primary and a
/// cut before the first token, both answered by the fallback. What reached each source
/// is in its own API, with the tool's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdks_on_every_source_api() {
    let test = "python_sdks_on_every_source_api";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let answer = || Behavior::text(&["It is", " 21 °C", " in Paris."]);
    let tool = || Behavior {
        chunk_count: Some(0),
        tool_call: Some(ToolCallSpec {
            id: "call_w1".into(),
            fragments: 2,
            ..ToolCallSpec::default()
        }),
        ..Behavior::default()
    };
    let apis = ["chat", "messages", "responses"];
    let mut env = Vec::new();
    let mut rounds = Vec::new();
    let mut mocks = Vec::new();
    for api in apis {
        let m = mock(answer()).await;
        env.extend(source(
            &format!("SRC_{}", api.to_uppercase()),
            "s",
            &m,
            &[("API", api)],
        ));
        rounds.push((api, m));
        let limited = mock(Behavior {
            retry_after: Some(RetryAfter::Seconds(30.0)),
            ..Behavior::status(429)
        })
        .await;
        let cut = mock(Behavior::fault(Fault::ResetBeforeHeaders)).await;
        for (scope, primary) in [("LIMITED", limited), ("CUT", cut)] {
            let fallback = mock(answer()).await;
            let name = format!("{scope}_{}", api.to_uppercase());
            env.extend(source(
                &name,
                "p",
                &primary,
                &[("API", api), ("PRIORITY", "0")],
            ));
            env.extend(source(
                &name,
                "f",
                &fallback,
                &[("API", api), ("PRIORITY", "1")],
            ));
            env.push(var(&format!("{name}__RETRY__BACKOFF_BASE_S"), "0.01"));
            mocks.push((name, api, primary, fallback));
        }
    }
    let s = start(&[], env);
    for client in ["chat", "responses", "messages"] {
        for (_, m) in &rounds {
            m.reset_log();
            // Two rounds (plain, streamed): a tool call, then the answer.
            m.push_scripts([tool(), answer(), tool(), answer()]);
        }
        let run = python(py.clone(), test, "cross.py", &[client], &s).await;
        assert!(run.ok, "{client}: {}\n{}", run.stdout, run.stderr);
        let out = run.json();
        for (api, m) in &rounds {
            assert_eq!(
                out[format!("src_{api}")],
                json!(["It is 21 °C in Paris.", "It is 21 °C in Paris."]),
                "{client} on {api}"
            );
            let log = m.requests();
            assert_eq!(log.len(), 4, "{client} on {api}: {log:#?}");
            let path = match *api {
                "chat" => "/v1/chat/completions",
                "messages" => "/v1/messages",
                _ => "/v1/responses",
            };
            for r in &log {
                assert_eq!(r.path, path, "{client} on {api}");
                assert_eq!(r.status, 200, "{client} on {api}: {:#}", r.body);
            }
            for second in [&log[1], &log[3]] {
                let body = second.body.to_string();
                assert!(
                    body.contains("21 °C") && body.contains("get_weather"),
                    "{client} on {api}: the tool's result went along: {body}"
                );
            }
        }
    }
    for (name, api, primary, fallback) in &mocks {
        assert!(
            !primary.requests().is_empty() || name.starts_with("CUT"),
            "{name}"
        );
        assert_eq!(
            fallback.requests().len(),
            3,
            "{name}: one call per client SDK"
        );
        assert!(fallback
            .requests()
            .iter()
            .all(|r| r.path.ends_with(match *api {
                "chat" => "/chat/completions",
                "messages" => "/messages",
                _ => "/responses",
            })));
    }
}

/// The agent's last turn: the primary answers 429 (Retry-After 30 s), the fallback
/// answers, and the agent shows its answer.
async fn a_429_is_answered_by_the_fallback<F: std::future::Future<Output = ScriptRun>>(
    w: &AgentWorld,
    run: impl FnOnce() -> F,
) {
    w.primary.push_script(Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    });
    let run = run().await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("Answered by the fallback"),
        "{}",
        run.stdout
    );
    assert!(w.primary.requests().iter().any(|r| r.status == 429));
}

/// The agent's signed tool round fails over (SPEC §23.5): the primary (fam-a) answers
/// with signed reasoning and a tool call, then is down (503); the agent sends the
/// signed state back with the tool's result, and the fallback (fam-b, which refuses
/// fam-a's signatures with the provider's 400) answers — the signed state removed for
/// it, no 400 anywhere. `signed` is the marker of fam-a's signed state in a body.
async fn a_signed_tool_round_fails_over<F: std::future::Future<Output = ScriptRun>>(
    w: &AgentWorld,
    tool: ToolCallSpec,
    signed: &str,
    run: impl FnOnce() -> F,
) {
    w.primary.reset_log();
    w.fallback.reset_log();
    w.primary.push_script(Behavior {
        signing_group: Some("fam-a".into()),
        reasoning: vec!["I will read".into(), " the note".into()],
        chunk_count: Some(0),
        tool_call: Some(tool),
        ..Behavior::default()
    });
    w.primary.set_default(Behavior::status(503));
    let run = run().await;
    w.primary.set_default(Behavior {
        signing_group: Some("fam-a".into()),
        ..hello()
    });
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("Answered by the fallback"),
        "{}",
        run.stdout
    );
    let primary = w.primary.requests();
    assert!(
        primary
            .iter()
            .any(|r| r.status == 503 && r.body.to_string().contains(signed)),
        "the agent sent its signed state back: {primary:#?}"
    );
    let fallback = w.fallback.requests();
    assert!(!fallback.is_empty());
    for r in &fallback {
        assert_eq!(r.status, 200, "no signature 400 on failover: {r:#?}");
        assert!(
            !r.body.to_string().contains(signed),
            "fam-a's signed state reached fam-b: {:#}",
            r.body
        );
    }
    assert!(
        fallback
            .iter()
            .any(|r| r.body.to_string().contains("tangerine")),
        "the tool's result went along"
    );
}

/// A mid-answer fault on the primary (fam-a), the fallback (fam-b) answering the same
/// `words`: the agent's run, checked to show the whole answer once, and the fallback
/// asked (SPEC §23.6).
async fn mid_answer_fault<F: std::future::Future<Output = ScriptRun>>(
    w: &AgentWorld,
    words: &[&str],
    fault: Behavior,
    run: impl FnOnce() -> F,
) -> ScriptRun {
    w.primary.reset_log();
    w.fallback.reset_log();
    w.primary.push_script(Behavior {
        signing_group: Some("fam-a".into()),
        chunks: Behavior::text(words).chunks,
        ..fault
    });
    w.fallback.push_script(Behavior {
        signing_group: Some("fam-b".into()),
        ..Behavior::text(words)
    });
    let run = run().await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains(&words.concat()), "{}", run.stdout);
    assert!(
        !w.fallback.requests().is_empty(),
        "the fallback continued it"
    );
    run
}

/// The agent's answer is cut mid-stream (SPEC §23.6): the primary streams two chunks,
/// 40 ms apart, then resets; the fallback's replay of the same answer continues the
/// stream, and the agent shows the whole answer once.
async fn a_stream_cut_mid_answer_is_continued<F: std::future::Future<Output = ScriptRun>>(
    w: &AgentWorld,
    run: impl FnOnce() -> F,
) {
    let fault = Behavior {
        fault: Some(Fault::ResetAfter { chunks: 2 }),
        gap_ms: 40.0,
        ..Behavior::default()
    };
    let words = ["Resumed ", "answer ", "from ", "polygw."];
    mid_answer_fault(w, &words, fault, run).await;
    assert!(
        w.primary
            .requests()
            .iter()
            .any(|r| r.end == EndKind::ResetMidStream),
        "the primary's stream was cut"
    );
}

/// The agent's answer stalls mid-stream (SPEC §23.6, with the `auto` defaults of
/// SPEC §25.1: nothing is tuned in the agents' scope): the primary streams two chunks,
/// then falls silent for 20 s; the stall trigger's prior (10 s) continues the answer on
/// the fallback, the agent shows it whole and once, before the stall would have ended,
/// and the silent leg is cancelled.
async fn a_stall_mid_answer_is_rescued_with_defaults<F: std::future::Future<Output = ScriptRun>>(
    w: &AgentWorld,
    run: impl FnOnce() -> F,
) {
    let fault = Behavior {
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 20_000.0,
        }],
        ..Behavior::default()
    };
    let words = ["Rescued ", "after ", "a ", "stall."];
    let run = mid_answer_fault(w, &words, fault, run).await;
    assert!(
        run.took < Duration::from_secs(20),
        "rescued before the stall ended: {:?}",
        run.took
    );
    let primary = w.primary.wait_for_ended(1, Duration::from_secs(30)).await;
    assert!(
        primary
            .iter()
            .any(|r| r.end == EndKind::ClientDisconnected && r.chunks_sent == 2),
        "the stalled leg was cancelled after its two chunks: {primary:#?}"
    );
}

/// Claude Code itself (`claude -p`, the pinned npm release) through `polygw serve` to
/// `messages` sources, offline (issue 35): a plain turn, a tool round (it reads a file
/// with its Read tool and sends the result back), and a 429 on the primary answered by
/// the fallback. What reached the sources is Claude Code's own request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_through_polygw_to_messages_sources() {
    let test = "claude_code_through_polygw_to_messages_sources";
    let Some(claude) = sdk::claude_code(test) else {
        return;
    };
    let w = agent_world("messages", "claude-*").await;
    let (primary, s, home, work) = (&w.primary, &w.serve, &w.home, &w.work);
    let note = work.path().join("note.txt");
    let run_claude = |prompt: &str| {
        let claude = claude.clone();
        let argv = vec![
            "-p".to_string(),
            prompt.to_string(),
            "--model".into(),
            "claude-sonnet-4-5".into(),
            "--allowedTools".into(),
            "Read".into(),
            "--add-dir".into(),
            work.path().display().to_string(),
        ];
        let env = vec![
            var("HOME", &home.path().display().to_string()),
            var("ANTHROPIC_BASE_URL", &s.base),
            var("ANTHROPIC_API_KEY", KEY),
            var("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            var("DISABLE_TELEMETRY", "1"),
            var("DISABLE_AUTOUPDATER", "1"),
            var("DISABLE_ERROR_REPORTING", "1"),
        ];
        async move { sdk::run(claude, argv, env, SCRIPT_LIMIT).await }
    };

    // A plain turn.
    let run = run_claude("Say hello.").await;
    eprintln!(
        "{test}: plain turn took {:?}\n{}\n{}",
        run.took, run.stdout, run.stderr
    );
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("Hello from polygw"), "{}", run.stdout);
    let log = primary.requests();
    assert!(!log.is_empty());
    for r in &log {
        assert_eq!(r.path, "/v1/messages", "{r:#?}");
        assert!(r.x_api_key && !r.authorization);
        assert!(r
            .anthropic_headers
            .iter()
            .any(|(k, _)| k == "anthropic-version"));
    }
    let turn = log
        .iter()
        .rev()
        .find(|r| r.stream)
        .expect("a streamed turn");
    assert!(
        turn.body["system"].is_array(),
        "Claude Code's system blocks, as sent"
    );
    assert!(turn.body["tools"].as_array().is_some_and(|t| !t.is_empty()));
    primary.reset_log();
    // SPEC §24.6: Claude Code's session id is on the rows.
    let rows = w.attribution().await;
    assert!(
        !rows.is_empty() && rows.iter().all(|(s, _)| s.is_some()),
        "every row names Claude Code's session: {rows:?}"
    );

    // A tool round: the primary asks Claude Code to read the note, then answers.
    primary.push_script(Behavior {
        chunk_count: Some(0),
        tool_call: Some(ToolCallSpec {
            id: "toolu_read_1".into(),
            name: "Read".into(),
            arguments: json!({"file_path": note.display().to_string()}).to_string(),
            fragments: 2,
        }),
        ..Behavior::default()
    });
    let run = run_claude("What does note.txt say?").await;
    eprintln!("{test}: tool round took {:?}", run.took);
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    let log = primary.requests();
    let result = log
        .iter()
        .flat_map(|r| r.body["messages"].as_array().cloned().unwrap_or_default())
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == "toolu_read_1")
        .unwrap_or_else(|| panic!("no tool_result reached the source: {log:#?}"));
    assert!(result.to_string().contains("tangerine"), "{result:#}");
    primary.reset_log();

    // A thinking tool round whose signature the fallback's family cannot verify.
    let read = ToolCallSpec {
        id: "toolu_read_2".into(),
        name: "Read".into(),
        arguments: json!({"file_path": note.display().to_string()}).to_string(),
        fragments: 1,
    };
    a_signed_tool_round_fails_over(&w, read, "sig-fam-a-", || {
        run_claude("What does note.txt say? Think first.")
    })
    .await;

    // An answer cut mid-stream, continued on the fallback; one that stalls 20 s,
    // rescued by the defaults.
    a_stream_cut_mid_answer_is_continued(&w, || run_claude("Say something.")).await;
    a_stall_mid_answer_is_rescued_with_defaults(&w, || run_claude("Say something.")).await;

    // A 429 on the primary: the fallback answers.
    a_429_is_answered_by_the_fallback(&w, || run_claude("Say hello again.")).await;
}

/// The Codex CLI itself (`codex exec`, the pinned npm release) through `polygw serve`
/// to `responses` sources, offline (issue 35): a model provider with `wire_api =
/// "responses"`, a plain turn, a tool round (the source asks for a shell command; Codex
/// runs it and sends its output back), and a 429 on the primary answered by the
/// fallback. What reached the sources is Codex's own request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_through_polygw_to_responses_sources() {
    let test = "codex_through_polygw_to_responses_sources";
    let Some(codex) = sdk::codex(test) else {
        return;
    };
    let w = agent_world("responses", "gpt-*").await;
    let (primary, s, home, work) = (&w.primary, &w.serve, &w.home, &w.work);
    std::fs::write(
        home.path().join("config.toml"),
        format!(
            "model = \"gpt-5-codex\"\nmodel_provider = \"polygw\"\n\n\
             [model_providers.polygw]\nname = \"polygw\"\nbase_url = \"{}/v1\"\n\
             env_key = \"POLYGW_KEY\"\nwire_api = \"responses\"\n\
             request_max_retries = 0\nstream_max_retries = 0\n",
            s.base
        ),
    )
    .unwrap();
    let run_codex = |prompt: &str| {
        let codex = codex.clone();
        let argv = vec![
            "exec".to_string(),
            "--skip-git-repo-check".into(),
            "-C".into(),
            work.path().display().to_string(),
            prompt.to_string(),
        ];
        let env = vec![
            var("CODEX_HOME", &home.path().display().to_string()),
            var("HOME", &home.path().display().to_string()),
            var("POLYGW_KEY", KEY),
        ];
        async move { sdk::run(codex, argv, env, SCRIPT_LIMIT).await }
    };

    // A plain turn.
    let run = run_codex("Say hello.").await;
    eprintln!(
        "{test}: plain turn took {:?}\n{}\n{}",
        run.took, run.stdout, run.stderr
    );
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("Hello from polygw"), "{}", run.stdout);
    let log = primary.requests();
    let turn = log
        .iter()
        .find(|r| r.path == "/v1/responses")
        .expect("a turn");
    assert!(turn.authorization && turn.stream);
    assert_eq!(turn.body["model"], "model-a", "{:#}", turn.body);
    let keys: Vec<&String> = turn.body.as_object().unwrap().keys().collect();
    eprintln!("{test}: Codex's request fields: {keys:?}");
    assert!(
        turn.body["input"].is_array(),
        "Codex's input items, as sent"
    );
    let tools: Vec<String> = turn.body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            t["name"]
                .as_str()
                .or(t["type"].as_str())
                .map(str::to_string)
        })
        .collect();
    eprintln!("{test}: Codex's tools: {tools:?}");
    assert!(!tools.is_empty());
    primary.reset_log();
    // SPEC §24.6: Codex's session (its session_id header, else its prompt_cache_key) is
    // on the rows.
    let rows = w.attribution().await;
    eprintln!("{test}: attribution {rows:?}");
    assert!(
        !rows.is_empty() && rows.iter().all(|(s, _)| s.is_some()),
        "every row names Codex's session: {rows:?}"
    );

    // A tool round: the primary asks for a shell command (Codex's shell tool, by the
    // name Codex gave it), then answers.
    let shell = ["shell", "exec_command", "local_shell"]
        .into_iter()
        .find(|n| tools.iter().any(|t| t == n))
        .unwrap_or("shell");
    let args = if shell == "exec_command" {
        json!({"cmd": "cat note.txt"})
    } else {
        json!({"command": ["cat", "note.txt"]})
    };
    primary.push_script(Behavior {
        chunk_count: Some(0),
        tool_call: Some(ToolCallSpec {
            id: "call_shell_1".into(),
            name: shell.into(),
            arguments: args.to_string(),
            fragments: 2,
        }),
        ..Behavior::default()
    });
    let run = run_codex("What does note.txt say?").await;
    eprintln!(
        "{test}: tool round took {:?}\n{}\n{}",
        run.took, run.stdout, run.stderr
    );
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    let log = primary.requests();
    let output = log
        .iter()
        .flat_map(|r| r.body["input"].as_array().cloned().unwrap_or_default())
        .find(|i| i["type"] == "function_call_output" && i["call_id"] == "call_shell_1")
        .unwrap_or_else(|| panic!("no function_call_output reached the source: {log:#?}"));
    assert!(output.to_string().contains("tangerine"), "{output:#}");
    primary.reset_log();

    // A reasoning tool round whose encrypted content the fallback's organization
    // cannot verify.
    let call = ToolCallSpec {
        id: "call_shell_2".into(),
        name: shell.into(),
        arguments: args.to_string(),
        fragments: 1,
    };
    a_signed_tool_round_fails_over(&w, call, "enc-fam-a-", || {
        run_codex("What does note.txt say? Think first.")
    })
    .await;

    // An answer cut mid-stream, continued on the fallback; one that stalls 20 s,
    // rescued by the defaults.
    a_stream_cut_mid_answer_is_continued(&w, || run_codex("Say something.")).await;
    a_stall_mid_answer_is_rescued_with_defaults(&w, || run_codex("Say something.")).await;

    // A 429 on the primary: the fallback answers.
    a_429_is_answered_by_the_fallback(&w, || run_codex("Say hello again.")).await;
}

/// 60 generated words.
fn words() -> Behavior {
    Behavior {
        chunk_count: Some(60),
        ..Behavior::default()
    }
}

fn faulty(f: Fault) -> Behavior {
    Behavior {
        fault: Some(f),
        ..words()
    }
}

/// The mocks of the fault scopes.
struct Faults {
    cut: (MockUpstream, MockUpstream),
    stall: (MockUpstream, MockUpstream),
    malformed: (MockUpstream, MockUpstream),
    limited: MockUpstream,
    broken: (MockUpstream, MockUpstream),
}

/// Five scopes: `cut`, `stall`, `malformed` (a faulty primary `a`, a healthy fallback
/// `b`, so polygw resumes), `limited` (429 with Retry-After: 30, beyond
/// `--max-wait-s` 10), `broken` (500 on both sources).
async fn fault_scopes() -> (Faults, Vec<(String, String)>) {
    let f = Faults {
        cut: (
            mock(faulty(Fault::ResetAfter { chunks: 25 })).await,
            mock(words()).await,
        ),
        stall: (
            mock(Behavior {
                stalls: vec![Stall {
                    before_chunk: 20,
                    ms: 30_000.0,
                }],
                ..words()
            })
            .await,
            mock(words()).await,
        ),
        malformed: (
            mock(faulty(Fault::MalformedAt { chunk: 30 })).await,
            mock(words()).await,
        ),
        limited: mock(Behavior {
            retry_after: Some(RetryAfter::Seconds(30.0)),
            ..Behavior::status(429)
        })
        .await,
        broken: (
            mock(Behavior::status(500)).await,
            mock(Behavior::status(500)).await,
        ),
    };
    let mut env = Vec::new();
    for (scope, (a, b), b_extra) in [
        ("CUT", &f.cut, &[][..]),
        // The stall is rescued by a prefill continuation, the others by a replay.
        ("STALL", &f.stall, &[("PREFILL", "prefix")][..]),
        ("MALFORMED", &f.malformed, &[][..]),
        ("BROKEN", &f.broken, &[][..]),
    ] {
        env.extend(source(scope, "a", a, &[("PRIORITY", "0")]));
        let mut bx = vec![("PRIORITY", "1")];
        bx.extend_from_slice(b_extra);
        env.extend(source(scope, "b", b, &bx));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_BASE_S"), "0.01"));
        env.push(var(&format!("{scope}__RETRY__BACKOFF_MAX_S"), "0.02"));
    }
    env.push(var("STALL__HEDGE__STALL_AFTER_S", "0.3"));
    env.push(var("STALL__HEDGE__BUDGET_PCT", "0"));
    env.extend(source("LIMITED", "l", &f.limited, &[]));
    (f, env)
}

/// The whole answer the primary planned (what the client must see, exactly).
async fn planned(primary: &MockUpstream) -> String {
    let log = primary.wait_for_ended(1, Duration::from_secs(10)).await;
    assert!(!log[0].full_content.is_empty());
    log[0].full_content.clone()
}

/// The resumed streams and the errors, as `faults.py SDK` reported them.
async fn check_faults(f: &Faults, out: &Value, rate_limit: &str, server_error: &str) {
    for (scope, (a, b), ends) in [
        ("cut", &f.cut, &[EndKind::ResetMidStream][..]),
        // The silent leg was cancelled when the resume leg took over.
        ("stall", &f.stall, &[EndKind::ClientDisconnected][..]),
        // (a fast primary may have sent all of it before polygw left)
        (
            "malformed",
            &f.malformed,
            &[EndKind::ClientDisconnected, EndKind::Completed][..],
        ),
    ] {
        let full = planned(a).await;
        let seen = &out[scope];
        assert_eq!(
            seen["deltas"],
            full.as_str(),
            "{scope}: the deltas, exactly"
        );
        assert_eq!(
            seen["final"],
            full.as_str(),
            "{scope}: the SDK's final text"
        );
        let ra = a.wait_for_ended(1, Duration::from_secs(10)).await;
        assert_eq!(ra.len(), 1, "{scope}: one request to the primary");
        assert!(
            ends.contains(&ra[0].end),
            "{scope}: how the primary's leg ended: {:?}",
            ra[0].end
        );
        let rb = b.wait_for_ended(1, Duration::from_secs(10)).await;
        assert_eq!(rb.len(), 1, "{scope}: one resume leg on the fallback");
    }
    // The stall was resumed by prefill: the fallback continued the delivered prefix.
    let rb = f.stall.1.requests();
    let p = rb[0].prefill.as_ref().expect("a prefill request");
    assert!(p.matched && p.prefix_chars > 0, "{p:?}");
    for how in ["plain", "stream"] {
        let e = &out[format!("limited_{how}")];
        assert_eq!(e["class"], "RateLimitError", "{how}: {e:#}");
        assert_eq!(e["status"], 429, "{how}: HTTP 429 even for a stream: {e:#}");
        // The upstream's hint (the later call: what is left of it, rounded up).
        let ra: u64 = e["retry_after"].as_str().unwrap().parse().unwrap();
        assert!((28..=30).contains(&ra), "{how}: {e:#}");
        assert_eq!(e["kind"], rate_limit, "{how}: {e:#}");
        assert!(
            e["content_type"]
                .as_str()
                .unwrap()
                .starts_with("application/json"),
            "{how}: {e:#}"
        );
        assert!(e["request_id"].is_string(), "{how}: {e:#}");
        let e = &out[format!("broken_{how}")];
        let mro: Vec<&str> = e["mro"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert!(
            mro.contains(&"InternalServerError"),
            "{how}: the SDK's server error: {e:#}"
        );
        assert!(e["status"].as_u64().unwrap() >= 500, "{how}: {e:#}");
        assert_eq!(e["class"], server_error, "{how}: {e:#}");
    }
    assert_eq!(out["limited_plain"]["retry_after"], "30");
    // One upstream request: the later call was answered from the source's cooldown
    // at once (SPEC §17.2), not by polling it.
    assert_eq!(f.limited.requests().len(), 1, "{:#?}", f.limited.requests());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_through_faulty_upstreams() {
    let test = "openai_python_through_faulty_upstreams";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let (f, env) = fault_scopes().await;
    let s = start(&["--max-wait-s", "10"], env);
    let run = python(py, test, "faults.py", &["openai"], &s).await;
    let out = run.json();
    assert!(
        run.took < Duration::from_secs(20),
        "the 30 s stall was not waited out"
    );
    check_faults(&f, &out, "rate_limit_exceeded", "InternalServerError").await;
    assert_eq!(out["broken_plain"]["status"], 503, "{out:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_through_faulty_upstreams() {
    let test = "anthropic_python_through_faulty_upstreams";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let (f, env) = fault_scopes().await;
    let s = start(&["--max-wait-s", "10"], env);
    let run = python(py, test, "faults.py", &["anthropic"], &s).await;
    let out = run.json();
    assert!(
        run.took < Duration::from_secs(20),
        "the 30 s stall was not waited out"
    );
    // Anthropic's shape: polygw's 503 is its 529 overloaded_error.
    check_faults(&f, &out, "rate_limit_error", "OverloadedError").await;
    assert_eq!(out["broken_plain"]["status"], 529, "{out:#}");
    assert_eq!(out["broken_plain"]["kind"], "overloaded_error", "{out:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_sdks_stream_and_raise_rate_limits() {
    let test = "node_sdks_stream_and_raise_rate_limits";
    let Some(node) = sdk::node_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let limited = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    })
    .await;
    // The first 429 says 4 s: within --max-wait-s, so polygw waits it out (no attempt
    // running: no 200, no keepalive) and retries; the second says 30 s: beyond it.
    limited.push_script(Behavior {
        retry_after: Some(RetryAfter::Seconds(4.0)),
        ..Behavior::status(429)
    });
    let mut env = source("PLAIN", "p", &plain, &[]);
    env.extend(source("LIMITED", "l", &limited, &[]));
    let s = start(&["--keepalive-s", "1", "--max-wait-s", "10"], env);
    let run = sdk::run(
        node,
        vec![sdk::node_dir().join("sdk.mjs").display().to_string()],
        vec![var("POLYGW_ROOT", &s.base), var("POLYGW_KEY", KEY)],
        SCRIPT_LIMIT,
    )
    .await;
    eprintln!("{test}: sdk.mjs took {:?}", run.took);
    let out = run.json();
    assert_eq!(out["chat_text"], "Hello from polygw");
    assert_eq!(out["responses_text"], "Hello from polygw");
    assert_eq!(out["messages_text"], "Hello from polygw");
    for what in [
        "limited_chat_stream",
        "limited_responses_stream",
        "limited_messages_stream",
    ] {
        let e = &out[what];
        assert_eq!(e["class"], "RateLimitError", "{what}: {e:#}");
        assert_eq!(e["status"], 429, "{what}: {e:#}");
        let ra: u64 = e["retry_after"].as_str().unwrap().parse().unwrap();
        assert!(ra >= 1, "{what}: {e:#}");
        // The hint of the attempt that ended the call, or what is left of the source's
        // 30 s cooldown after it.
        assert!((20..=30).contains(&ra), "{what}: {e:#}");
    }
    // (The first one's Retry-After is the 30 s hint of the attempt that ended the call,
    // not the 4 s one it waited out: `a_hint_waited_out_is_not_the_retry_after`.)
    // The first one waited out the 4 s hint (while keepalive-s 1 passed four times)
    // and still got its status.
    let waited = out["limited_chat_stream"]["ms"].as_u64().unwrap();
    assert!(waited >= 3_500, "{waited} ms");
    // Two upstream requests (the 4 s hint, then the 30 s one); the later calls were
    // answered from the cooldown.
    let log = limited.requests();
    assert_eq!(log.len(), 2, "{log:#?}");
    assert_eq!(plain.requests().len(), 3);
}

/// An upstream 429 whose Retry-After (4 s) polygw waits out, then one whose hint (30 s)
/// is beyond `--max-wait-s`: the answer's Retry-After must be the earliest admission
/// (30 s), not the hint already waited out.
///
/// Found by `node_sdks_stream_and_raise_rate_limits`: the answer said `Retry-After: 4`
/// (the call kept the smallest hint it had seen, as a duration). Each source's latest
/// hint is now kept as a moment, and only those still ahead count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_waited_out_is_not_the_retry_after() {
    let limited = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    })
    .await;
    limited.push_script(Behavior {
        retry_after: Some(RetryAfter::Seconds(4.0)),
        ..Behavior::status(429)
    });
    let s = start(
        &["--keepalive-s", "1", "--max-wait-s", "10"],
        source("LIMITED", "l", &limited, &[]),
    );
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth(KEY)
        .json(&json!({"model": "limited", "stream": true,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(limited.requests().len(), 2);
    let ra = r.headers()["retry-after"].to_str().unwrap().to_string();
    assert_eq!(ra, "30", "{}", r.text().await.unwrap());
}

// ------------------------------------------------------------- defaults (SPEC §25)

/// A 40-word answer, 20 ms between words.
fn story() -> Behavior {
    Behavior {
        chunk_count: Some(40),
        gap_ms: 20.0,
        ..Behavior::default()
    }
}

/// Scopes for `defaults.py rescue`: per API a primary that goes silent for 40 s after
/// its 10th word and one whose first token takes 20 s, each with a healthy second
/// source; `stall3`, a primary that stalls every answer. Only the sources' order is set
/// (PRIORITY): every hedging, retry and resume setting is the default.
async fn rescue_scopes() -> (
    Vec<(String, MockUpstream, MockUpstream)>,
    Vec<(String, String)>,
) {
    let stalling = || Behavior {
        stalls: vec![Stall {
            before_chunk: 10,
            ms: 40_000.0,
        }],
        ..story()
    };
    // A short answer: what is measured is when the first token comes.
    let quick = || Behavior {
        chunk_count: Some(10),
        gap_ms: 10.0,
        ..Behavior::default()
    };
    let slow_first = || Behavior {
        ttft_ms: 20_000.0,
        ..quick()
    };
    let mut scopes = Vec::new();
    for api in ["chat", "responses", "messages"] {
        scopes.push((
            format!("stall_{api}"),
            mock(stalling()).await,
            mock(story()).await,
        ));
        scopes.push((
            format!("first_{api}"),
            mock(slow_first()).await,
            mock(quick()).await,
        ));
    }
    scopes.push((
        "stall3".to_string(),
        mock(stalling()).await,
        mock(story()).await,
    ));
    let mut env = Vec::new();
    for (scope, a, b) in &scopes {
        let s = scope.to_uppercase();
        env.extend(source(&s, "a", a, &[("PRIORITY", "0")]));
        env.extend(source(&s, "b", b, &[("PRIORITY", "1")]));
    }
    (scopes, env)
}

/// SPEC §25.1 and §25.3, measured through `polygw serve` with the defaults alone on a
/// fresh process, streamed through the official SDKs in chat completions, Responses
/// and Messages: a 40 s silence mid-answer with a second source is continued within
/// 15 s, with exactly the answer's text; three such stalls within a minute at one call
/// every 5 s are each rescued within 15 s; a 20 s first token is answered by a hedge
/// within 16 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defaults_protect_streams_from_the_first_call() {
    let test = "defaults_protect_streams_from_the_first_call";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let (scopes, env) = rescue_scopes().await;
    let s = start(&[], env);
    let run = python(py, test, "defaults.py", &["rescue"], &s).await;
    let out = run.json();
    eprintln!("{test}: {out:#}");
    for (scope, a, b) in &scopes {
        if scope == "stall3" {
            let calls = out["stall3"].as_array().expect("three calls");
            assert_eq!(calls.len(), 3, "{out:#}");
            let a_log = a.wait_for_ended(3, Duration::from_secs(10)).await;
            for (i, c) in calls.iter().enumerate() {
                let took = c["s"].as_f64().unwrap();
                assert!(c["error"].is_null(), "stall3 call {i}: {c:#}");
                assert!(took < 15.0, "stall3 call {i} rescued within 15 s: {c:#}");
                let text = c["text"].as_str().unwrap();
                assert!(
                    a_log.iter().any(|r| r.full_content == text),
                    "stall3 call {i}: exactly the planned answer: {c:#}"
                );
            }
            continue;
        }
        let seen = &out[scope.as_str()];
        assert!(seen["error"].is_null(), "{scope}: {seen:#}");
        let took = seen["s"].as_f64().unwrap();
        if scope.starts_with("stall_") {
            assert_eq!(
                seen["text"],
                planned(a).await.as_str(),
                "{scope}: the text, exactly"
            );
            assert!(took < 15.0, "{scope}: rescued within 15 s, took {took} s");
            assert!(
                took > 9.0,
                "{scope}: not before the stall prior, took {took} s"
            );
        } else {
            assert_eq!(
                seen["text"],
                planned(b).await.as_str(),
                "{scope}: the hedge's answer"
            );
            assert!(took < 16.0, "{scope}: hedged within 16 s, took {took} s");
            assert!(
                took > 14.0,
                "{scope}: not before the first-token prior, took {took} s"
            );
        }
        assert_eq!(
            b.requests().len(),
            1,
            "{scope}: one leg on the second source"
        );
    }
}

/// SPEC §25.4, measured through `polygw serve` with the defaults alone: every source
/// answering 503 (or refusing connections), ten streamed calls one second apart per API
/// cost at most 15 upstream requests, and each is answered within 1.5 s in its API's
/// shape (503 for chat and Responses, 529 `overloaded_error` for Messages) with
/// `Retry-After`, and `x-should-retry: false` once polygw made attempts of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_answered_at_once_and_not_multiplied() {
    let test = "an_outage_is_answered_at_once_and_not_multiplied";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let mut env = Vec::new();
    let mut down = Vec::new();
    for api in ["chat", "responses", "messages"] {
        let (a, b) = (
            mock(Behavior::status(503)).await,
            mock(Behavior::status(503)).await,
        );
        let s = format!("DOWN_{}", api.to_uppercase());
        env.extend(source(&s, "a", &a, &[]));
        env.extend(source(&s, "b", &b, &[]));
        down.push((api, a, b));
    }
    // Two sources whose ports refuse connections.
    for name in ["A", "B"] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        env.push(var(
            &format!("REFUSED__{name}__0__BASE_URL"),
            &format!("http://127.0.0.1:{port}/v1"),
        ));
        env.push(var(&format!("REFUSED__{name}__0__API_KEY"), "sk-x"));
        env.push(var(&format!("REFUSED__{name}__0__MODEL"), "m"));
    }
    let s = start(&[], env);
    let run = python(py, test, "defaults.py", &["outage"], &s).await;
    let out = run.json();
    eprintln!("{test}: {out:#}");
    for (api, a, b) in &down {
        let calls = out[format!("down_{api}")].as_array().unwrap().clone();
        let upstream = a.requests().len() + b.requests().len();
        eprintln!("{test}: {api}: {upstream} upstream requests for 10 calls");
        assert!(upstream <= 15, "{api}: {upstream} upstream requests");
        check_outage_answers(api, &calls);
    }
    check_outage_answers("chat", out["refused"].as_array().unwrap());
}

fn check_outage_answers(api: &str, calls: &[Value]) {
    assert_eq!(calls.len(), 10, "{api}: {calls:#?}");
    for (i, c) in calls.iter().enumerate() {
        assert!(c["s"].as_f64().unwrap() <= 1.5, "{api} call {i}: {c:#}");
        let (status, kind) = if api == "messages" {
            (529, "overloaded_error")
        } else {
            (503, "")
        };
        assert_eq!(c["status"], status, "{api} call {i}: {c:#}");
        if !kind.is_empty() {
            assert_eq!(c["kind"], kind, "{api} call {i}: {c:#}");
        }
        let ra: u64 = c["retry_after"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("{api} call {i}: a Retry-After: {c:#}"));
        assert!(ra >= 1, "{api} call {i}: {c:#}");
    }
    // polygw attempted (and retried as far as the throttle allowed) at least the first
    // call: its client must not multiply it.
    assert_eq!(calls[0]["should_retry"], "false", "{api}: {:#}", calls[0]);
}

/// Issue 39 through the official Python SDKs, with a client key whose budget (0.10 a day)
/// pays for three calls' reservations but not for twelve: four calls to a broken source
/// (a 400, then 503s, each retried twice by the SDK — twelve admissions) leave it
/// untouched (SPEC §24.2), and a reasoning-model source that refuses `max_tokens` then
/// serves Chat Completions, Responses and Messages clients (SPEC §24.4: learned from its
/// first 400, resent as `max_completion_tokens`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdks_with_a_budget_through_failures_and_a_reasoning_model() {
    let test = "python_sdks_with_a_budget_through_failures_and_a_reasoning_model";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("keys.db").display());
    let keys_env = vec![var("POLYGW_KEYS_DB", &db)];
    let o = support::polygw(
        &["keys", "create", "--name", "agent", "--budget", "0.10/day"],
        &keys_env,
    );
    assert!(o.status.success(), "{o:?}");
    let secret = String::from_utf8(o.stdout).unwrap().trim().to_string();
    let broken = mock(Behavior::status(503)).await;
    broken.push_script(Behavior {
        error_code: Some("invalid_request_error".into()),
        ..Behavior::status(400)
    });
    let reasoner = mock(Behavior {
        refuses_max_tokens: true,
        ..hello()
    })
    .await;
    let prices = [("INPUT_PRICE", "1000"), ("OUTPUT_PRICE", "1000")];
    let mut env = source("BROKEN", "b", &broken, &prices);
    env.extend(source("REASONER", "r", &reasoner, &prices));
    env.extend(keys_env);
    let s = serve_args(&["--grace-s", "5"], &env);
    let run = sdk::run(
        py,
        vec![sdk::python_script("budget.py").display().to_string()],
        vec![var("POLYGW_ROOT", &s.base), var("POLYGW_KEY", &secret)],
        SCRIPT_LIMIT,
    )
    .await;
    eprintln!("{test}: took {:?}\n{}", run.took, run.stderr);
    let out = run.json();
    let failures: Vec<u64> = out["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(failures.len(), 4, "{out}");
    assert_eq!(failures[0], 400, "{out}");
    assert!(failures[1..].iter().all(|s| *s >= 500), "{out}");
    for api in ["chat", "responses", "messages"] {
        assert_eq!(out[api], "Hello from polygw", "{api}: {out}");
    }
    let log = reasoner.requests();
    let refused = log.iter().filter(|r| r.status == 400).count();
    assert_eq!(refused, 1, "one refusal teaches the field: {log:#?}");
    for r in log.iter().filter(|r| r.status == 200) {
        assert!(r.body.get("max_tokens").is_none(), "{:#}", r.body);
        assert_eq!(r.body["max_completion_tokens"], 50, "{:#}", r.body);
    }
    assert_eq!(log.iter().filter(|r| r.status == 200).count(), 3);
}

/// SPEC §24.3 as the official SDKs read it: `count_tokens` (Anthropic) and
/// `responses.input_tokens` (OpenAI) on chat sources, answered with polygw's estimate. An
/// image inline (30 KB of base64, ~7 500 tokens as text) counts by the providers' formula for its size (a
/// 1024×768 PNG: 1049), not by its bytes; a 40 KB tool call sent back counts its
/// arguments — both within a factor of 1.25 of the benchmark's figures (cargo xtask bench
/// estimate: the image 1049, 40 KB of code in JSON about 12 000 o200k tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdks_count_images_and_tool_calls_as_the_providers_bill_them() {
    let test = "sdks_count_images_and_tool_calls_as_the_providers_bill_them";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let plain = mock(hello()).await;
    let s = start(&[], source("PLAIN", "p", &plain, &[]));
    let png_1024x768 = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==";
    let run = python(py, test, "estimate.py", &[png_1024x768], &s).await;
    let out = run.json();
    eprintln!("{test}: {out}");
    let n = |k: &str| out[k].as_u64().unwrap_or_else(|| panic!("{k}: {out}"));
    let text = n("messages_text");
    assert!((1..40).contains(&text), "{out}");
    for k in ["messages_image", "responses_image"] {
        assert!((1049..1049 + 60).contains(&n(k)), "{k}: {out}");
    }
    // 40 KB of the benchmark's code corpus in a tool call: o200k counts 12 850 tokens for
    // it with its framing (docs/BENCHMARKS.md, "Prompt estimate").
    for k in ["messages_tool", "responses_tool"] {
        let t = n(k);
        assert!(
            (12_850 * 4 / 5..=12_850 * 5 / 4).contains(&t),
            "{k}: {t} ({out})"
        );
    }
    assert!(
        plain.requests().is_empty(),
        "counted by polygw: {:?}",
        plain.requests()
    );
}

/// SPEC §24.5 as the OpenAI SDK meets it (tests/python/conversation.py): two client keys
/// hold stored Responses conversations in the scope's telemetry database, with
/// `RESPONSES__MAX_BYTES_PER_KEY` at its minimum (64 KiB).
/// - Each turn is stored once, with its own input only and a link to the turn before:
///   storage grows with the turn, while the upstream still gets the whole conversation.
/// - A key past its bound loses its own oldest turns; its conversation is then refused
///   (404 naming the lost turn), never sent upstream shortened; the other key's
///   conversation is untouched and continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_conversations_are_stored_by_turn_and_bounded_per_key() {
    let test = "python_conversations_are_stored_by_turn_and_bounded_per_key";
    let Some(py) = sdk::python_sdks(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("polygw.db").display());
    let keys_env = vec![var("POLYGW_KEYS_DB", &db)];
    let (mut secrets, mut owners) = (Vec::new(), Vec::new());
    for name in ["ann", "bob"] {
        let o = support::polygw(&["keys", "create", "--name", name], &keys_env);
        assert!(o.status.success(), "{o:?}");
        secrets.push(
            String::from_utf8(o.stdout.clone())
                .unwrap()
                .trim()
                .to_string(),
        );
        // "client key ID (NAME): shown once …": stored responses are owned by
        // SCOPE/ID.
        let (_, err) = support::text(&o);
        let id = err
            .split_whitespace()
            .nth(2)
            .unwrap_or_else(|| panic!("{err}"));
        owners.push(format!("PLAIN/{id}"));
    }
    let plain = mock(hello()).await;
    let mut env = source("PLAIN", "p", &plain, &[]);
    env.push(var("PLAIN__TELEMETRY__URL", &db));
    env.push(var("PLAIN__RESPONSES__MAX_BYTES_PER_KEY", "65536"));
    env.extend(keys_env);
    let s = serve_args(&["--grace-s", "5"], &env);
    let run = sdk::run(
        py,
        vec![sdk::python_script("conversation.py").display().to_string()],
        vec![
            var("POLYGW_ROOT", &s.base),
            var("POLYGW_KEY_A", &secrets[0]),
            var("POLYGW_KEY_B", &secrets[1]),
        ],
        SCRIPT_LIMIT,
    )
    .await;
    eprintln!("{test}: took {:?}\n{}", run.took, run.stderr);
    let out = run.json();
    let ids = |k: &str| -> Vec<String> {
        out[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let (a, b) = (ids("a"), ids("b"));
    assert_eq!(b.len(), 4, "{out}");
    let refusal = out["a_refusal"].as_str().unwrap();
    assert!(
        refusal.contains("no longer stored") && refusal.contains("RESPONSES__MAX_BYTES_PER_KEY"),
        "{refusal}"
    );

    // Upstream: A's twelfth turn carried the whole conversation (12 questions, 11
    // answers), and no request ever carried a shortened one: each request's user
    // messages are turns 0..=i of its conversation, in order.
    let log = plain.requests();
    let users = |r: &RecordedRequest| -> Vec<String> {
        messages(r)
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| text_of(m).split(':').next().unwrap_or_default().to_string())
            .collect()
    };
    let twelfth = log
        .iter()
        .find(|r| users(r).last().is_some_and(|u| u == "turn 11") && users(r).len() == 12)
        .expect("A's twelfth turn went upstream whole");
    assert_eq!(roles(twelfth).len(), 23, "{:?}", roles(twelfth));
    for r in &log {
        let u = users(r);
        let expect: Vec<String> = (0..u.len()).map(|i| format!("turn {i}")).collect();
        assert_eq!(
            u, expect,
            "a conversation went upstream shortened or out of order"
        );
    }

    // The store: one row per turn, each with its own input only, A within its bound,
    // all of B's turns there.
    let rec = polygw_telemetry_sql::SqlRecorder::connect(
        &db,
        polygw_telemetry_sql::RecorderConfig::default(),
    )
    .await
    .unwrap();
    use polygw::core::ports::ResponseStore;
    let store = rec.response_store();
    let (owner_a, owner_b) = (&owners[0], &owners[1]);
    let b_chain = store.chain(owner_b, b.last().unwrap(), 0).await.unwrap();
    assert_eq!(b_chain.len(), 4, "B's conversation is whole");
    for t in &b_chain {
        assert_eq!(t.input_items.len(), 1, "one turn, its own input: {t:?}");
    }
    let a_bytes = store.owner_bytes(owner_a).await.unwrap();
    let b_bytes = store.owner_bytes(owner_b).await.unwrap();
    assert!(a_bytes <= 65_536, "{a_bytes}");
    // Storage grows with the turn: B's four turns count the same (the fourth does not
    // hold the three before it), and the owner's sum is theirs exactly.
    let sizes: Vec<u64> = b_chain
        .iter()
        .map(|t| {
            let r = serde_json::to_string(&t.response).unwrap().len();
            let i = serde_json::to_string(&t.input_items).unwrap().len();
            polygw::core::ports::entry_bytes(t, r, i)
        })
        .collect();
    assert_eq!(sizes.iter().sum::<u64>(), b_bytes, "{sizes:?}");
    let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
    assert!(hi - lo < 100, "turn sizes {sizes:?}");
    eprintln!(
        "{test}: A holds {a_bytes} bytes after {} turns; B's turns {sizes:?}",
        a.len()
    );
    rec.shutdown().await;
}
