//! Streams that survive (SPEC §13), end to end: `polygw serve` (the spawned program)
//! in front of a primary and a fallback mock upstream, driven by a real OpenAI client
//! (async-openai); and the library's aggregated and streaming calls in process.
//!
//! Every fault is one the fallback can rescue or not, decided by the scripts, never by
//! a race: stalls are long (30 s) against a short `STALL_AFTER_S`, deadlines short
//! against a fallback that never answers in time.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;
use tokio::time::Instant;

use async_openai::types::chat::{ChatCompletionStreamOptions, CreateChatCompletionRequestArgs};
use futures_util::StreamExt;
use polygw::{ChatEvent, ChatRequest, GatewayClient, UsageSource};
use polygw_mock_upstream::{
    Behavior, EndKind, Fault, MockUpstream, PrefillDialect, PrefillOutcome, PrefillPolicy, Stall,
    ToolCallSpec,
};
use support::{mock, openai, serve, source, user};

/// What an OpenAI client saw of a stream.
#[derive(Debug, Default)]
struct Seen {
    content: String,
    tool_args: String,
    tool_name: Option<String>,
    ids: BTreeSet<String>,
    models: BTreeSet<String>,
    roles: usize,
    finish: Option<String>,
    usage: Option<u32>,
    error: Option<String>,
}

async fn stream_through(base: &str, prompt: &str) -> Seen {
    let c = openai(base, "any");
    let req = CreateChatCompletionRequestArgs::default()
        .model("llm")
        .messages(vec![user(prompt)])
        .stream(true)
        .stream_options(ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        })
        .build()
        .unwrap();
    let mut st = c.chat().create_stream(req).await.unwrap();
    let mut seen = Seen::default();
    while let Some(chunk) = st.next().await {
        match chunk {
            Ok(chunk) => {
                seen.ids.insert(chunk.id.clone());
                seen.models.insert(chunk.model.clone());
                if let Some(u) = chunk.usage {
                    seen.usage = Some(u.completion_tokens);
                }
                for ch in chunk.choices {
                    if ch.delta.role.is_some() {
                        seen.roles += 1;
                    }
                    if let Some(t) = ch.delta.content {
                        seen.content.push_str(&t);
                    }
                    for t in ch.delta.tool_calls.unwrap_or_default() {
                        if let Some(f) = t.function {
                            if let Some(n) = f.name {
                                seen.tool_name.get_or_insert(n);
                            }
                            seen.tool_args.push_str(&f.arguments.unwrap_or_default());
                        }
                    }
                    if let Some(f) = ch.finish_reason {
                        seen.finish = Some(format!("{f:?}"));
                    }
                }
            }
            Err(e) => {
                seen.error = Some(e.to_string());
                break;
            }
        }
    }
    seen
}

/// Primary `a` (priority 0) and fallback `b` (priority 1); fast retries.
fn env(
    a: &MockUpstream,
    b: &MockUpstream,
    b_extra: &[(&str, &str)],
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut v = source("LLM", "a", a, &[("PRIORITY", "0")]);
    let mut bx = vec![("PRIORITY", "1")];
    bx.extend_from_slice(b_extra);
    v.extend(source("LLM", "b", b, &bx));
    v.push(("LLM__RETRY__BACKOFF_BASE_S".into(), "0.01".into()));
    v.push(("LLM__RETRY__BACKOFF_MAX_S".into(), "0.02".into()));
    v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
    v
}

fn words(n: u32) -> Behavior {
    Behavior {
        chunk_count: Some(n),
        ..Behavior::default()
    }
}

/// 60 words with a 30 s silence before chunk `n`.
fn stalls_after(n: u32) -> Behavior {
    Behavior {
        stalls: vec![Stall {
            before_chunk: n,
            ms: 30_000.0,
        }],
        ..words(60)
    }
}

fn with_fault(mut b: Behavior, f: Fault) -> Behavior {
    b.fault = Some(f);
    b
}

/// The whole answer the primary planned for this request.
async fn planned(a: &MockUpstream) -> String {
    let log = a.wait_for_ended(1, Duration::from_secs(10)).await;
    log[0].full_content.clone()
}

fn prefix_of_words(full: &str, n: usize) -> String {
    // Generated chunks are one word each: "w1", " w2", … (a leading space after the
    // first).
    let mut out = String::new();
    for (i, w) in full.split(' ').take(n).enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(w);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_is_continued_by_prefill_on_the_fallback() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 40 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[("PREFILL", "prefix")], &[]));
    let seen = stream_through(&s.base, "tell me a story").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full, "the complete, exact answer");
    assert_eq!(seen.ids.len(), 1, "one stream id: {:?}", seen.ids);
    // SPEC §25.5: one model in every frame, the first leg's (the fallback runs
    // `model-b`).
    assert_eq!(
        seen.models,
        BTreeSet::from(["model-a".to_string()]),
        "one model"
    );
    assert_eq!(seen.roles, 1, "the role chunk once");
    assert!(seen.finish.is_some());
    assert!(seen.usage.is_some(), "usage summed over the legs");
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    let p = rb[0].prefill.clone().expect("a prefill request");
    assert_eq!(p.dialect, PrefillDialect::Prefix);
    assert_eq!(p.outcome, PrefillOutcome::Continued);
    assert!(p.matched);
    // At most the 40 chunks sent before the reset (a reset can discard bytes the
    // gateway had not read yet: it continues from what it actually delivered).
    assert!(p.prefix_chars > 0 && p.prefix_chars <= prefix_of_words(&full, 40).chars().count());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thirty_second_stall_is_resumed_on_the_fallback() {
    let a = mock(stalls_after(20)).await;
    let b = mock(words(60)).await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "partial")],
        &[
            ("LLM__HEDGE__STALL_AFTER_S", "0.3"),
            ("LLM__HEDGE__BUDGET_PCT", "0"),
        ],
    ));
    let t = Instant::now();
    let seen = stream_through(&s.base, "a long answer").await;
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    assert_eq!(seen.ids.len(), 1);
    let ra = a.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        ra[0].end,
        EndKind::ClientDisconnected,
        "the stalled leg was cancelled"
    );
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill.as_ref().map(|p| p.dialect),
        Some(PrefillDialect::Partial)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_event_is_resumed() {
    let a = mock(with_fault(words(60), Fault::MalformedAt { chunk: 25 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[("PREFILL", "vllm")], &[]));
    let seen = stream_through(&s.base, "malformed").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill.as_ref().map(|p| (p.dialect, p.outcome)),
        Some((PrefillDialect::Vllm, PrefillOutcome::Continued))
    );
    assert_eq!(rb[0].body["continue_final_message"], true);
    assert_eq!(rb[0].body["add_generation_prompt"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_that_rejects_prefill_is_replayed_and_remembered() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(words(60).with_prefill(PrefillPolicy::reject())).await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "assistant")],
        &[("POLYGW_LOG", "info")],
    ));
    let seen = stream_through(&s.base, "reject my prefill").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None, "the rejection never reaches the client");
    assert_eq!(seen.content, full);
    let rb = b.wait_for_ended(2, Duration::from_secs(5)).await;
    assert!(rb[0].prefill_rejected(), "{:?}", rb[0].prefill);
    assert_eq!(rb[1].prefill, None, "then a replay of the original request");
    // Learned for the rest of the process: the next resume on b replays at once.
    a.reset_log();
    b.reset_log();
    let seen = stream_through(&s.base, "again").await;
    let full = planned(&a).await;
    assert_eq!(seen.content, full);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(rb.len(), 1);
    assert_eq!(rb[0].prefill, None);
    // The log says it once (a warning), and says each resume.
    let log = lines_so_far(&s, "resuming the stream", 2);
    let warnings = log
        .iter()
        .filter(|l| l.contains("refused an assistant prefill"))
        .count();
    assert_eq!(warnings, 1, "{log:#?}");
    assert!(
        !log.iter()
            .any(|l| l.contains("sk-a-upstream-secret") || l.contains("sk-b-upstream-secret")),
        "no key in the log"
    );
}

/// The serve child's log lines so far: read until `needle` was seen `n` times, then
/// whatever else is already there.
fn lines_so_far(s: &support::Serve, needle: &str, n: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    while out.iter().filter(|l| l.contains(needle)).count() < n {
        match s.lines.recv_timeout(Duration::from_secs(10)) {
            Ok(l) => out.push(l),
            Err(_) => panic!("{needle:?} not logged {n} times: {out:#?}"),
        }
    }
    out.extend(s.lines.try_iter());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_capable_source_is_preferred_over_priority() {
    // a (priority 0) is cut; b (priority 1) has no PREFILL; c (priority 2) has: the
    // resume goes to c, by prefill.
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(words(60)).await;
    let c = mock(words(60)).await;
    let mut vars = env(&a, &b, &[], &[]);
    vars.extend(source(
        "LLM",
        "c",
        &c,
        &[("PRIORITY", "2"), ("PREFILL", "partial")],
    ));
    let s = serve(&vars);
    let seen = stream_through(&s.base, "prefer prefill").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    let rc = c.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rc[0].prefill.as_ref().map(|p| p.outcome),
        Some(PrefillOutcome::Continued)
    );
    assert!(b.requests().is_empty(), "b (replay only) was not needed");
}

/// Issue 22, item 16: with `RETRY__PREFER=same`, a stream cut after its first chunk is
/// resumed on another source — a prefill-capable one first — never first on the source
/// that cut it; the resume's log line names its mode as a word, and the call that
/// succeeded only thanks to the resume says so in one info line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_same_never_resumes_a_cut_stream_on_the_source_that_cut_it() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "assistant")],
        &[("LLM__RETRY__PREFER", "same"), ("POLYGW_LOG", "info")],
    ));
    let seen = stream_through(&s.base, "cut me").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill.as_ref().map(|p| p.outcome),
        Some(PrefillOutcome::Continued),
        "resumed on b by prefill"
    );
    assert_eq!(
        a.requests().len(),
        1,
        "a, which cut the stream, was not asked again"
    );
    let log = lines_so_far(&s, "call succeeded thanks to", 1);
    let resume = log
        .iter()
        .find(|l| l.contains("resuming the stream"))
        .unwrap_or_else(|| panic!("{log:#?}"));
    assert!(
        resume.contains("resume_mode=prefill") && !resume.contains("Some("),
        "{resume}"
    );
    let rescued = log
        .iter()
        .find(|l| l.contains("call succeeded thanks to"))
        .unwrap();
    assert!(rescued.contains("1 resume(s) of its stream"), "{rescued}");
}

/// Issue 22, item 16: a call that succeeded only thanks to a failover, or to a hedge,
/// says so in one info line naming what happened (the resume case is above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_rescued_by_a_failover_or_a_hedge_says_so_in_one_info_line() {
    // A failover: the primary answers 500, the fallback the whole answer.
    let a = mock(Behavior {
        status: 500,
        ..words(10)
    })
    .await;
    let b = mock(words(10)).await;
    let s = serve(&env(&a, &b, &[], &[("POLYGW_LOG", "info")]));
    let seen = stream_through(&s.base, "fail over").await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, planned(&b).await);
    let log = lines_so_far(&s, "call succeeded thanks to", 1);
    let rescued: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("call succeeded thanks to"))
        .collect();
    assert_eq!(rescued.len(), 1, "{rescued:#?}");
    assert!(
        rescued[0].contains("a failover (failed: a-0: server_error)"),
        "{}",
        rescued[0]
    );
    drop(s);
    // A hedge: the primary's first token takes 5 s, a static 0.2 s threshold launches
    // the fallback, which wins.
    let a = mock(Behavior {
        ttft_ms: 5_000.0,
        ..words(10)
    })
    .await;
    let b = mock(words(10)).await;
    let s = serve(&env(
        &a,
        &b,
        &[],
        &[
            ("POLYGW_LOG", "info"),
            ("LLM__HEDGE__AFTER_S", "0.2"),
            ("LLM__HEDGE__STALL_AFTER_S", "off"),
            ("LLM__HEDGE__BUDGET_PCT", "0"),
        ],
    ));
    let seen = stream_through(&s.base, "hedge me").await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, planned(&b).await);
    let log = lines_so_far(&s, "call succeeded thanks to", 1);
    let rescued = log
        .iter()
        .find(|l| l.contains("call succeeded thanks to"))
        .unwrap();
    assert!(
        rescued.contains("a hedge (1 extra leg(s), one won)") && !rescued.contains("failover"),
        "{rescued}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_without_prefill_replays_and_forwards_only_the_remainder() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[], &[]));
    let seen = stream_through(&s.base, "replay me").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full, "no character duplicated or lost");
    assert_eq!(seen.ids.len(), 1);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(rb[0].prefill, None);
    assert_eq!(rb[0].content, full, "b produced the whole answer again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_diverges_ends_with_the_original_failure() {
    let a = mock(Behavior::text(&["Other", " text", " entirely"])).await;
    a.push_script(with_fault(words(60), Fault::ResetAfter { chunks: 30 }));
    let b = mock(Behavior::text(&["Something", " else"])).await;
    let s = serve(&env(&a, &b, &[], &[]));
    let seen = stream_through(&s.base, "diverge").await;
    let err = seen.error.expect("the stream ends with an error");
    assert!(
        err.contains("truncated") || err.contains("broke off"),
        "the original failure names the cut: {err}"
    );
    assert!(!seen.content.is_empty());
    assert!(
        !seen.content.contains("Something") && !seen.content.contains("Other"),
        "nothing of a diverged replay reached the client: {}",
        seen.content
    );
    // The resume was tried (the stream ended after every attempt): replays of the
    // original request (no prefill configured), on b and on a (the same source is
    // allowed after a failure), as many as STREAM__MAX_RESUMES (2); all diverged.
    let (ra, rb) = (a.requests(), b.requests());
    assert!(!rb.is_empty(), "b was tried");
    assert_eq!(ra.len() + rb.len(), 3, "the cut leg and two replays");
    assert!(ra[1..].iter().chain(rb.iter()).all(|r| r.prefill.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_tool_call_stream_is_replayed() {
    let tool = ToolCallSpec {
        arguments: r#"{"city":"Paris","unit":"celsius","days":3}"#.into(),
        fragments: 8,
        ..ToolCallSpec::default()
    };
    let script = Behavior {
        tool_call: Some(tool.clone()),
        ..Behavior::text(&["Let me", " check."])
    };
    // Chunks: 2 of content, then tool fragments; the cut lands inside the arguments.
    let a = mock(with_fault(script.clone(), Fault::ResetAfter { chunks: 6 })).await;
    let b = mock(script).await;
    let s = serve(&env(&a, &b, &[("PREFILL", "prefix")], &[]));
    let seen = stream_through(&s.base, "weather").await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, "Let me check.");
    assert_eq!(seen.tool_args, tool.arguments, "arguments exactly once");
    assert_eq!(seen.tool_name.as_deref(), Some("get_weather"));
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill, None,
        "a tool-call stream is resumed by replay only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_ends_a_resume_cleanly() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(Behavior {
        ttft_ms: 20_000.0,
        ..words(60)
    })
    .await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "prefix")],
        &[("LLM__CALL_DEADLINE_S", "1.5")],
    ));
    let t = Instant::now();
    let seen = stream_through(&s.base, "too slow").await;
    assert!(t.elapsed() < Duration::from_secs(10));
    let err = seen.error.expect("an in-stream error");
    assert!(err.contains("deadline"), "{err}");
    let full = planned(&a).await;
    // What was delivered stays: the 30 chunks sent before the reset, or fewer when
    // the reset discarded bytes the gateway had not read yet.
    let sent = prefix_of_words(&full, 30);
    assert!(
        !seen.content.is_empty() && sent.starts_with(&seen.content),
        "{:?} is not a prefix of {sent:?}",
        seen.content
    );
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(rb[0].end, EndKind::ClientDisconnected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_band_error_event_is_resumed() {
    let a = mock(with_fault(
        words(60),
        Fault::ErrorFrameAt {
            chunk: 25,
            error: None,
        },
    ))
    .await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[("PREFILL", "assistant")], &[]));
    let seen = stream_through(&s.base, "in-band error").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    assert_eq!(seen.ids.len(), 1);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    let p = rb[0].prefill.clone().expect("a prefill request");
    assert_eq!(
        (p.dialect, p.outcome, p.prefix_chars),
        (
            PrefillDialect::Assistant,
            PrefillOutcome::Continued,
            prefix_of_words(&full, 25).chars().count()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inter_token_timeout_is_resumed() {
    // No stall hedge: the primary's own watchdog cuts the silent stream after 0.5 s,
    // and the failure is resumed on the fallback.
    let a = mock(stalls_after(20)).await;
    let b = mock(words(60)).await;
    let mut vars = env(&a, &b, &[("PREFILL", "partial")], &[]);
    vars.push(("LLM__A__0__INTER_TOKEN_TIMEOUT_S".into(), "0.5".into()));
    let s = serve(&vars);
    let seen = stream_through(&s.base, "a watchdog").await;
    let full = planned(&a).await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, full);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill.as_ref().map(|p| (p.dialect, p.prefix_chars)),
        Some((
            PrefillDialect::Partial,
            prefix_of_words(&full, 20).chars().count()
        ))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_prefill_never_replays_and_ends_with_the_original_failure() {
    // STREAM__RESUME=prefill and a fallback without PREFILL: nothing may resume.
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 30 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[], &[("LLM__STREAM__RESUME", "prefill")]));
    let seen = stream_through(&s.base, "prefill only").await;
    let err = seen.error.expect("the stream ends with an error");
    assert!(
        err.contains("truncated") || err.contains("broke off"),
        "the original failure: {err}"
    );
    let full = planned(&a).await;
    assert!(full.starts_with(&seen.content) && !seen.content.is_empty());
    assert!(b.requests().is_empty(), "no replay was sent to b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_resumes_bounds_the_chain_of_resumes() {
    // Every leg is cut: with MAX_RESUMES=1 the stream is resumed once, then ends.
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 20 })).await;
    let b = mock(with_fault(words(60), Fault::ResetAfter { chunks: 10 })).await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "prefix")],
        &[
            ("LLM__STREAM__MAX_RESUMES", "1"),
            ("LLM__RETRY__MAX_ATTEMPTS", "5"),
        ],
    ));
    let seen = stream_through(&s.base, "cut twice").await;
    assert!(seen.error.is_some(), "{seen:?}");
    let full = planned(&a).await;
    assert!(full.starts_with(&seen.content), "{:?}", seen.content);
    let total = a.requests().len() + b.requests().len();
    assert_eq!(total, 2, "the first leg and one resume");
}

/// The final usage chunk sums the legs whose text was delivered; a cut leg's share is
/// an estimate, and the chunk says so (raw SSE: the OpenAI client types drop the
/// `polygw` member). The metrics count the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_of_a_resumed_stream_is_summed_and_marked_estimated() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 40 })).await;
    let b = mock(words(60)).await;
    let s = serve(&env(&a, &b, &[("PREFILL", "prefix")], &[]));
    let body = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&serde_json::json!({"model": "llm", "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "count my tokens"}]}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let frames: Vec<serde_json::Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let usage_frame = frames
        .iter()
        .find(|f| f.get("usage").is_some_and(|u| !u.is_null()))
        .expect("a usage chunk");
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    let continuation = rb[0]
        .usage
        .as_ref()
        .expect("usage reported")
        .completion_tokens;
    let completion = usage_frame["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        completion > continuation,
        "the cut leg's share is added: {completion} vs the fallback's {continuation}"
    );
    assert_eq!(usage_frame["polygw"]["usage_source"], "estimated");
    let finish = frames
        .iter()
        .filter_map(|f| f["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish, ["stop"], "one finish_reason, the last leg's");
    let metrics = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("polygw_resumes_total{")
                && l.contains("mode=\"prefill\"")
                && l.contains("outcome=\"ok\"")
        })
        .unwrap_or_else(|| panic!("no resume counted: {metrics}"));
    assert!(line.ends_with(" 1"), "{line}");
}

// ------------------------------------------------------------- the library, in process

fn lib_vars(a: &MockUpstream, b: &MockUpstream, b_prefill: Option<&str>) -> Vec<(String, String)> {
    let mut v = vec![
        ("LLM__A__0__BASE_URL".into(), a.base_url()),
        ("LLM__A__0__API_KEY".into(), "sk-a".into()),
        ("LLM__A__0__MODEL".into(), "model-a".into()),
        ("LLM__A__0__PRIORITY".into(), "0".into()),
        ("LLM__B__0__BASE_URL".into(), b.base_url()),
        ("LLM__B__0__API_KEY".into(), "sk-b".into()),
        ("LLM__B__0__MODEL".into(), "model-b".into()),
        ("LLM__B__0__PRIORITY".into(), "1".into()),
        ("LLM__RETRY__BACKOFF_BASE_S".into(), "0.01".into()),
        ("LLM__RETRY__BACKOFF_MAX_S".into(), "0.02".into()),
    ];
    if let Some(p) = b_prefill {
        v.push(("LLM__B__0__PREFILL".into(), p.into()));
    }
    v
}

/// Aggregated `chat()`: the failed leg's text is continued by prefill on the fallback
/// (only the remainder is generated), the usage is the sum and marked estimated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_chat_continues_a_cut_stream_by_prefill() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 40 })).await;
    let b = mock(words(60)).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut vars = lib_vars(&a, &b, Some("prefix"));
    vars.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    let c = GatewayClient::from_vars(vars, "LLM").await.unwrap();
    let r = c
        .chat(ChatRequest::user("aggregate").with_stream(true))
        .await
        .unwrap();
    let full = planned(&a).await;
    assert_eq!(r.content, full);
    assert_eq!(r.source, "b-0");
    assert_eq!(r.call_stats.resumes, 1);
    assert_eq!(r.call_stats.attempts, 2);
    assert_eq!(
        r.usage_source,
        UsageSource::Estimated,
        "a part of it is estimated"
    );
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        rb[0].prefill.as_ref().map(|p| p.outcome),
        Some(PrefillOutcome::Continued)
    );
    assert!(r.usage.completion_tokens >= 60, "{:?}", r.usage);
    assert_eq!(c.in_flight("a-0").await.unwrap(), 0);
    assert_eq!(c.in_flight("b-0").await.unwrap(), 0);
    c.shutdown().await;
    // One row per attempt; the resume leg names the attempt it continues.
    let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
    let cut = rows
        .iter()
        .find(|x| x.source.as_deref() == Some("a-0"))
        .unwrap();
    let resume = rows
        .iter()
        .find(|x| x.source.as_deref() == Some("b-0"))
        .unwrap();
    assert_eq!(cut.error.as_deref(), Some("truncated"));
    assert_eq!(cut.resume_of, None);
    assert_eq!(resume.resume_of.as_deref(), Some(cut.call_id.as_str()));
    assert_eq!(resume.resume_mode.as_deref(), Some("prefill"));
    // The row says what the fallback was sent (the upstream's own count).
    assert_eq!(
        resume.prefix_chars,
        rb[0].prefill.as_ref().map(|p| p.prefix_chars as u64)
    );
    assert!(resume.ok);
    assert_eq!(
        resume.usage_source,
        UsageSource::Measured,
        "the leg's own usage"
    );
}

/// Aggregated `chat()`: a stall hedge continues the stalled leg's text by prefill; a
/// continuation that is itself slow to start is backed up by another continuation of
/// the same text (not a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_stall_hedges_continue_the_answer() {
    let a = mock(stalls_after(20)).await;
    let b = mock(Behavior {
        ttft_ms: 30_000.0,
        ..words(60)
    })
    .await;
    let c = mock(words(60)).await;
    let mut vars = lib_vars(&a, &b, Some("prefix"));
    vars.extend([
        ("LLM__C__0__BASE_URL".into(), c.base_url()),
        ("LLM__C__0__API_KEY".into(), "sk-c".into()),
        ("LLM__C__0__MODEL".into(), "model-c".into()),
        ("LLM__C__0__PRIORITY".into(), "2".into()),
        ("LLM__C__0__PREFILL".into(), "assistant".into()),
        ("LLM__HEDGE__STALL_AFTER_S".into(), "0.3".into()),
        ("LLM__HEDGE__AFTER_S".into(), "0.5".into()),
        ("LLM__HEDGE__MAX_EXTRA".into(), "2".into()),
        ("LLM__HEDGE__BUDGET_PCT".into(), "0".into()),
    ]);
    let gw = GatewayClient::from_vars(vars, "LLM").await.unwrap();
    let t = Instant::now();
    let r = gw
        .chat(ChatRequest::user("stall then slow").with_stream(true))
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let full = a.requests()[0].full_content.clone();
    assert_eq!(
        r.content, full,
        "the stalled leg's text plus the continuation"
    );
    assert_eq!(r.source, "c-0");
    assert_eq!(
        (r.call_stats.hedges, r.call_stats.resumes),
        (2, 2),
        "{:?}",
        r.call_stats
    );
    let prefix = prefix_of_words(&full, 20);
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    let rc = c.wait_for_ended(1, Duration::from_secs(5)).await;
    for (name, rec) in [("b", &rb[0]), ("c", &rc[0])] {
        let p = rec
            .prefill
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: a prefill"));
        assert_eq!(p.prefix_chars, prefix.chars().count(), "{name}");
    }
    assert_eq!(rb[0].end, EndKind::ClientDisconnected, "b was cancelled");
    gw.shutdown().await;
}

/// `chat_stream()`: the public streaming API has the passthrough semantics, resume
/// included: the deltas are the exact answer, then the whole response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_yields_one_uninterrupted_answer() {
    let a = mock(with_fault(words(50), Fault::ResetAfter { chunks: 20 })).await;
    let b = mock(words(50)).await;
    let c = GatewayClient::from_vars(lib_vars(&a, &b, None), "LLM")
        .await
        .unwrap();
    let mut st = c.chat_stream(ChatRequest::user("stream me"));
    let mut text = String::new();
    let mut commits = Vec::new();
    let mut done = None;
    while let Some(ev) = st.next().await {
        match ev.unwrap() {
            ChatEvent::Committed(c) => commits.push(c),
            ChatEvent::Delta(d) => text.push_str(d.content.as_deref().unwrap_or("")),
            ChatEvent::Done(r) => done = Some(r),
        }
    }
    let full = planned(&a).await;
    assert_eq!(text, full);
    let r = done.expect("the response");
    assert_eq!(r.content, full);
    assert_eq!(commits.len(), 2);
    assert!(commits[0].first && !commits[1].first);
    assert_eq!(commits[0].source, "a-0");
    assert_eq!(commits[1].source, "b-0");
    assert_eq!(r.call_stats.resumes, 1);
}

// ------------------------------------------------- SPEC §17.1, §17.8: honest answers

/// Fixed words (the same text whatever the request), so a source that ignores the
/// prefill and answers from scratch says exactly what the primary had begun.
fn fixed_words(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            if i == 0 {
                "Mock".to_string()
            } else {
                format!(" response{i}")
            }
        })
        .collect()
}

/// Issue 22, item 1: `PREFILL=assistant` on a fallback that ignores prefill (it reads
/// the trailing assistant message as history and answers from the start) must not
/// duplicate the delivered text: the repeat is recognised as a replay and only the
/// remainder is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_that_ignores_prefill_duplicates_nothing() {
    let text = fixed_words(30);
    let a = mock(with_fault(
        Behavior {
            chunks: text.clone(),
            ..Behavior::default()
        },
        Fault::ResetAfter { chunks: 2 },
    ))
    .await;
    let b = mock(
        Behavior {
            chunks: text.clone(),
            ..Behavior::default()
        }
        .with_prefill(PrefillPolicy::ignore()),
    )
    .await;
    let s = serve(&env(&a, &b, &[("PREFILL", "assistant")], &[]));
    let seen = stream_through(&s.base, "say it once").await;
    assert_eq!(seen.error, None);
    assert_eq!(seen.content, text.concat(), "the answer once, exactly");
    assert_eq!(seen.finish.as_deref(), Some("Stop"));
    let rb = b.wait_for_ended(1, Duration::from_secs(5)).await;
    let p = rb[0]
        .prefill
        .clone()
        .expect("the fallback was sent a prefill");
    assert_eq!(p.outcome, PrefillOutcome::Ignored, "the mock ignored it");
}

/// Issue 22, item 2: `MAX_RESUMES` bounds resumes over every continuation round: with
/// every leg cut and `MAX_RESUMES=2`, the first leg and two resumes are sent, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_resumes_holds_across_rounds() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 10 })).await;
    let b = mock(with_fault(words(60), Fault::ResetAfter { chunks: 5 })).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut vars = lib_vars(&a, &b, Some("prefix"));
    vars.push(("LLM__A__0__PREFILL".into(), "prefix".into()));
    vars.push(("LLM__STREAM__MAX_RESUMES".into(), "2".into()));
    vars.push(("LLM__RETRY__MAX_ATTEMPTS".into(), "8".into()));
    vars.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    let c = GatewayClient::from_vars(vars, "LLM").await.unwrap();
    let e = c
        .chat(ChatRequest::user("cut every time").with_stream(true))
        .await
        .expect_err("every leg is cut");
    c.shutdown().await;
    // Nothing reached a client yet, so once the resumes are spent the call may start
    // over (fresh attempts, within MAX_ATTEMPTS) — never resume a third time.
    let total = a.requests().len() + b.requests().len();
    assert!(total <= 8, "{e}");
    let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
    let resumes = rows.iter().filter(|x| x.resume_of.is_some()).count();
    assert_eq!(
        resumes,
        2,
        "{:?}",
        rows.iter()
            .map(|x| (&x.source, &x.resume_of, &x.error))
            .collect::<Vec<_>>()
    );
}

/// Issue 22, item 2, through the proxy: the client has the text, so nothing starts
/// over: with every leg cut and `MAX_RESUMES=2`, three requests in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_resumes_bounds_a_streamed_answer_across_rounds() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 20 })).await;
    let b = mock(with_fault(words(60), Fault::ResetAfter { chunks: 10 })).await;
    let s = serve(&env(
        &a,
        &b,
        &[("PREFILL", "prefix")],
        &[
            ("LLM__A__0__PREFILL", "prefix"),
            ("LLM__STREAM__MAX_RESUMES", "2"),
            ("LLM__RETRY__MAX_ATTEMPTS", "8"),
        ],
    ));
    let seen = stream_through(&s.base, "cut thrice").await;
    assert!(seen.error.is_some(), "{seen:?}");
    let total = a.requests().len() + b.requests().len();
    assert_eq!(total, 3, "the first leg and two resumes");
}

/// Issue 22, items 4 and 5 (SPEC §17.8): the cut leg's row carries the estimate the
/// answer counts for it (and its time to first token), and the answer's usage is
/// exactly the resume's measured usage plus that estimate — telemetry and the answer
/// agree to the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_usage_is_the_sum_of_the_rows() {
    let a = mock(with_fault(words(60), Fault::ResetAfter { chunks: 40 })).await;
    let b = mock(words(60)).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut vars = lib_vars(&a, &b, Some("prefix"));
    vars.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    let c = GatewayClient::from_vars(vars, "LLM").await.unwrap();
    let r = c
        .chat(ChatRequest::user("sum my rows").with_stream(true))
        .await
        .unwrap();
    c.shutdown().await;
    let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
    let row = |s: &str| {
        rows.iter()
            .find(|x| x.source.as_deref() == Some(s))
            .unwrap()
            .clone()
    };
    let (cut, resume) = (row("a-0"), row("b-0"));
    assert_eq!(cut.usage_source, UsageSource::Estimated, "{cut:?}");
    assert!(cut.ttft_ms.is_some(), "the cut leg streamed: {cut:?}");
    assert!(cut.completion_tokens.unwrap() > 0);
    assert_eq!(resume.usage_source, UsageSource::Measured);
    assert_eq!(
        r.usage.completion_tokens,
        cut.completion_tokens.unwrap() + resume.completion_tokens.unwrap(),
        "{:?} = {cut:?} + {resume:?}",
        r.usage
    );
    assert_eq!(
        r.usage.prompt_tokens,
        cut.prompt_tokens.unwrap() + resume.prompt_tokens.unwrap(),
    );
    assert_eq!(r.usage_source, UsageSource::Estimated);
}

/// Issue 22, item 7: an aggregated answer continued by prefill holds the reasoning the
/// cut leg streamed (the continuation does not think again), not only the winner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregated_continuation_keeps_the_cut_legs_reasoning() {
    let thought: Vec<String> = ["Let", " me", " think", " first."]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let a = mock(with_fault(
        Behavior {
            reasoning: thought.clone(),
            ..words(60)
        },
        Fault::ResetAfter { chunks: 20 },
    ))
    .await;
    let b = mock(Behavior {
        reasoning: thought.clone(),
        ..words(60)
    })
    .await;
    let c = GatewayClient::from_vars(lib_vars(&a, &b, Some("prefix")), "LLM")
        .await
        .unwrap();
    let r = c
        .chat(ChatRequest::user("think, then answer").with_stream(true))
        .await
        .unwrap();
    let full = planned(&a).await;
    assert_eq!(r.content, full);
    assert_eq!(r.call_stats.resumes, 1);
    assert_eq!(
        r.reasoning_content.as_deref(),
        Some(thought.concat().as_str())
    );
    c.shutdown().await;
}
