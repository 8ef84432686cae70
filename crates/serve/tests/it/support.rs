//! Support for the proxy's suites: a mock upstream, scopes over it, the proxy served on
//! loopback by `polygw_serve::serve`, an OpenAI client, and raw HTTP over a socket.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_openai::config::OpenAIConfig;
use polygw::core::ports::TelemetryRecorder;
use polygw::{GatewayClient, ScopeKind, ScopeSettings, SourceConfig};
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream};
use polygw_serve::{Proxy, ProxyConfig, Scope, ServeReport, ServerLimits};
use polygw_testkit::fakes::RecordingTelemetry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The upstream key every source sends (the mock accepts any).
pub const UPSTREAM_KEY: &str = "sk-upstream-secret-0123456789";

/// A mock upstream answering `default`.
pub async fn mock(default: Behavior) -> MockUpstream {
    let m = MockUpstream::start(MockConfig::default()).await.unwrap();
    m.set_default(default);
    m
}

/// A source `{name}-0` on the mock, model `model-{name}`.
pub fn source(name: &str, m: &MockUpstream) -> SourceConfig {
    SourceConfig::new(name, 0, m.base_url(), UPSTREAM_KEY, format!("model-{name}"))
}

/// A scope of `kind` over `sources`, with `tweak` applied to its settings; rows go to
/// `telemetry`.
pub async fn scope_with(
    name: &str,
    kind: ScopeKind,
    sources: Vec<SourceConfig>,
    telemetry: Option<Arc<RecordingTelemetry>>,
    tweak: impl FnOnce(&mut ScopeSettings),
) -> Scope {
    let mut s = ScopeSettings::new(name, sources);
    tweak(&mut s);
    let mut b = GatewayClient::builder(s);
    if let Some(t) = telemetry {
        b = b.telemetry(t as Arc<dyn TelemetryRecorder>);
    }
    Scope::of_kind(kind, b.build_all().await.unwrap()).unwrap()
}

/// A chat scope whose primary a test cuts on purpose at every position: the breaker
/// keeps it in (it is not broken), and retries wait 1–2 ms.
pub async fn scope_cut_on_purpose(sources: Vec<SourceConfig>) -> Scope {
    scope_with("LLM", ScopeKind::Chat, sources, None, |s| {
        s.breaker.failures = 1000;
        s.retry.backoff_base = std::time::Duration::from_millis(1);
        s.retry.backoff_max = std::time::Duration::from_millis(2);
    })
    .await
}

/// A chat scope over one mock.
pub async fn chat_scope(name: &str, m: &MockUpstream) -> Scope {
    scope_with(name, ScopeKind::Chat, vec![source("a", m)], None, |_| {}).await
}

/// The proxy served on 127.0.0.1.
pub struct Served {
    pub addr: SocketAddr,
    pub base: String,
    pub proxy: Proxy,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<ServeReport>>>,
}

impl Served {
    /// Starts the shutdown and waits for `serve` to return.
    pub async fn stop(mut self) -> ServeReport {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.take().unwrap().await.unwrap().unwrap()
    }

    /// Starts the shutdown without waiting; returns the running server's task.
    pub fn begin_stop(&mut self) -> JoinHandle<std::io::Result<ServeReport>> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.take().unwrap()
    }

    /// `/v1` base URL.
    pub fn v1(&self) -> String {
        format!("{}/v1", self.base)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Serves `scopes` with these settings on an ephemeral loopback port.
pub async fn serve_with(scopes: Vec<Scope>, cfg: ProxyConfig, limits: ServerLimits) -> Served {
    serve_proxy(Proxy::new(cfg, scopes), limits).await
}

/// Serves a proxy.
pub async fn serve_proxy(proxy: Proxy, limits: ServerLimits) -> Served {
    serve_on("127.0.0.1:0", proxy, limits).await
}

/// Serves a proxy on `addr`.
pub async fn serve_on(addr: &str, proxy: Proxy, limits: ServerLimits) -> Served {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(polygw_serve::serve(
        listener,
        proxy.clone(),
        limits,
        async {
            let _ = rx.await;
        },
    ));
    Served {
        addr,
        base: format!("http://{addr}"),
        proxy,
        stop: Some(tx),
        task: Some(task),
    }
}

/// Serves `scopes` with default settings.
pub async fn serve(scopes: Vec<Scope>) -> Served {
    serve_with(scopes, ProxyConfig::default(), ServerLimits::default()).await
}

/// An OpenAI client on the proxy (no retries of its own).
pub fn openai(served: &Served, key: &str) -> async_openai::Client<OpenAIConfig> {
    async_openai::Client::with_config(
        OpenAIConfig::new()
            .with_api_base(served.v1())
            .with_api_key(key),
    )
}

/// A user message for async-openai.
pub fn user(text: &str) -> async_openai::types::chat::ChatCompletionRequestMessage {
    async_openai::types::chat::ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

/// A plain HTTP client (no pooling surprises: one connection per request).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// A raw HTTP response.
#[derive(Debug, Clone)]
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Raw {
    /// A header's value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.head, self.body))
    }
}

/// Parses one HTTP/1.1 response (Content-Length bodies; else what follows the head).
pub fn parse_raw(bytes: &[u8]) -> Raw {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let raw = Raw {
        status,
        head: head.to_string(),
        body: String::new(),
    };
    let body = match raw
        .header("content-length")
        .and_then(|l| l.parse::<usize>().ok())
    {
        Some(n) => rest.get(..n).unwrap_or(rest).to_string(),
        None => rest.to_string(),
    };
    Raw { body, ..raw }
}

/// Sends raw bytes and reads until the server closes (or `limit` passes, real time).
pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_to_close(&mut s).await
}

/// Reads until the peer closes (a reset ends it too).
pub async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Reads one response with a Content-Length body from a kept-alive connection.
pub async fn read_one(s: &mut TcpStream) -> Raw {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        if let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&out[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if out.len() >= end + 4 + len {
                return parse_raw(&out[..end + 4 + len]);
            }
        }
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before a whole response: {:?}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&buf[..n]);
    }
}

/// A JSON POST as raw bytes.
pub fn post(path: &str, body: &str, extra_headers: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A chat body for `model`.
pub fn chat_body(model: &str, stream: bool) -> String {
    serde_json::json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

/// Waits (real time, bounded) until `cond` holds; for state that settles after an
/// answer was already received.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

/// The SSE `data:` payloads of a body (comments skipped).
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| ev.strip_prefix("data: ").map(str::to_string))
        .collect()
}
