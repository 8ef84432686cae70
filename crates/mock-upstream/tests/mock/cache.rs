//! The simulated provider prefix cache over real loopback HTTP (SPEC §20.3): a growing
//! conversation reads a growing prefix within the TTL and nothing after it (tokio's
//! paused clock), each dialect's usage fields (streamed and plain), a hit's shorter
//! TTFT, rejected requests leave the cache alone, and the JSON settings of a profile
//! file.

use std::time::Duration;

use polygw_mock_upstream::{
    Behavior, CacheDialect, MockConfig, MockSettings, MockUpstream, PrefixCache, Profile,
    PromptCacheSeen, RecordedRequest, UsageMode,
};
use serde_json::{json, Value};

use super::{json_of, mock, now, post, sse_data};

/// `n` characters cycling over `tag`.
fn filler(tag: &str, n: usize) -> String {
    tag.chars().cycle().take(n).collect()
}

/// Turn `turns` (1..=3) of a conversation: one 4200-character system prompt, then
/// user questions of 300 characters and assistant answers of 500. Characters so far:
/// 4500, 5300, 6100 → 1125, 1325, 1525 prompt tokens.
fn conversation(turns: usize, stream: bool) -> Value {
    let mut msgs = vec![
        json!({"role": "system", "content": filler("You are a careful assistant; answer briefly. ", 4200)}),
    ];
    for t in 1..=turns {
        if t > 1 {
            msgs.push(json!({"role": "assistant", "content": filler(&format!("Answer {t} goes here. "), 500)}));
        }
        msgs.push(
            json!({"role": "user", "content": filler(&format!("Question {t}, please? "), 300)}),
        );
    }
    json!({"model": "m-cache", "stream": stream, "messages": msgs})
}

/// The usage object of a streamed (any usage mode) or plain answer.
async fn usage_of(r: reqwest::Response, stream: bool) -> Value {
    assert_eq!(r.status(), 200);
    if !stream {
        return json_of(r).await["usage"].clone();
    }
    let text = r.text().await.unwrap();
    let (data, _) = sse_data(&text);
    let mut usage = Value::Null;
    for d in data.iter().filter(|d| *d != "[DONE]") {
        let f: Value = serde_json::from_str(d).unwrap();
        if let Some(u) = f.get("usage") {
            usage = u.clone();
        }
        if let Some(u) = f["choices"].get(0).and_then(|c| c.get("usage")) {
            usage = u.clone();
        }
    }
    usage
}

async fn last(m: &MockUpstream, n: usize) -> RecordedRequest {
    let log = m.wait_for_ended(n, Duration::from_secs(5)).await;
    assert!(log.len() >= n && log[n - 1].ended(), "{log:?}");
    log[n - 1].clone()
}

#[tokio::test(start_paused = true)]
async fn a_growing_conversation_reads_a_growing_prefix_until_the_ttl() {
    let m = mock().await;
    // OpenAI's rule: hits of at least 1024 tokens in blocks of 128, 5 minutes.
    m.set_prefix_cache(PrefixCache::default());
    let mut n = 0;
    // (turns, stream, prompt tokens, cached tokens, blocks held after)
    let steps: [(usize, bool, u64, u64, usize); 3] = [
        (1, true, 1125, 0, 8),      // 4500 chars: 8 full blocks of 512 chars written
        (2, false, 1325, 1024, 10), // reads turn 1's 8 blocks, writes 10
        (3, true, 1525, 1280, 11),  // reads turn 2's 10 blocks, writes 11
    ];
    for (turns, stream, prompt, cached, held) in steps {
        let u = usage_of(
            post(&m, "/chat/completions", conversation(turns, stream)).await,
            stream,
        )
        .await;
        n += 1;
        assert_eq!(u["prompt_tokens"], prompt, "turn {turns}: {u}");
        assert_eq!(
            u["prompt_tokens_details"]["cached_tokens"], cached,
            "turn {turns}: {u}"
        );
        let rec = last(&m, n).await;
        assert_eq!(rec.usage.unwrap().cached_prompt_tokens, Some(cached));
        assert_eq!(
            rec.usage.unwrap().cache_write_tokens,
            None,
            "openai: unreported"
        );
        assert_eq!(
            rec.prompt_cache,
            Some(PromptCacheSeen {
                prompt_tokens: prompt,
                cached_tokens: cached,
                cache_write_tokens: held as u64 * 128 - cached,
                written_tokens: held as u64 * 128,
                dialect: CacheDialect::Openai,
            })
        );
        assert_eq!(m.prefix_cache_blocks(), held);
    }
    // 299 s after the last write: still cached, all 11 blocks of turn 3 now.
    tokio::time::advance(Duration::from_secs(299)).await;
    let u = usage_of(
        post(&m, "/chat/completions", conversation(3, false)).await,
        false,
    )
    .await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 1408);
    // Exactly the TTL after that refresh: gone (a block is readable while age < ttl).
    tokio::time::advance(Duration::from_secs(300)).await;
    let u = usage_of(
        post(&m, "/chat/completions", conversation(3, true)).await,
        true,
    )
    .await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0, "{u}");
    assert_eq!(u["prompt_tokens"], 1525);
    // … and that request wrote the prefix again: turn 1 reads 8 of its blocks.
    let u = usage_of(
        post(&m, "/chat/completions", conversation(1, true)).await,
        true,
    )
    .await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 1024);
    // Another model never shares a prefix.
    let mut other = conversation(3, false);
    other["model"] = json!("m-other");
    let u = usage_of(post(&m, "/chat/completions", other).await, false).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    m.shutdown().await;
}

/// Sends the three requests of the dialect tests (64-character blocks of 16 tokens,
/// at least 32): A (440 chars, 110 tokens, 6 blocks), A again, then A extended (680
/// chars, 170 tokens, 10 blocks). Returns the three usage objects and log entries.
async fn three_requests(
    dialect: &str,
    stream: bool,
    mode: UsageMode,
) -> (Vec<Value>, Vec<RecordedRequest>) {
    let m = mock().await;
    // From JSON, as a profile file or a test would write it.
    let cfg: PrefixCache = serde_json::from_value(json!({
        "dialect": dialect, "block_tokens": 16, "min_tokens": 32, "ttl_s": 600
    }))
    .unwrap();
    m.set_prefix_cache(cfg);
    m.set_default(Behavior {
        usage: mode,
        ..Behavior::default()
    });
    let sys = filler("System prompt of the dialect test. ", 400);
    let a = json!({"model": "m", "stream": stream, "messages": [
        {"role": "system", "content": sys}, {"role": "user", "content": filler("Why? ", 40)}]});
    let mut longer = a.clone();
    let msgs = longer["messages"].as_array_mut().unwrap();
    msgs.push(json!({"role": "assistant", "content": filler("Because. ", 200)}));
    msgs.push(json!({"role": "user", "content": filler("And then? ", 40)}));
    let mut usages = Vec::new();
    for body in [a.clone(), a, longer] {
        usages.push(usage_of(post(&m, "/chat/completions", body).await, stream).await);
    }
    let log = m.wait_for_ended(3, Duration::from_secs(5)).await;
    m.shutdown().await;
    (usages, log)
}

#[tokio::test]
async fn each_dialect_reports_the_cache_in_its_own_fields() {
    // (prompt, cached, written-not-read) of the three requests.
    let expect = [(110, 0, 96), (110, 96, 0), (170, 96, 64)];
    for (stream, mode) in [
        (true, UsageMode::FinalFrame),
        (true, UsageMode::Inline),
        (true, UsageMode::Choice),
        (false, UsageMode::FinalFrame),
    ] {
        let what = format!("stream {stream}, usage {mode:?}");
        // openai: prompt_tokens_details.cached_tokens, always present (0 included).
        let (u, log) = three_requests("openai", stream, mode).await;
        for (i, (p, c, _)) in expect.iter().enumerate() {
            assert_eq!(
                u[i],
                json!({"prompt_tokens": p, "completion_tokens": 5, "total_tokens": p + 5,
                    "prompt_tokens_details": {"cached_tokens": c}}),
                "{what}"
            );
            let usage = log[i].usage.unwrap();
            assert_eq!(
                (usage.cached_prompt_tokens, usage.cache_write_tokens),
                (Some(*c), None)
            );
        }
        // deepseek: hit + miss = prompt, and OpenAI's details too.
        let (u, log) = three_requests("deepseek", stream, mode).await;
        for (i, (p, c, _)) in expect.iter().enumerate() {
            assert_eq!(
                u[i],
                json!({"prompt_tokens": p, "completion_tokens": 5, "total_tokens": p + 5,
                    "prompt_cache_hit_tokens": c, "prompt_cache_miss_tokens": p - c,
                    "prompt_tokens_details": {"cached_tokens": c}}),
                "{what}"
            );
            let usage = log[i].usage.unwrap();
            assert_eq!(
                (usage.cached_prompt_tokens, usage.cache_write_tokens),
                (Some(*c), None)
            );
        }
        // anthropic: read and creation, both part of prompt_tokens (read + creation ≤
        // prompt, so polygw takes prompt_tokens as the total).
        let (u, log) = three_requests("anthropic", stream, mode).await;
        for (i, (p, c, w)) in expect.iter().enumerate() {
            assert_eq!(
                u[i],
                json!({"prompt_tokens": p, "completion_tokens": 5, "total_tokens": p + 5,
                    "cache_read_input_tokens": c, "cache_creation_input_tokens": w}),
                "{what}"
            );
            assert!(c + w <= *p);
            let usage = log[i].usage.unwrap();
            assert_eq!(
                (usage.cached_prompt_tokens, usage.cache_write_tokens),
                (Some(*c), Some(*w))
            );
        }
    }
}

#[tokio::test]
async fn no_cache_fields_unless_configured() {
    let m = mock().await;
    let body = conversation(3, false);
    let u = usage_of(post(&m, "/chat/completions", body.clone()).await, false).await;
    assert_eq!(
        u,
        json!({"prompt_tokens": 1525, "completion_tokens": 5, "total_tokens": 1530})
    );
    m.set_prefix_cache(PrefixCache::new(CacheDialect::Anthropic));
    let _ = post(&m, "/chat/completions", body.clone())
        .await
        .text()
        .await;
    let u = usage_of(post(&m, "/chat/completions", body.clone()).await, false).await;
    assert_eq!(u["cache_read_input_tokens"], 1408);
    assert_eq!(m.prefix_cache().unwrap().dialect, CacheDialect::Anthropic);
    m.set_prefix_cache(None);
    let u = usage_of(post(&m, "/chat/completions", body.clone()).await, false).await;
    assert!(u.get("cache_read_input_tokens").is_none(), "{u}");
    assert_eq!(m.requests()[3].prompt_cache, None);
    // On again with the same block size: the blocks are still there, until cleared.
    m.set_prefix_cache(PrefixCache::default());
    let u = usage_of(post(&m, "/chat/completions", body.clone()).await, false).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 1408);
    m.clear_prefix_cache();
    assert_eq!(m.prefix_cache_blocks(), 0);
    let u = usage_of(post(&m, "/chat/completions", body).await, false).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    m.shutdown().await;
}

#[tokio::test]
async fn a_script_with_its_own_prompt_tokens_is_clamped() {
    let m = mock().await;
    m.set_prefix_cache(PrefixCache::new(CacheDialect::Anthropic));
    let _ = post(&m, "/chat/completions", conversation(1, false))
        .await
        .text()
        .await;
    m.push_script(Behavior {
        prompt_tokens: Some(1100),
        ..Behavior::default()
    });
    // 10 blocks written, 1024 read: 256 to write, but only 76 are left of 1100.
    let u = usage_of(
        post(&m, "/chat/completions", conversation(2, false)).await,
        false,
    )
    .await;
    assert_eq!(
        (
            &u["prompt_tokens"],
            &u["cache_read_input_tokens"],
            &u["cache_creation_input_tokens"]
        ),
        (&json!(1100), &json!(1024), &json!(76))
    );
    m.shutdown().await;
}

/// Time from sending to the first content delta (streams) or to the body (plain).
async fn first_token_after(m: &MockUpstream, body: Value) -> Duration {
    let stream = body["stream"].as_bool().unwrap();
    let start = now();
    let mut r = post(m, "/chat/completions", body).await;
    if !stream {
        let _ = r.text().await.unwrap();
        return start.elapsed();
    }
    let mut seen = String::new();
    while !seen.contains("\"content\":\"Hello\"") {
        let c = r.chunk().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    let took = start.elapsed();
    let _ = r.text().await;
    took
}

#[tokio::test(start_paused = true)]
async fn a_hit_has_a_shorter_ttft() {
    let m = mock().await;
    m.set_prefix_cache(PrefixCache::default().with_hit_ttft_factor(0.3));
    m.set_default(Behavior {
        ttft_ms: 1000.0,
        ..Behavior::default()
    });
    for stream in [true, false] {
        m.clear_prefix_cache();
        let miss = first_token_after(&m, conversation(2, stream)).await;
        let hit = first_token_after(&m, conversation(2, stream)).await;
        assert!(
            miss >= Duration::from_millis(1000) && miss < Duration::from_millis(1050),
            "stream {stream}: miss {miss:?}"
        );
        assert!(
            hit >= Duration::from_millis(300) && hit < Duration::from_millis(350),
            "stream {stream}: hit {hit:?}"
        );
    }
    // The log keeps the behavior as played (its TTFT scaled).
    let log = m.wait_for_ended(4, Duration::from_secs(5)).await;
    let ttfts: Vec<f64> = log
        .iter()
        .map(|r| r.behavior.as_ref().unwrap().ttft_ms)
        .collect();
    assert_eq!(ttfts, vec![1000.0, 300.0, 1000.0, 300.0]);
    m.shutdown().await;
}

#[tokio::test]
async fn rejected_requests_neither_read_nor_write() {
    let m = mock().await;
    m.set_prefix_cache(PrefixCache::default());
    m.push_script(Behavior::status(429));
    let r = post(&m, "/chat/completions", conversation(3, false)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(m.prefix_cache_blocks(), 0);
    // A prefill the server rejects: a 400, nothing written.
    m.set_prefill(polygw_mock_upstream::PrefillPolicy::reject());
    let mut prefill = conversation(3, false);
    prefill["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": "Partial"}));
    let r = post(&m, "/chat/completions", prefill).await;
    assert_eq!(r.status(), 400);
    assert_eq!(m.prefix_cache_blocks(), 0);
    assert!(m.requests().iter().all(|r| r.prompt_cache.is_none()));
    // A prompt under min_tokens is neither read nor written, but is recorded.
    let short = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let u = json_of(post(&m, "/chat/completions", short).await).await;
    assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(m.prefix_cache_blocks(), 0);
    assert_eq!(m.requests()[2].prompt_cache.unwrap().written_tokens, 0);
    m.shutdown().await;
}

#[tokio::test]
async fn profile_files_carry_the_cache_and_prices() {
    let doc = r#"{ "extends": "fast", "time_scale": 0.001,
        "prefix_cache": { "dialect": "deepseek", "ttl_s": 3600, "block_tokens": 64, "min_tokens": 64 },
        "prices": { "input": 0.27, "cached_input": 0.07, "output": 1.1 } }"#;
    // The profile itself reads as before …
    let profile = Profile::from_json(doc, "p").unwrap();
    assert_eq!(profile.name, "fast");
    // … and the server-wide settings come with it.
    let settings = MockSettings::from_profile_json(doc).unwrap();
    let cache = settings.prefix_cache.clone().unwrap();
    assert_eq!(
        (cache.dialect, cache.block_tokens, cache.ttl),
        (CacheDialect::Deepseek, 64, Duration::from_secs(3600))
    );
    assert_eq!(settings.prices.unwrap().cached_input, Some(0.07));
    assert!(MockSettings::from_profile_json(
        r#"{"extends": "fast", "prefix_cache": {"block_tokens": 0}}"#
    )
    .is_err());
    assert!(MockSettings::from_profile_json(
        r#"{"extends": "fast", "prices": {"input": -1, "output": 1}}"#
    )
    .is_err());
    assert_eq!(
        MockSettings::from_profile_arg("fast").unwrap(),
        MockSettings::default()
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cached.json");
    std::fs::write(&path, doc).unwrap();
    assert_eq!(
        MockSettings::from_profile_arg(path.to_str().unwrap()).unwrap(),
        settings
    );

    let m = MockUpstream::start(MockConfig::with_profile(profile).with_settings(settings))
        .await
        .unwrap();
    let body = conversation(1, true);
    let _ = post(&m, "/chat/completions", body.clone())
        .await
        .text()
        .await;
    let u = usage_of(post(&m, "/chat/completions", body).await, true).await;
    // 4500 chars: 17 blocks of 64 tokens (256 chars) = 1088 of 1125 tokens.
    assert_eq!(u["prompt_cache_hit_tokens"], 1088, "{u}");
    assert_eq!(u["prompt_cache_miss_tokens"], 1125 - 1088);
    m.shutdown().await;
}
