//! `cargo bench -p polygw-transport-openai`: throughput of the SSE parser + stream
//! aggregator over the recorded fixtures, and the transport's per-stream overhead over
//! loopback against the mock upstream. Std-only harness, bounded in time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use polygw_core::ports::{ChatAttempt, NullObserver, Transport};
use polygw_core::{ChatRequest, SourceConfig};
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream};
use polygw_testkit::clock::TokioClock;
use polygw_transport_openai::aggregate::StreamAggregator;
use polygw_transport_openai::sse::SseParser;
use polygw_transport_openai::OpenAiTransport;
use serde_json::Value;
use tokio::time::Instant;

fn fixture_bodies() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real-streams");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".chunks.jsonl"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            let mut out = String::new();
            for line in text.split('\n').filter(|l| !l.trim().is_empty()) {
                out.push_str("data: ");
                out.push_str(line);
                out.push_str("\n\n");
            }
            out.push_str("data: [DONE]\n\n");
            out.into_bytes()
        })
        .collect()
}

/// Parses and folds a body; `typed` folds frames as the transport does (the typed path,
/// the `Value` path for the frames it declines), else every frame through a `Value`
/// (the transport before issue 17, kept as the same-run baseline).
fn parse_and_aggregate(bytes: &[u8], read_size: usize, typed: bool) -> (usize, u32) {
    let mut parser = SseParser::new();
    let mut agg = StreamAggregator::new();
    let mut events = Vec::new();
    let mut frames = 0;
    for piece in bytes.chunks(read_size) {
        parser.feed(piece, &mut events).unwrap();
        for ev in events.drain(..) {
            if ev.data == "[DONE]" {
                continue;
            }
            if !typed || agg.feed_typed(&ev.data, false).is_none() {
                let v: Value = serde_json::from_str(&ev.data).unwrap();
                agg.feed(v.as_object().unwrap(), false);
            }
            frames += 1;
        }
    }
    (frames, agg.finish().incremental_chunks)
}

fn bench_parser() {
    let bodies = fixture_bodies();
    let total: usize = bodies.iter().map(Vec::len).sum();
    for read_size in [64usize, 1024, 16 * 1024] {
        let mut rates = [0.0; 2];
        for (i, typed) in [false, true].into_iter().enumerate() {
            let rounds = 20;
            let start = Instant::now();
            let mut frames = 0;
            for _ in 0..rounds {
                for b in &bodies {
                    frames += parse_and_aggregate(b, read_size, typed).0;
                }
            }
            let secs = start.elapsed().as_secs_f64();
            rates[i] = frames as f64 / secs;
            println!(
                "parse+aggregate ({}), reads of {read_size:>5} B: {:>7.1} MB/s, {:>9.0} frames/s",
                if typed {
                    "typed, as the transport"
                } else {
                    "Value tree, baseline   "
                },
                (total * rounds) as f64 / secs / 1e6,
                rates[i]
            );
        }
        println!(
            "parse+aggregate, reads of {read_size:>5} B: typed / Value tree = {:.2}×",
            rates[1] / rates[0]
        );
    }
}

async fn bench_loopback() {
    let m = MockUpstream::start(MockConfig {
        record_bodies: false,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(Behavior {
        chunk_count: Some(200),
        ..Behavior::default()
    });
    let t = OpenAiTransport::new(Arc::new(TokioClock)).unwrap();
    let src = SourceConfig::new("mock", 0, m.base_url(), "sk-bench", "mock-model")
        .with_timeout(Duration::from_secs(30));
    let req = ChatRequest::user("bench").with_stream(true);
    for concurrency in [1usize, 8] {
        let n = 200;
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..concurrency {
            let (t, src, req) = (t.clone(), src.clone(), req.clone());
            set.spawn(async move {
                for _ in (i..n).step_by(concurrency) {
                    let r = t
                        .chat(ChatAttempt {
                            source: &src,
                            request: &req,
                            call_id: "bench",
                            stall_threshold: Duration::from_secs(1),
                            observer: &NullObserver,
                            traceparent: None,
                        })
                        .await
                        .unwrap();
                    assert_eq!(r.stream.unwrap().incremental_chunks, 200);
                }
            });
        }
        while set.join_next().await.is_some() {}
        let secs = start.elapsed().as_secs_f64();
        println!(
            "loopback streams of 200 chunks, concurrency {concurrency}: {:>7.0} streams/s, {:>9.0} chunks/s",
            n as f64 / secs,
            (n * 200) as f64 / secs
        );
    }
    m.shutdown().await;
}

fn main() {
    // `cargo test --benches` runs this with `--bench`-less args; keep it quick then.
    bench_parser();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench_loopback());
}
