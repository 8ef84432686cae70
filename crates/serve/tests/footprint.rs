//! `polygw serve` gives back what a call took (SPEC §17.7, §22.2; issue 22, item 10):
//! the live heap after 5N proxied calls is the live heap after N, counted by a global
//! allocator on the thread that runs the proxy and its clients (the mock upstream runs
//! on a thread of its own).
//!
//! The limiter's windows hold one entry per millisecond that saw a call for 60 s: state
//! bounded by time, not by calls. The limiter here reads a clock held still so that
//! what is measured is what the calls keep, whatever their speed.

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use polygw::core::ports::ManualClock;
use polygw::memory::{MemoryBreakerStore, MemoryLimiter};
use polygw::{GatewayClient, ScopeKind, ScopeSettings, SourceConfig};
use polygw_mock_upstream::{MockConfig, MockUpstream};
use polygw_serve::{Proxy, ProxyConfig, Scope, ServerLimits};

#[global_allocator]
static HEAP: polygw_heap_meter::Counting = polygw_heap_meter::Counting;

/// `n` chat calls through the proxy, 16 at a time, each answered 200.
async fn calls(http: &reqwest::Client, url: &str, n: usize) {
    let body = serde_json::json!({"model": "llm",
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let statuses: Vec<u16> = futures_util::stream::iter(0..n)
        .map(|_| {
            let req = http
                .post(url)
                .header("content-type", "application/json")
                .body(body.clone());
            async move { req.send().await.unwrap().bytes_and_status().await }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 200), "every call answered");
}

trait BytesAndStatus {
    async fn bytes_and_status(self) -> u16;
}

impl BytesAndStatus for reqwest::Response {
    async fn bytes_and_status(self) -> u16 {
        let s = self.status().as_u16();
        let _ = self.bytes().await.unwrap();
        s
    }
}

#[test]
fn the_proxy_keeps_nothing_per_call() {
    const N: usize = 1_500;
    let mock = MockUpstream::start_on_own_thread(MockConfig::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    polygw_heap_meter::track_this_thread();
    rt.block_on(async {
        #[allow(clippy::disallowed_methods, reason = "the base of a clock held still")]
        let base = Instant::now();
        let still = Arc::new(ManualClock::new(base, 1_700_000_000_000));
        let settings = ScopeSettings::new(
            "LLM",
            vec![SourceConfig::new(
                "a",
                0,
                mock.base_url(),
                "sk-upstream-0123456789",
                "m",
            )],
        );
        let clients = GatewayClient::builder(settings)
            .limiter(Arc::new(MemoryLimiter::new(still.clone())))
            .breakers(Arc::new(MemoryBreakerStore::new(still)))
            .build_all()
            .await
            .unwrap();
        let scope = Scope::of_kind(ScopeKind::Chat, clients).unwrap();
        let proxy = Proxy::new(ProxyConfig::default(), vec![scope]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/v1/chat/completions",
            listener.local_addr().unwrap()
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(polygw_serve::serve(
            listener,
            proxy,
            ServerLimits::default(),
            async {
                let _ = stopped.await;
            },
        ));
        let http = reqwest::Client::new();
        // Warm up what lives as long as the process: pools, metrics' label sets, …
        // Two batches first: the connection pools (the clients', the proxy's upstream
        // one) reach their size, each open connection holding its buffers (~18 KB) for
        // as long as it lives; a pool that opened its last connection only during the
        // third batch read as 3 bytes per call.
        calls(&http, &url, N).await;
        calls(&http, &url, N).await;
        let settled = polygw_heap_meter::live();
        // Four more batches: a per-call entry of a map or a queue shows as a step when
        // its capacity doubles, which 4 N calls after N always cross.
        let mut seen = vec![settled];
        for _ in 0..4 {
            calls(&http, &url, N).await;
            seen.push(polygw_heap_meter::live());
        }
        let grew = seen.iter().max().unwrap() - settled;
        eprintln!(
            "live heap after {} calls, then after each {N} more: {seen:?} \
             (at most {grew:+} bytes, {:+.2} per call)",
            2 * N,
            grew as f64 / (4 * N) as f64
        );
        // A byte per call is well below what one kept allocation of any kind costs
        // (the leak this guards against kept ≈ 75 bytes per call).
        assert!(
            grew < (4 * N) as i64,
            "the live heap grew by {grew} bytes over {} calls: {seen:?}",
            4 * N
        );
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    });
}
