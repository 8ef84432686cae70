//! Shared pieces of the call-level benchmarks (`overhead`, `hedging`, and the CLI's
//! `serve`, which includes this file by path): the mock upstream on a runtime of its
//! own, the direct-reqwest baseline client, percentiles, process CPU time, load average.
#![allow(dead_code, reason = "each benchmark uses a different subset")]

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream};
use serde_json::{json, Value};
use tokio::time::Instant;

/// `cargo bench` passes `--bench`; `cargo test --benches` does not: then run a smoke-sized
/// workload (the program is still exercised end to end, in seconds).
pub fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// The benchmarks' runtime: two worker threads (the machine's cores), timers and I/O.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`), for the record.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// CPU time (user + system) consumed so far by process `pid` (`None` = this process),
/// from `/proc/PID/stat`; `None` when unreadable (not Linux).
pub fn cpu_time(pid: Option<u32>) -> Option<Duration> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let s = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    // USER_HZ is 100 on every Linux this project targets.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// The mock upstream on a tokio runtime of its own (2 worker threads), so the measured
/// client's scheduler only runs the client, as when the upstream is another machine.
pub struct MockHost {
    rt: Option<tokio::runtime::Runtime>,
    mocks: Vec<MockUpstream>,
}

impl MockHost {
    /// Starts one mock per config.
    pub fn start(cfgs: Vec<MockConfig>) -> MockHost {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("mock-upstream")
            .enable_all()
            .build()
            .expect("mock runtime");
        let mocks = rt.block_on(async {
            let mut v = Vec::new();
            for c in cfgs {
                v.push(MockUpstream::start(c).await.expect("start mock upstream"));
            }
            v
        });
        MockHost {
            rt: Some(rt),
            mocks,
        }
    }

    pub fn mocks(&self) -> &[MockUpstream] {
        &self.mocks
    }

    pub fn urls(&self) -> Vec<String> {
        self.mocks.iter().map(|m| m.base_url()).collect()
    }

    /// Stops every mock and the runtime (call from outside any runtime, or through
    /// `spawn_blocking`).
    pub fn shutdown(mut self) {
        let rt = self.rt.take().expect("runtime");
        let mocks = std::mem::take(&mut self.mocks);
        rt.block_on(async {
            for m in mocks {
                m.shutdown().await;
            }
        });
        rt.shutdown_timeout(Duration::from_secs(5));
    }
}

impl Drop for MockHost {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            let mocks = std::mem::take(&mut self.mocks);
            // Dropping a handle stops its server; the runtime goes in the background.
            drop(mocks);
            rt.shutdown_background();
        }
    }
}

/// The upstream's answer in the overhead benchmarks: `chunks` one-word content chunks
/// (plain: one JSON body, sent at once).
pub fn plain_answer(chunks: usize) -> Behavior {
    Behavior {
        chunk_count: Some(chunks as u32),
        ..Behavior::default()
    }
}

/// The same answer streamed: the first chunk alone, the rest (then usage frame and
/// `[DONE]`) 1 ms later. Without that pause the mock writes the whole stream at once, and
/// a proxy that reads a whole answer in one go does not stream it chunk by chunk. The
/// mock also waits one runtime timer tick (≤ 1 ms) before the first chunk; the baseline
/// pays both.
pub fn streamed_answer(chunks: usize) -> Behavior {
    Behavior {
        gaps_ms: vec![1.0],
        ..plain_answer(chunks)
    }
}

/// Average CPU use of process `pid` over `over` while nothing is asked of it (µs per s).
pub fn idle_cpu(pid: u32, over: Duration) -> Option<f64> {
    let a = cpu_time(Some(pid))?;
    std::thread::sleep(over);
    let b = cpu_time(Some(pid))?;
    Some(us(b.saturating_sub(a)) / over.as_secs_f64())
}

/// One measured call.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub total: Duration,
    /// To the first incremental chunk (streams).
    pub ttft: Option<Duration>,
    /// To the last incremental chunk (direct streams).
    pub last: Option<Duration>,
    /// A stream whose content came in fewer chunks than the upstream sent.
    pub coalesced: bool,
}

/// The baseline: a direct reqwest call with the same body the gateway sends, the body
/// parsed as a minimal client would (plain: one JSON; streamed: each SSE event parsed,
/// content chunks counted, the first one timed).
#[derive(Clone, Debug)]
pub struct Direct {
    pub http: reqwest::Client,
    pub url: String,
    pub model: String,
    pub key: String,
}

impl Direct {
    pub fn new(base_url: &str, model: &str, key: &str) -> Direct {
        Direct {
            http: reqwest::Client::builder()
                .tcp_nodelay(true)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("reqwest client"),
            url: format!("{base_url}/chat/completions"),
            model: model.to_string(),
            key: key.to_string(),
        }
    }

    fn body(&self, prompt: &str, stream: bool) -> Value {
        let mut b = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
        });
        if stream {
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }

    /// One call; `expect_chunks` content chunks must arrive (streams), or as many words
    /// of content (plain: the check the gateway variants make of their answer, so that
    /// both sides pay for it).
    pub async fn call(
        &self,
        prompt: &str,
        stream: bool,
        expect_chunks: usize,
    ) -> Result<Sample, String> {
        let start = Instant::now();
        let resp = self
            .http
            .post(&self.url)
            .bearer_auth(&self.key)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&self.body(prompt, stream)).expect("body"))
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("HTTP {status}: {text}"));
        }
        if !stream {
            let bytes = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("json: {e}"))?;
            let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
            if content.split_whitespace().count() != expect_chunks {
                return Err(format!("unexpected content: {v}"));
            }
            return Ok(Sample {
                total: start.elapsed(),
                ttft: None,
                last: None,
                coalesced: false,
            });
        }
        let mut body = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::with_capacity(8192);
        let mut ttft = None;
        let mut last = None;
        let mut chunks = 0usize;
        let mut words = 0usize;
        let mut done = false;
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| format!("stream: {e}"))?;
            buf.extend_from_slice(&piece);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                for line in event.split(|b| *b == b'\n') {
                    let Some(data) = line.strip_prefix(b"data: ") else {
                        continue;
                    };
                    if data == b"[DONE]" {
                        done = true;
                        continue;
                    }
                    let v: Value =
                        serde_json::from_slice(data).map_err(|e| format!("frame: {e}"))?;
                    let c = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
                    if !c.is_empty() {
                        chunks += 1;
                        words += c.split_whitespace().count();
                        last = Some(start.elapsed());
                        if ttft.is_none() {
                            ttft = Some(start.elapsed());
                        }
                    }
                }
            }
        }
        // The answer is one word per upstream chunk: all must arrive, however grouped.
        if !done || words != expect_chunks {
            return Err(format!(
                "stream ended early: done={done}, {words} of {expect_chunks} words"
            ));
        }
        Ok(Sample {
            total: start.elapsed(),
            ttft,
            last,
            coalesced: chunks < expect_chunks,
        })
    }
}

/// Runs `n` calls of `f(i)` with `concurrency` callers (each caller takes the next index
/// until `n` are done); returns the samples, the failures and the wall time.
pub async fn drive<F, Fut>(
    n: usize,
    concurrency: usize,
    f: F,
) -> (Vec<Sample>, Vec<String>, Duration)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Sample, String>> + Send,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (f, next) = (f.clone(), next.clone());
        set.spawn(async move {
            let mut ok = Vec::new();
            let mut err = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                match f(i).await {
                    Ok(s) => ok.push(s),
                    Err(e) => err.push(e),
                }
            }
            (ok, err)
        });
    }
    let mut samples = Vec::with_capacity(n);
    let mut failures = Vec::new();
    while let Some(r) = set.join_next().await {
        let (ok, err) = r.expect("caller task");
        samples.extend(ok);
        failures.extend(err);
    }
    (samples, failures, start.elapsed())
}

/// A count from the environment (`POLYGW_BENCH_CALLS`, `POLYGW_BENCH_CALLERS`), else
/// `default`.
pub fn env_count(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(default)
}

/// The profile mode (`POLYGW_BENCH_PROFILE`): `calls` calls of `f` with `concurrency`
/// callers and nothing else, for a profiler; prints calls/s and the CPU per call of
/// `cpu_of` (a process id; this process when `None`) and the first failures. True when
/// every call succeeded.
pub async fn profile_drive<F, Fut>(
    calls: usize,
    concurrency: usize,
    cpu_of: Option<u32>,
    f: F,
) -> bool
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Sample, String>> + Send,
{
    let cpu0 = cpu_time(cpu_of);
    let (samples, failures, wall) = drive(calls, concurrency, f).await;
    let cpu = match (cpu0, cpu_time(cpu_of)) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    println!(
        "{} calls, {} failed: {:.0} calls/s, {} {:.1} µs CPU per call",
        samples.len(),
        failures.len(),
        samples.len() as f64 / wall.as_secs_f64(),
        if cpu_of.is_some() { "proxy" } else { "process" },
        cpu.as_secs_f64() * 1e6 / samples.len().max(1) as f64
    );
    for f in failures.iter().take(3) {
        println!("  failure: {f}");
    }
    failures.is_empty()
}

/// Nearest-rank percentile of sorted values.
pub fn pct<T: Copy>(sorted: &[T], p: f64) -> T {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Accumulated measurements of one variant over several rounds.
#[derive(Default, Debug)]
pub struct Acc {
    pub totals: Vec<Duration>,
    pub ttfts: Vec<Duration>,
    /// Last incremental chunk minus first (direct streams).
    pub spans: Vec<Duration>,
    /// End of stream minus last incremental chunk (direct streams).
    pub tails: Vec<Duration>,
    pub failures: Vec<String>,
    pub wall: Duration,
    pub cpu: Duration,
    pub calls: usize,
    /// Streams whose chunks arrived grouped (see [`Sample::coalesced`]).
    pub coalesced: usize,
}

impl Acc {
    pub fn add(&mut self, samples: Vec<Sample>, failures: Vec<String>, wall: Duration) {
        self.calls += samples.len() + failures.len();
        for s in samples {
            self.coalesced += usize::from(s.coalesced);
            self.totals.push(s.total);
            if let Some(t) = s.ttft {
                self.ttfts.push(t);
            }
            if let (Some(f), Some(l)) = (s.ttft, s.last) {
                self.spans.push(l.saturating_sub(f));
                self.tails.push(s.total.saturating_sub(l));
            }
        }
        self.failures.extend(failures);
        self.wall += wall;
    }

    pub fn finish(&mut self) {
        self.totals.sort();
        self.ttfts.sort();
        self.spans.sort();
        self.tails.sort();
    }

    pub fn p(&self, p: f64) -> f64 {
        if self.totals.is_empty() {
            return f64::NAN;
        }
        us(pct(&self.totals, p))
    }

    pub fn ttft_p(&self, p: f64) -> Option<f64> {
        (!self.ttfts.is_empty()).then(|| us(pct(&self.ttfts, p)))
    }

    pub fn span_p(&self, p: f64) -> Option<f64> {
        (!self.spans.is_empty()).then(|| us(pct(&self.spans, p)))
    }

    pub fn tail_p(&self, p: f64) -> Option<f64> {
        (!self.tails.is_empty()).then(|| us(pct(&self.tails, p)))
    }

    pub fn per_s(&self) -> f64 {
        self.calls as f64 / self.wall.as_secs_f64()
    }

    pub fn cpu_per_call_us(&self) -> f64 {
        us(self.cpu) / self.calls.max(1) as f64
    }
}
