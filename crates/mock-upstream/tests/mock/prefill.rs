//! Prefill over real loopback HTTP (SPEC §13.7): each dialect continued (streamed and
//! plain), rejected and ignored; continuations that start mid-chunk and mid-word in
//! multi-byte text; deterministic words across mocks and sampled chunk counts; faults
//! and `max_tokens` on a continuation; the request log's prefill fields.

use std::time::Duration;

use polygw_mock_upstream::{
    Behavior, EndKind, Fault, LongTail, MockConfig, MockUpstream, PrefillDialect, PrefillMode,
    PrefillOutcome, PrefillPolicy, PrefillSeen, Profile, ProfileKind, RecordedRequest,
    ToolCallSpec,
};
use serde_json::{json, Value};

use super::{json_of, mock, post, raw_exchange, sse_data};

const PLANNED: [&str; 4] = ["Héllo", " wörld", " 🦀", " ok."];

fn planned() -> Behavior {
    Behavior::text(&PLANNED)
}

/// A chat request whose final assistant message carries `prefix` in `dialect`.
fn prefill_body(dialect: PrefillDialect, stream: bool, user: &str, prefix: &str) -> Value {
    let mut b = json!({"model": "m-test", "stream": stream, "messages": [
        {"role": "user", "content": user},
        {"role": "assistant", "content": prefix},
    ]});
    match dialect {
        PrefillDialect::Assistant => {}
        PrefillDialect::Prefix => b["messages"][1]["prefix"] = json!(true),
        PrefillDialect::Partial => b["messages"][1]["partial"] = json!(true),
        PrefillDialect::Vllm => {
            b["continue_final_message"] = json!(true);
            b["add_generation_prompt"] = json!(false);
        }
    }
    b
}

fn user_body(stream: bool, user: &str) -> Value {
    json!({"model": "m-test", "stream": stream, "messages": [{"role": "user", "content": user}]})
}

/// What a streamed or plain answer carried.
#[derive(Debug, Default)]
struct Answer {
    chunks: Vec<String>,
    content: String,
    reasoning: String,
    tool_args: String,
    finish: Option<String>,
    usage: Option<Value>,
}

async fn answer(r: reqwest::Response, stream: bool) -> Answer {
    assert_eq!(r.status(), 200);
    let mut a = Answer::default();
    if !stream {
        let v = json_of(r).await;
        let msg = &v["choices"][0]["message"];
        a.content = msg["content"].as_str().unwrap_or("").to_string();
        a.reasoning = msg["reasoning_content"].as_str().unwrap_or("").to_string();
        a.tool_args = msg["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap_or("")
            .to_string();
        a.finish = v["choices"][0]["finish_reason"]
            .as_str()
            .map(str::to_string);
        a.usage = v.get("usage").cloned();
        return a;
    }
    let text = r.text().await.unwrap();
    let (data, _) = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    for d in &data[..data.len() - 1] {
        let f: Value = serde_json::from_str(d).unwrap();
        if let Some(u) = f.get("usage") {
            a.usage = Some(u.clone());
        }
        let Some(c) = f["choices"].get(0) else {
            continue;
        };
        let delta = &c["delta"];
        if let Some(s) = delta["content"].as_str().filter(|s| !s.is_empty()) {
            a.chunks.push(s.to_string());
            a.content.push_str(s);
        }
        if let Some(s) = delta["reasoning_content"].as_str() {
            a.reasoning.push_str(s);
        }
        if let Some(s) = delta["tool_calls"][0]["function"]["arguments"].as_str() {
            a.tool_args.push_str(s);
        }
        if let Some(s) = c["finish_reason"].as_str() {
            a.finish = Some(s.to_string());
        }
    }
    a
}

async fn last_ended(m: &MockUpstream, n: usize) -> RecordedRequest {
    let log = m.wait_for_ended(n, Duration::from_secs(5)).await;
    assert!(log.len() >= n && log[n - 1].ended(), "{log:?}");
    log[n - 1].clone()
}

#[tokio::test]
async fn every_dialect_is_continued_mid_chunk_and_mid_word_streamed_and_plain() {
    let m = mock().await;
    m.set_default(planned());
    let prefix = "Héllo wö"; // ends inside the second chunk, inside a word
    let mut n = 0;
    for dialect in PrefillDialect::ALL {
        for stream in [true, false] {
            n += 1;
            let r = post(
                &m,
                "/chat/completions",
                prefill_body(dialect, stream, "q", prefix),
            )
            .await;
            let a = answer(r, stream).await;
            let ctx = format!("{dialect} stream={stream}");
            assert_eq!(a.content, "rld 🦀 ok.", "{ctx}");
            if stream {
                assert_eq!(a.chunks, ["rld", " 🦀", " ok."], "{ctx}");
            }
            assert_eq!(a.finish.as_deref(), Some("stop"), "{ctx}");
            let u = a.usage.unwrap();
            assert_eq!(u["completion_tokens"], 3, "only the continuation: {ctx}");
            assert_eq!(
                u["prompt_tokens"], 3,
                "⌈(1 + 8 chars) / 4⌉, prefix included: {ctx}"
            );
            let rec = last_ended(&m, n).await;
            assert_eq!(
                rec.prefill,
                Some(PrefillSeen {
                    dialect,
                    prefix_chars: 8,
                    matched: true,
                    outcome: PrefillOutcome::Continued,
                }),
                "{ctx}"
            );
            assert_eq!(rec.content, "rld 🦀 ok.", "{ctx}");
            assert_eq!(rec.full_content, PLANNED.concat(), "{ctx}");
            assert_eq!(rec.chunks_sent, 3, "{ctx}");
            assert!(!rec.prefill_rejected());
            assert_eq!(rec.usage.unwrap().completion_tokens, 3);
        }
    }
    // Boundaries: a prefix ending between chunks, the whole answer, and no prefix.
    for (prefix, rest) in [
        ("Héllo", " wörld 🦀 ok."),
        ("Héllo wörld 🦀 ok.", ""),
        ("", "Héllo wörld 🦀 ok."),
        ("Héllo wörld 🦀", " ok."),
    ] {
        let body = prefill_body(PrefillDialect::Prefix, true, "q", prefix);
        let a = answer(post(&m, "/chat/completions", body).await, true).await;
        assert_eq!(a.content, rest, "prefix {prefix:?}");
        assert_eq!(format!("{prefix}{}", a.content), PLANNED.concat());
    }
    m.shutdown().await;
}

#[tokio::test]
async fn a_prefix_the_plan_does_not_start_with_gets_the_whole_plan_recorded_as_unmatched() {
    let m = mock().await;
    m.set_default(planned());
    let body = prefill_body(PrefillDialect::Partial, true, "q", "Bonjour");
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!(a.content, PLANNED.concat());
    let rec = last_ended(&m, 1).await;
    let seen = rec.prefill.unwrap();
    assert!(!seen.matched);
    assert_eq!(seen.outcome, PrefillOutcome::Continued);
    assert_eq!(rec.full_content, format!("Bonjour{}", PLANNED.concat()));
    assert_eq!(rec.content, PLANNED.concat());
}

#[tokio::test]
async fn every_dialect_is_rejected_with_a_provider_like_400() {
    let m = MockUpstream::start(MockConfig {
        prefill: PrefillPolicy::reject(),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(planned());
    for (i, dialect) in PrefillDialect::ALL.into_iter().enumerate() {
        let r = post(
            &m,
            "/chat/completions",
            prefill_body(dialect, true, "q", "Hé"),
        )
        .await;
        assert_eq!(r.status(), 400, "{dialect}");
        let v = json_of(r).await;
        assert_eq!(v["error"]["message"], dialect.rejection_message());
        assert_eq!(v["error"]["code"], "invalid_request_error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let rec = last_ended(&m, i + 1).await;
        assert!(rec.prefill_rejected(), "{dialect}");
        assert_eq!(rec.end, EndKind::Error { status: 400 });
        assert_eq!(rec.status, 400);
        assert_eq!(rec.prefill.as_ref().unwrap().prefix_chars, 2);
        assert!(!rec.prefill.as_ref().unwrap().matched);
        assert_eq!(rec.chunks_sent, 0);
    }
    let msgs: Vec<&str> = PrefillDialect::ALL
        .iter()
        .map(|d| d.rejection_message())
        .collect();
    assert!(msgs[0].contains("does not support assistant message prefill"));
    assert!(msgs[1].contains("Prefix completion") && msgs[1].contains("beta"));
    assert!(msgs[2].contains("Partial mode") && msgs[2].contains("not supported"));
    assert!(msgs[3].contains("continue_final_message") && msgs[3].contains("not supported"));

    // An ordinary request is answered; a script's own policy wins over the server's.
    let a = answer(
        post(&m, "/chat/completions", user_body(true, "q")).await,
        true,
    )
    .await;
    assert_eq!(a.content, PLANNED.concat());
    m.push_script(planned().with_prefill(PrefillPolicy::accept_all()));
    let body = prefill_body(PrefillDialect::Prefix, false, "q", "Héllo");
    let a = answer(post(&m, "/chat/completions", body).await, false).await;
    assert_eq!(a.content, " wörld 🦀 ok.");
    m.shutdown().await;
}

#[tokio::test]
async fn listed_dialects_are_continued_and_the_others_rejected_or_ignored() {
    let m = MockUpstream::start(MockConfig {
        prefill: PrefillPolicy::only(&[PrefillDialect::Prefix]),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(planned());
    let go = |d, s| post(&m, "/chat/completions", prefill_body(d, s, "q", "Héllo"));
    let a = answer(go(PrefillDialect::Prefix, true).await, true).await;
    assert_eq!(a.content, " wörld 🦀 ok.");
    for d in [PrefillDialect::Partial, PrefillDialect::Vllm] {
        let r = go(d, true).await;
        assert_eq!(r.status(), 400, "{d}");
        assert_eq!(json_of(r).await["error"]["message"], d.rejection_message());
    }
    // `assistant` is not listed: a plain trailing assistant message is mere history.
    let a = answer(go(PrefillDialect::Assistant, true).await, true).await;
    assert_eq!(a.content, PLANNED.concat());
    let log = m.wait_for_ended(4, Duration::from_secs(5)).await;
    assert_eq!(log[3].prefill, None);
    assert_eq!(log[3].full_content, PLANNED.concat());

    // `ignore` with a list: the listed dialect continued, the others ignored.
    m.set_prefill(PrefillPolicy {
        mode: PrefillMode::Ignore,
        dialects: Some(vec![PrefillDialect::Vllm]),
    });
    let a = answer(go(PrefillDialect::Vllm, false).await, false).await;
    assert_eq!(a.content, " wörld 🦀 ok.");
    let a = answer(go(PrefillDialect::Partial, false).await, false).await;
    assert_eq!(a.content, PLANNED.concat());
    // vLLM's own conflict: continue_final_message with add_generation_prompt true.
    let mut body = prefill_body(PrefillDialect::Vllm, true, "q", "Héllo");
    body["add_generation_prompt"] = json!(true);
    let r = post(&m, "/chat/completions", body).await;
    assert_eq!(r.status(), 400);
    assert_eq!(
        json_of(r).await["error"]["message"],
        polygw_mock_upstream::VLLM_CONFLICT_MESSAGE
    );
    m.shutdown().await;
}

#[tokio::test]
async fn ignore_mode_answers_from_scratch() {
    let m = MockUpstream::start(MockConfig {
        prefill: PrefillPolicy::ignore(),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(planned());
    for (i, dialect) in PrefillDialect::ALL.into_iter().enumerate() {
        let body = prefill_body(dialect, i % 2 == 0, "q", "Héllo");
        let a = answer(post(&m, "/chat/completions", body).await, i % 2 == 0).await;
        assert_eq!(a.content, PLANNED.concat(), "{dialect}");
        assert_eq!(a.usage.unwrap()["completion_tokens"], 4);
        let rec = last_ended(&m, i + 1).await;
        assert_eq!(
            rec.prefill,
            Some(PrefillSeen {
                dialect,
                prefix_chars: 5,
                matched: false,
                outcome: PrefillOutcome::Ignored,
            })
        );
        assert_eq!(rec.full_content, PLANNED.concat());
    }
    // Behavior JSON sets it per script too.
    let b: Behavior = serde_json::from_value(json!({
        "chunks": PLANNED, "prefill": "accept", "prefill_dialects": ["partial"]
    }))
    .unwrap();
    m.push_script(b);
    let body = prefill_body(PrefillDialect::Partial, true, "q", "Héllo");
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!(a.content, " wörld 🦀 ok.");
    m.shutdown().await;
}

fn sampling_profile(seed: u64) -> Profile {
    Profile {
        name: "words".into(),
        time_scale: 0.0,
        seed,
        kind: ProfileKind::LongTail(LongTail {
            chunks_min: 3,
            chunks_max: 30,
            long_stall_p: 0.0,
            short_stall_p: 0.0,
            reasoning_p: 0.0,
            ..LongTail::default()
        }),
    }
}

#[tokio::test]
async fn generated_words_depend_on_the_request_only_so_a_replay_reproduces_the_prefix() {
    let a = MockUpstream::start(MockConfig::with_profile(sampling_profile(1)))
        .await
        .unwrap();
    let b = MockUpstream::start(MockConfig::with_profile(sampling_profile(2)))
        .await
        .unwrap();
    let mut answers = Vec::new();
    for i in 0..6 {
        let m = if i % 2 == 0 { &a } else { &b };
        let mut body = user_body(i % 3 == 0, "tell me");
        body["model"] = json!(format!("model-{i}"));
        let r = post(m, "/chat/completions", body).await;
        answers.push(answer(r, i % 3 == 0).await.content);
    }
    let counts: std::collections::BTreeSet<usize> =
        answers.iter().map(|c| c.split(' ').count()).collect();
    assert!(counts.len() > 1, "sampled chunk counts differ: {counts:?}");
    let longest = answers.iter().max_by_key(|c| c.len()).unwrap().clone();
    for c in &answers {
        assert!(longest.starts_with(c.as_str()), "{c:?} vs {longest:?}");
    }
    // Another question, other words.
    let other = answer(
        post(&a, "/chat/completions", user_body(false, "something else")).await,
        false,
    )
    .await
    .content;
    assert_ne!(other.split(' ').next(), longest.split(' ').next());

    // A prefix delivered by one draw is continued by another mock's draw: mid-word,
    // between words, and whatever that draw's length.
    let mut on_b = 3; // requests b has answered
    let shortest = answers.iter().min_by_key(|c| c.len()).unwrap().clone();
    for prefix in [
        longest[..longest.len() / 2].to_string(),
        longest.clone(),
        format!("{shortest} "),
    ] {
        let body = prefill_body(PrefillDialect::Partial, true, "tell me", &prefix);
        let cont = answer(post(&b, "/chat/completions", body).await, true)
            .await
            .content;
        on_b += 1;
        let full = format!("{prefix}{cont}");
        let rec = last_ended(&b, on_b).await;
        assert!(rec.prefill.as_ref().unwrap().matched, "{prefix:?}");
        assert_eq!(rec.full_content, full);
        assert!(
            full.starts_with(&longest) || longest.starts_with(&full),
            "{full:?} is not the same word stream as {longest:?}"
        );
    }
    // A planned answer shorter than the delivered prefix is extended along the same
    // words: the continuation finishes the word the prefix ends in.
    let eight = {
        b.push_script(Behavior {
            chunk_count: Some(8),
            ..Behavior::default()
        });
        answer(
            post(&b, "/chat/completions", user_body(true, "x")).await,
            true,
        )
        .await
    };
    let prefix: String = eight.chunks[..5].concat() + &eight.chunks[5][..3];
    b.push_script(Behavior {
        chunk_count: Some(3),
        ..Behavior::default()
    });
    let body = prefill_body(PrefillDialect::Prefix, false, "x", &prefix);
    let cont = answer(post(&b, "/chat/completions", body).await, false).await;
    assert_eq!(cont.content, eight.chunks[5][3..]);
    let rec = last_ended(&b, on_b + 2).await;
    assert!(rec.prefill.unwrap().matched);
    assert_eq!(rec.full_content, eight.chunks[..6].concat());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn with_length_by_request_every_mock_plans_one_length_and_a_continuation_ends_it() {
    let by_request = |seed| {
        let mut p = sampling_profile(seed);
        if let ProfileKind::LongTail(l) = &mut p.kind {
            l.length_by_request = true;
        }
        p
    };
    let a = MockUpstream::start(MockConfig::with_profile(by_request(1)))
        .await
        .unwrap();
    let b = MockUpstream::start(MockConfig::with_profile(by_request(2)))
        .await
        .unwrap();
    let mut lengths = std::collections::BTreeSet::new();
    for q in ["tell me", "another question", "a third one", "and a fourth"] {
        // The same question, four draws on two mocks: one answer.
        let mut seen = Vec::new();
        for i in 0..4 {
            let m = if i % 2 == 0 { &a } else { &b };
            seen.push(
                answer(
                    post(m, "/chat/completions", user_body(i == 0, q)).await,
                    i == 0,
                )
                .await
                .content,
            );
        }
        assert!(seen.iter().all(|c| c == &seen[0]), "{q}: {seen:?}");
        let words: Vec<&str> = seen[0].split_inclusive(' ').collect();
        lengths.insert(words.len());
        // A continuation from any point on the other mock ends the same answer.
        let cut = words.len() / 3;
        let prefix = seen[0][..seen[0].len() - words[cut..].concat().len()].to_string();
        let body = prefill_body(PrefillDialect::Assistant, true, q, &prefix);
        let cont = answer(post(&b, "/chat/completions", body).await, true).await;
        assert_eq!(format!("{prefix}{}", cont.content), seen[0], "{q}");
        assert_eq!(cont.finish.as_deref(), Some("stop"));
    }
    assert!(lengths.len() > 1, "lengths differ by question: {lengths:?}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn faults_count_the_continuations_chunks() {
    let m = mock().await;
    let chunks = ["ab", "cd", "ef", "gh", "ij"];
    m.push_script(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 2 }),
        ..Behavior::text(&chunks)
    });
    let body = prefill_body(PrefillDialect::Prefix, true, "q", "abc");
    let (got, end) = raw_exchange(&m, &body.to_string()).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains(r#""content":"d""#) && text.contains(r#""content":"ef""#));
    assert!(!text.contains(r#""content":"gh""#), "{text}");
    assert_eq!(end.unwrap_err().kind(), std::io::ErrorKind::ConnectionReset);
    let rec = last_ended(&m, 1).await;
    assert_eq!(rec.end, EndKind::ResetMidStream);
    assert_eq!((rec.chunks_sent, rec.content.as_str()), (2, "def"));
    assert_eq!(rec.full_content, "abcdefghij");

    m.push_script(Behavior {
        fault: Some(Fault::TruncateAfter { chunks: 1 }),
        ..Behavior::text(&chunks)
    });
    let body = prefill_body(PrefillDialect::Vllm, true, "q", "abcd");
    let text = post(&m, "/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();
    assert!(!text.contains("[DONE]"));
    let rec = last_ended(&m, 2).await;
    assert_eq!((rec.end, rec.content.as_str()), (EndKind::Truncated, "ef"));
    m.shutdown().await;
}

#[tokio::test]
async fn max_tokens_stops_with_length_on_answers_and_continuations() {
    let m = mock().await;
    m.set_default(Behavior {
        chunk_count: Some(10),
        ..Behavior::default()
    });
    let mut n = 0;
    for stream in [true, false] {
        let mut body = user_body(stream, "q");
        body["max_tokens"] = json!(4);
        let a = answer(post(&m, "/chat/completions", body).await, stream).await;
        n += 1;
        assert_eq!(a.finish.as_deref(), Some("length"));
        assert_eq!(a.usage.unwrap()["completion_tokens"], 4);
        let rec = last_ended(&m, n).await;
        assert_eq!(rec.chunks_sent, 4);
        assert_eq!(rec.content, rec.full_content);
        assert_eq!(rec.content.split(' ').count(), 4);
    }
    // The smaller of max_tokens and max_completion_tokens; not reached = as planned.
    let mut body = user_body(true, "q");
    body["max_tokens"] = json!(5);
    body["max_completion_tokens"] = json!(3);
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!((a.chunks.len(), a.finish.as_deref()), (3, Some("length")));
    let mut body = user_body(true, "q");
    body["max_tokens"] = json!(10);
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!((a.chunks.len(), a.finish.as_deref()), (10, Some("stop")));
    let full = a.content;
    // A continuation counts its own chunks.
    let words: Vec<&str> = full.split_inclusive(' ').collect();
    let prefix: String = words[..2].concat();
    let mut body = prefill_body(PrefillDialect::Prefix, true, "q", &prefix);
    body["max_tokens"] = json!(3);
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!((a.chunks.len(), a.finish.as_deref()), (3, Some("length")));
    assert!(full.starts_with(&format!("{prefix}{}", a.content)));
    m.shutdown().await;
}

#[tokio::test]
async fn reasoning_is_not_repeated_and_tool_calls_are_sent_as_planned() {
    let m = mock().await;
    let thinking = Behavior {
        reasoning: vec!["hmm".into(), " yes".into()],
        ..Behavior::text(&["The answer", " is 42."])
    };
    m.push_script(thinking.clone());
    let body = prefill_body(PrefillDialect::Assistant, true, "q", "The ans");
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!(
        (a.content.as_str(), a.reasoning.as_str()),
        ("wer is 42.", "")
    );
    let u = a.usage.unwrap();
    assert_eq!(u["completion_tokens"], 2);
    assert!(u.get("completion_tokens_details").is_none());
    // With nothing delivered yet, the answer thinks first as planned.
    m.push_script(thinking);
    let body = prefill_body(PrefillDialect::Assistant, true, "q", "");
    let a = answer(post(&m, "/chat/completions", body).await, true).await;
    assert_eq!(a.reasoning, "hmm yes");

    let tool = Behavior {
        tool_call: Some(ToolCallSpec {
            fragments: 3,
            ..ToolCallSpec::default()
        }),
        ..Behavior::text(&["Let me check", "."])
    };
    for stream in [true, false] {
        m.push_script(tool.clone());
        let body = prefill_body(PrefillDialect::Partial, stream, "q", "Let me");
        let a = answer(post(&m, "/chat/completions", body).await, stream).await;
        assert_eq!(a.content, " check.");
        assert_eq!(a.tool_args, ToolCallSpec::default().arguments);
        assert_eq!(a.finish.as_deref(), Some("tool_calls"));
    }
    let log = m.wait_for_ended(4, Duration::from_secs(5)).await;
    assert!(log.iter().all(|r| r.end == EndKind::Completed));
    m.shutdown().await;
}
