//! The billing log over real loopback HTTP: complete answers bill their usage; streams
//! cut by the client, by a fault or by a shutdown bill the chunks generated before the
//! cut; plain answers left mid-generation too; rejected requests bill nothing; cached
//! and cache-write tokens at their prices; the log handle after shutdown.

use std::time::Duration;

use polygw_mock_upstream::{
    Behavior, BillingEntry, CacheDialect, EndKind, Fault, MockConfig, MockUpstream, PrefillPolicy,
    PrefixCache, Prices, Stall, ToolCallSpec, UsageMode,
};
use serde_json::{json, Value};

use super::{chat_body, client, mock, post};

const WAIT: Duration = Duration::from_secs(5);

async fn post_as(m: &MockUpstream, call_id: &str, body: Value) -> reqwest::Response {
    client()
        .post(format!("{}/chat/completions", m.base_url()))
        .header("x-polygw-call-id", call_id)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

async fn billed(m: &MockUpstream, n: usize) -> Vec<BillingEntry> {
    let b = m.wait_for_billed(n, WAIT).await;
    assert_eq!(b.len(), n, "{b:#?}");
    b
}

/// (prompt, cached, cache write, completion, complete, usage sent, end)
fn figures(e: &BillingEntry) -> (u64, u64, u64, u64, bool, bool, EndKind) {
    (
        e.prompt_tokens,
        e.cached_tokens,
        e.cache_write_tokens,
        e.completion_tokens,
        e.complete,
        e.usage_sent,
        e.end,
    )
}

#[tokio::test]
async fn complete_answers_bill_their_usage_at_the_mocks_prices() {
    let m = MockUpstream::start(MockConfig {
        prices: Some(Prices::new(2.0, 8.0)),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let _ = post_as(&m, "s-1", chat_body(true)).await.text().await;
    let _ = post_as(&m, "p-1", chat_body(false)).await.text().await;
    let b = billed(&m, 2).await;
    for (e, stream, call) in [(&b[0], true, "s-1"), (&b[1], false, "p-1")] {
        // "12345678" = 2 prompt tokens; the default answer's 5 chunks.
        assert_eq!(
            figures(e),
            (2, 0, 0, 5, true, true, EndKind::Completed),
            "{e:?}"
        );
        assert_eq!(
            (e.stream, e.call_id.as_deref(), e.model.as_deref()),
            (stream, Some(call), Some("m-test"))
        );
        assert_eq!(e.cost, Some((2.0 * 2.0 + 5.0 * 8.0) / 1e6));
        assert!(!e.verbatim && e.cache_dialect.is_none());
    }
    let rec = m.requests();
    assert_eq!((b[0].id, b[1].id), (rec[0].id, rec[1].id));
    let inv = m.invoice();
    assert_eq!(inv.total, Some(2.0 * 44.0 / 1e6));
    assert_eq!(inv.by_call_id("p-1").unwrap().id, rec[1].id);
    assert_eq!(inv.tokens(), (4, 0, 0, 10));
    // Without prices the cost is unknown, not 0.
    m.set_prices(None);
    let _ = post_as(&m, "s-2", chat_body(false)).await.text().await;
    let b = billed(&m, 3).await;
    assert_eq!(b[2].cost, None);
    assert_eq!(m.invoice().total, None);
    m.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_by_the_client_bills_the_chunks_generated_before() {
    let m = mock().await;
    // A hedge loser the gateway cancels during a silence before chunk 3.
    m.push_script(Behavior {
        chunk_count: Some(10),
        stalls: vec![Stall {
            before_chunk: 3,
            ms: 30_000.0,
        }],
        ..Behavior::default()
    });
    let mut r = post(&m, "/chat/completions", chat_body(true)).await;
    let mut seen = String::new();
    while seen.matches("\"content\":\"").count() < 1 + 3 {
        let c = r.chunk().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    drop(r);
    let b = billed(&m, 1).await;
    assert_eq!(
        figures(&b[0]),
        (2, 0, 0, 3, false, false, EndKind::ClientDisconnected)
    );
    assert_eq!(m.requests()[0].chunks_sent, 3);
    m.shutdown().await;
}

#[tokio::test]
async fn faults_bill_what_was_generated_before_them() {
    let m = mock().await;
    let ten = |fault: Fault| Behavior {
        chunk_count: Some(10),
        fault: Some(fault),
        ..Behavior::default()
    };
    // (completion tokens, complete, usage sent, end)
    type Billed = (u64, bool, bool, EndKind);
    let cases: Vec<(Behavior, Value, Billed)> = vec![
        (
            ten(Fault::ResetAfter { chunks: 4 }),
            chat_body(true),
            (4, false, false, EndKind::ResetMidStream),
        ),
        (
            ten(Fault::TruncateAfter { chunks: 2 }),
            chat_body(true),
            (2, false, false, EndKind::Truncated),
        ),
        // The error frame takes chunk 3's place: chunks 0..3 were generated.
        (
            ten(Fault::ErrorFrameAt {
                chunk: 3,
                error: None,
            }),
            chat_body(true),
            (3, false, false, EndKind::Completed),
        ),
        // Usage on the finish chunk, then the RST: all 10, usage sent.
        (
            Behavior {
                usage: UsageMode::Inline,
                ..ten(Fault::ResetAfterFinish)
            },
            chat_body(true),
            (10, true, true, EndKind::ResetMidStream),
        ),
        // Reasoning (2), content (3), tool fragments (2) all count, in send order.
        (
            Behavior {
                reasoning: vec!["hm".into(), " ok".into()],
                chunk_count: Some(3),
                tool_call: Some(ToolCallSpec {
                    fragments: 2,
                    ..ToolCallSpec::default()
                }),
                fault: Some(Fault::ResetAfter { chunks: 6 }),
                ..Behavior::default()
            },
            chat_body(true),
            (6, false, false, EndKind::ResetMidStream),
        ),
        // A behavior's own completion_tokens scale with the share generated.
        (
            Behavior {
                completion_tokens: Some(100),
                ..ten(Fault::ResetAfter { chunks: 5 })
            },
            chat_body(true),
            (50, false, false, EndKind::ResetMidStream),
        ),
        // max_tokens: the cut answer is the whole answer.
        (
            Behavior {
                chunk_count: Some(10),
                ..Behavior::default()
            },
            {
                let mut b = chat_body(true);
                b["max_tokens"] = json!(4);
                b
            },
            (4, true, true, EndKind::Completed),
        ),
        // Plain answers are generated whole before their headers: a cut body bills
        // everything, without usage.
        (
            ten(Fault::ResetAfter { chunks: 1 }),
            chat_body(false),
            (10, true, false, EndKind::ResetMidStream),
        ),
    ];
    for (i, (behavior, body, (completion, complete, usage_sent, end))) in
        cases.into_iter().enumerate()
    {
        m.push_script(behavior);
        // Headers come first in every case: only the body can fail.
        let _ = post_as(&m, &format!("f-{i}"), body).await.text().await;
        let b = billed(&m, i + 1).await;
        assert_eq!(
            figures(&b[i]),
            (2, 0, 0, completion, complete, usage_sent, end),
            "case {i}"
        );
    }
    m.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_plain_answer_left_mid_generation_bills_the_chunks_generated() {
    let m = mock().await;
    // Chunk i is generated at i·100 ms; the client gives up at 350 ms.
    m.push_script(Behavior {
        chunk_count: Some(10),
        gap_ms: 100.0,
        ..Behavior::default()
    });
    let r = client()
        .post(format!("{}/chat/completions", m.base_url()))
        .timeout(Duration::from_millis(350))
        .body(chat_body(false).to_string())
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
    let b = billed(&m, 1).await;
    assert_eq!(
        figures(&b[0]),
        (2, 0, 0, 4, false, false, EndKind::ClientDisconnected)
    );
    assert_eq!(m.requests()[0].status, 0, "no headers were sent");
    m.shutdown().await;
}

#[tokio::test]
async fn rejected_requests_bill_nothing() {
    let m = MockUpstream::start(MockConfig {
        require_key: Some("k".into()),
        prefill: PrefillPolicy::reject(),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let send = |body: String, key: Option<&str>| {
        let mut r = client()
            .post(format!("{}/chat/completions", m.base_url()))
            .body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let ok = Some("k");
    assert_eq!(
        send(chat_body(true).to_string(), None)
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(send("nope".into(), ok).await.unwrap().status(), 400);
    for status in [429, 500, 503] {
        m.push_script(Behavior::status(status));
        assert_eq!(
            send(chat_body(true).to_string(), ok)
                .await
                .unwrap()
                .status(),
            status
        );
    }
    m.push_script(Behavior::fault(Fault::ResetBeforeHeaders));
    assert!(send(chat_body(true).to_string(), ok).await.is_err());
    let prefill = json!({"model": "m", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]});
    assert_eq!(send(prefill.to_string(), ok).await.unwrap().status(), 400);
    // Embeddings are not in the billing log.
    let r = client()
        .post(format!("{}/embeddings", m.base_url()))
        .bearer_auth("k")
        .body(json!({"input": "x"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.wait_for_ended(8, WAIT).await.len(), 8);
    assert!(m.billing().is_empty());
    // The first accepted request is the first entry.
    let _ = send(chat_body(false).to_string(), ok)
        .await
        .unwrap()
        .text()
        .await;
    let b = billed(&m, 1).await;
    assert_eq!(b[0].id, 9);
    m.shutdown().await;
}

#[tokio::test]
async fn cached_and_written_tokens_bill_at_their_prices() {
    let prices = Prices::new(3.0, 15.0)
        .with_cached_input(0.3)
        .with_cache_write(3.75);
    let filler = |tag: &str, n: usize| -> String { tag.chars().cycle().take(n).collect() };
    let a = json!({"model": "m", "messages": [
        {"role": "system", "content": filler("Billing test system prompt. ", 400)},
        {"role": "user", "content": filler("Why? ", 40)}]});
    let mut longer = a.clone();
    let msgs = longer["messages"].as_array_mut().unwrap();
    msgs.push(json!({"role": "assistant", "content": filler("Because. ", 200)}));
    msgs.push(json!({"role": "user", "content": filler("And then? ", 40)}));
    for dialect in [
        CacheDialect::Anthropic,
        CacheDialect::Openai,
        CacheDialect::Deepseek,
    ] {
        let m = mock().await;
        m.set_prefix_cache(PrefixCache::new(dialect).with_blocks(16, 32));
        m.set_prices(prices);
        for (i, body) in [a.clone(), a.clone(), longer.clone()]
            .into_iter()
            .enumerate()
        {
            let _ = post_as(&m, &format!("c-{i}"), body).await.text().await;
        }
        let inv = {
            billed(&m, 3).await;
            m.invoice()
        };
        // Only the anthropic dialect bills writes; elsewhere they are plain input.
        let w = |t: u64| {
            if dialect == CacheDialect::Anthropic {
                t
            } else {
                0
            }
        };
        let expect = [(110, 0, w(96)), (110, 96, w(0)), (170, 96, w(64))];
        let mut total = 0.0;
        for (e, (p, c, wr)) in inv.entries.iter().zip(expect) {
            assert_eq!(
                figures(e),
                (p, c, wr, 5, true, true, EndKind::Completed),
                "{dialect:?}"
            );
            assert_eq!(e.cache_dialect, Some(dialect));
            let cost =
                ((p - c - wr) as f64 * 3.0 + c as f64 * 0.3 + wr as f64 * 3.75 + 5.0 * 15.0) / 1e6;
            assert_eq!(e.cost, Some(cost), "{dialect:?}");
            total += cost;
        }
        assert_eq!(inv.total, Some(total));
        // The concrete figures (anthropic: 477, 145.8 and 373.8 per 1e6).
        let per_m: Vec<f64> = inv
            .entries
            .iter()
            .map(|e| (e.cost.unwrap() * 1e6 * 10.0).round() / 10.0)
            .collect();
        match dialect {
            CacheDialect::Anthropic => assert_eq!(per_m, vec![477.0, 145.8, 373.8]),
            _ => assert_eq!(per_m, vec![405.0, 145.8, 325.8]),
        }
        assert_eq!(inv.by_call_id("c-2").unwrap().cached_tokens, 96);
        m.shutdown().await;
    }
}

#[tokio::test]
async fn the_billing_log_survives_shutdown_and_resets_on_its_own() {
    let m = mock().await;
    let _ = post(&m, "/chat/completions", chat_body(false))
        .await
        .text()
        .await;
    // A verbatim body: billed with the behavior's completion tokens (none here).
    m.push_script(Behavior {
        raw_sse: Some("data: {}\n\ndata: [DONE]\n\n".into()),
        ..Behavior::default()
    });
    let _ = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await;
    // A stream the server's shutdown cuts during a stall before chunk 2.
    m.push_script(Behavior {
        chunk_count: Some(5),
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 60_000.0,
        }],
        ..Behavior::default()
    });
    let mut r = post(&m, "/chat/completions", chat_body(true)).await;
    let mut seen = String::new();
    while seen.matches("\"content\":\"").count() < 1 + 2 {
        let c = r.chunk().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    let log = m.log();
    m.reset_log();
    assert_eq!(
        billed(&m, 2).await.len(),
        2,
        "reset_log keeps the billing log"
    );
    m.shutdown().await;
    let b = log.wait_for_billed(3, WAIT).await;
    assert_eq!(b.len(), 3);
    assert!(b[1].verbatim && b[1].complete);
    assert_eq!((b[1].completion_tokens, b[1].usage_sent), (0, false));
    assert_eq!(
        figures(&b[2]),
        (2, 0, 0, 2, false, false, EndKind::ServerShutdown)
    );
    assert_eq!(log.invoice().entries.len(), 3);
    log.reset_billing();
    assert!(log.billing().is_empty());
}
