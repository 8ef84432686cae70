//! Memory follows the answer, not the number of chunks (SPEC §17.7; issue 22, item 9):
//! the live heap of an aggregated streamed call, counted by a global allocator on the
//! thread that runs the client only (the mock upstream runs on a thread of its own).

use std::time::Duration;

use polygw::{ChatRequest, GatewayClient};
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream};

#[global_allocator]
static HEAP: polygw_heap_meter::Counting = polygw_heap_meter::Counting;

/// A stream of `n` one-character content chunks, as an OpenAI-compatible source sends
/// it (a verbatim body, written 64 KiB at a time).
fn one_char_chunks(n: usize) -> Behavior {
    let mut sse = String::with_capacity(n * 110);
    for i in 0..n {
        let c = char::from(b'a' + (i % 26) as u8);
        sse.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{c}\"}}}}]}}\n\n"
        ));
    }
    sse.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
    sse.push_str("data: [DONE]\n\n");
    Behavior {
        raw_sse: Some(sse),
        raw_chunk_bytes: Some(64 * 1024),
        content_type: Some("text/event-stream".into()),
        ..Behavior::default()
    }
}

/// Issue 22, item 9: 200 000 one-character chunks aggregated into a 200 KB answer.
/// The call's peak live heap is a small multiple of the answer (it was ≈ 59 MB: one
/// event of 248 bytes per chunk kept until the leg ended).
#[test]
fn an_aggregated_stream_of_tiny_chunks_holds_about_the_answer() {
    const N: usize = 200_000;
    let mock = MockUpstream::start_on_own_thread(MockConfig {
        default: Some(one_char_chunks(N)),
        ..MockConfig::default()
    })
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    polygw_heap_meter::track_this_thread();
    rt.block_on(async {
        let vars = vec![
            ("LLM__A__0__BASE_URL".to_string(), mock.base_url()),
            ("LLM__A__0__API_KEY".to_string(), "sk-a".to_string()),
            ("LLM__A__0__MODEL".to_string(), "m".to_string()),
            ("LLM__CALL_DEADLINE_S".to_string(), "120".to_string()),
        ];
        let c = GatewayClient::from_vars(vars, "LLM").await.unwrap();
        // A first call warms what lives as long as the client (connection pool, …).
        let _ = c.chat(ChatRequest::user("warm up").with_stream(true)).await;
        let base = polygw_heap_meter::reset_peak();
        let r = tokio::time::timeout(
            Duration::from_secs(120),
            c.chat(ChatRequest::user("many tiny chunks").with_stream(true)),
        )
        .await
        .expect("in time")
        .unwrap();
        let peak = polygw_heap_meter::peak() - base;
        assert_eq!(r.content.len(), N);
        let answer = r.content.len() as i64;
        eprintln!(
            "peak live heap during the call: {peak} bytes ({:.1} × the {answer}-byte answer)",
            peak as f64 / answer as f64
        );
        assert!(
            peak < 16 * answer,
            "the call held {peak} bytes for a {answer}-byte answer"
        );
        drop(r);
        c.shutdown().await;
    });
}
