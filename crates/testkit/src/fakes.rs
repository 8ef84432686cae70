//! Event-driven fakes for engine tests: a scripted chat transport whose timing runs on
//! tokio's (pausable) clock, and a telemetry recorder that keeps every row.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw_core::ports::{
    ChatAttempt, Clock, EmbeddingResult, EmbeddingTransport, FlushReport, OcrResult, OcrTransport,
    TelemetryRecorder, Transport, TransportResult,
};
use polygw_core::stall::StallMeter;
use polygw_core::{
    AttemptError, ErrorClass, ErrorLabel, SourceConfig, TelemetryError, TelemetryRow, Usage,
    UsageSource,
};
use tokio::sync::Notify;

/// A gate a scripted attempt waits on until the test opens it.
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    notify: Notify,
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Arc<Self> {
        Arc::new(Gate::default())
    }

    /// Opens it for every waiter, now and later.
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.notify.notify_waiters();
    }

    /// Waits until open.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if *self.open.lock().unwrap() {
                return;
            }
            notified.await;
        }
    }
}

/// What one attempt of the fake does.
#[derive(Debug, Clone)]
pub enum Script {
    /// Succeeds. Streams: the first incremental chunk after `ttft`, one more after each
    /// of `gaps`. Plain: returns after `ttft + Σ gaps`.
    Ok {
        /// Delay to the first chunk (plain: part of the whole delay).
        ttft: Duration,
        /// Gaps between later chunks.
        gaps: Vec<Duration>,
        /// The answer; split over the chunks.
        text: String,
        /// Reported usage (`None` = no usage frame: unavailable).
        usage: Option<Usage>,
    },
    /// Produces the chunks of `ttft`/`gaps`, then fails `after_last` later.
    ChunksThenFail {
        /// Delay to the first chunk.
        ttft: Duration,
        /// Gaps between later chunks.
        gaps: Vec<Duration>,
        /// Delay after the last chunk before failing.
        after_last: Duration,
        /// The failure.
        error: AttemptError,
    },
    /// Fails after `after`.
    Fail {
        /// Delay before failing.
        after: Duration,
        /// The failure.
        error: AttemptError,
    },
    /// Never completes (until dropped).
    Hang,
    /// Waits for the gate, then plays `then`.
    Gated {
        /// The gate.
        gate: Arc<Gate>,
        /// What follows.
        then: Box<Script>,
    },
}

impl Script {
    /// A quick success: `text` after `ttft`, usage 10/`text.len()`.
    pub fn ok(ttft: Duration, text: &str) -> Script {
        Script::Ok {
            ttft,
            gaps: vec![],
            text: text.to_string(),
            usage: Some(Usage::new(10, text.len() as u64)),
        }
    }

    /// A streamed success with these gaps between chunks.
    pub fn stream(ttft: Duration, gaps: &[Duration], text: &str) -> Script {
        Script::Ok {
            ttft,
            gaps: gaps.to_vec(),
            text: text.to_string(),
            usage: Some(Usage::new(10, text.len() as u64)),
        }
    }

    /// A failure of this class/label after `after`.
    pub fn fail(after: Duration, class: ErrorClass, label: ErrorLabel) -> Script {
        Script::Fail {
            after,
            error: AttemptError::new(class, label, format!("scripted {}", label.as_str())),
        }
    }

    /// HTTP-style failure with a status.
    pub fn http(after: Duration, status: u16) -> Script {
        let (class, label) = polygw_core::classify::classify_status(status)
            .unwrap_or((ErrorClass::Invalid, ErrorLabel::Invalid));
        Script::Fail {
            after,
            error: AttemptError::new(class, label, format!("HTTP {status}")).with_status(status),
        }
    }

    /// 429 with an optional Retry-After.
    pub fn rate_limited(after: Duration, retry_after: Option<Duration>) -> Script {
        Script::Fail {
            after,
            error: AttemptError::new(ErrorClass::RateLimited, ErrorLabel::RateLimited, "HTTP 429")
                .with_status(429)
                .with_retry_after(retry_after),
        }
    }
}

/// How a fake attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeEnd {
    /// Still running.
    Running,
    /// Returned a result.
    Ok,
    /// Returned an error.
    Failed,
    /// Its future was dropped before it returned.
    Dropped,
}

/// One attempt the fake received.
#[derive(Debug, Clone)]
pub struct FakeCall {
    /// Source name.
    pub source: String,
    /// Attempt id.
    pub call_id: String,
    /// Whether it was a stream.
    pub stream: bool,
    /// When it started (clock time).
    pub started: Instant,
    /// When it ended, if it did.
    pub ended: Option<Instant>,
    /// How it ended.
    pub end: FakeEnd,
}

#[derive(Debug, Default)]
struct State {
    queues: HashMap<String, VecDeque<Script>>,
    defaults: HashMap<String, Script>,
    calls: Vec<FakeCall>,
}

/// A chat transport that plays scripts per source, in order, on tokio's clock.
#[derive(Debug)]
pub struct FakeTransport {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    changed: Notify,
}

struct CallMark<'a> {
    fake: &'a FakeTransport,
    index: usize,
    done: bool,
}

impl CallMark<'_> {
    fn end(&mut self, end: FakeEnd) {
        let now = self.fake.clock.now();
        let mut s = self.fake.state.lock().unwrap();
        s.calls[self.index].end = end;
        s.calls[self.index].ended = Some(now);
        self.done = true;
        drop(s);
        self.fake.changed.notify_waiters();
    }
}

impl Drop for CallMark<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.end(FakeEnd::Dropped);
        }
    }
}

impl FakeTransport {
    /// A fake with no scripts (every source succeeds at once with "ok").
    pub fn new(clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(FakeTransport {
            clock,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
        })
    }

    /// Queues a script for the next attempt on `source`.
    pub fn push(&self, source: &str, script: Script) {
        self.state
            .lock()
            .unwrap()
            .queues
            .entry(source.to_string())
            .or_default()
            .push_back(script);
    }

    /// What `source` does when its queue is empty.
    pub fn set_default(&self, source: &str, script: Script) {
        self.state
            .lock()
            .unwrap()
            .defaults
            .insert(source.to_string(), script);
    }

    /// Every attempt received so far.
    pub fn calls(&self) -> Vec<FakeCall> {
        self.state.lock().unwrap().calls.clone()
    }

    /// Attempts received by `source`.
    pub fn calls_to(&self, source: &str) -> usize {
        self.calls().iter().filter(|c| c.source == source).count()
    }

    /// Waits until `pred(calls)` holds (event-driven, no polling).
    pub async fn wait_until(&self, pred: impl Fn(&[FakeCall]) -> bool) {
        loop {
            let notified = self.changed.notified();
            if pred(&self.state.lock().unwrap().calls) {
                return;
            }
            notified.await;
        }
    }

    /// Waits until at least `n` attempts have started.
    pub async fn wait_started(&self, n: usize) {
        self.wait_until(|c| c.len() >= n).await
    }

    fn next_script(&self, source: &str) -> Script {
        let mut s = self.state.lock().unwrap();
        if let Some(q) = s.queues.get_mut(source) {
            if let Some(x) = q.pop_front() {
                return x;
            }
        }
        s.defaults
            .get(source)
            .cloned()
            .unwrap_or_else(|| Script::ok(Duration::ZERO, "ok"))
    }

    async fn play(
        &self,
        script: Script,
        attempt: &ChatAttempt<'_>,
        start: Instant,
    ) -> Result<TransportResult, AttemptError> {
        let stream = attempt.request.stream;
        let mut meter = StallMeter::new(start, attempt.stall_threshold);
        let chunks = |ttft: Duration, gaps: &[Duration]| {
            let mut v = vec![ttft];
            v.extend_from_slice(gaps);
            v
        };
        match script {
            Script::Gated { gate, then } => {
                gate.wait().await;
                Box::pin(self.play(*then, attempt, start)).await
            }
            Script::Hang => std::future::pending().await,
            Script::Fail { after, error } => {
                tokio::time::sleep(after).await;
                Err(error)
            }
            Script::ChunksThenFail {
                ttft,
                gaps,
                after_last,
                error,
            } => {
                for d in chunks(ttft, &gaps) {
                    tokio::time::sleep(d).await;
                    if stream {
                        let at = self.clock.now();
                        meter.on_chunk(at);
                        if attempt.observer.wants_deltas() {
                            attempt.observer.on_delta(
                                at,
                                polygw_core::ports::StreamDelta {
                                    content: Some("x".into()),
                                    ..Default::default()
                                },
                            );
                        } else {
                            attempt.observer.on_chunk(at);
                        }
                    }
                }
                tokio::time::sleep(after_last).await;
                Err(error)
            }
            Script::Ok {
                ttft,
                gaps,
                text,
                usage,
            } => {
                let times = chunks(ttft, &gaps);
                let n = times.len();
                let chars: Vec<char> = text.chars().collect();
                let per = chars.len().div_ceil(n.max(1)).max(1);
                for (i, d) in times.iter().enumerate() {
                    tokio::time::sleep(*d).await;
                    if stream {
                        let at = self.clock.now();
                        meter.on_chunk(at);
                        if attempt.observer.wants_deltas() {
                            let piece: String = chars.iter().skip(i * per).take(per).collect();
                            attempt.observer.on_delta(
                                at,
                                polygw_core::ports::StreamDelta {
                                    role: (i == 0).then(|| "assistant".to_string()),
                                    content: Some(if piece.is_empty() {
                                        " ".into()
                                    } else {
                                        piece
                                    }),
                                    ..Default::default()
                                },
                            );
                        } else {
                            attempt.observer.on_chunk(at);
                        }
                    }
                }
                let (usage, usage_source) = match usage {
                    Some(u) => (u, UsageSource::Measured),
                    None => (Usage::default(), UsageSource::Unavailable),
                };
                Ok(TransportResult {
                    content: text,
                    finish_reason: Some("stop".into()),
                    model: Some(attempt.source.model.clone()),
                    usage,
                    usage_source,
                    http_status: 200,
                    stream: stream.then(|| meter.figures()),
                    ..Default::default()
                })
            }
        }
    }
}

#[async_trait]
impl Transport for FakeTransport {
    async fn chat<'a>(&self, attempt: ChatAttempt<'a>) -> Result<TransportResult, AttemptError> {
        let start = self.clock.now();
        let index = {
            let mut s = self.state.lock().unwrap();
            s.calls.push(FakeCall {
                source: attempt.source.name.clone(),
                call_id: attempt.call_id.to_string(),
                stream: attempt.request.stream,
                started: start,
                ended: None,
                end: FakeEnd::Running,
            });
            s.calls.len() - 1
        };
        self.changed.notify_waiters();
        let mut mark = CallMark {
            fake: self,
            index,
            done: false,
        };
        let script = self.next_script(&attempt.source.name);
        let r = self.play(script, &attempt, start).await;
        mark.end(if r.is_ok() {
            FakeEnd::Ok
        } else {
            FakeEnd::Failed
        });
        r
    }
}

/// A fake embedding transport: vector `[len, index]` per text, usage = total chars.
#[derive(Debug, Default)]
pub struct FakeEmbedder {
    fail_next: Mutex<VecDeque<Option<AttemptError>>>,
    /// Per batch: (source, texts).
    pub batches: Mutex<Vec<(String, Vec<String>)>>,
    /// Report usage as unavailable for batches containing this text.
    pub unavailable_marker: Mutex<Option<String>>,
}

impl FakeEmbedder {
    /// Queues the outcome of the next batches (`Some(err)` fails it).
    pub fn push_outcome(&self, outcome: Option<AttemptError>) {
        self.fail_next.lock().unwrap().push_back(outcome);
    }
}

#[async_trait]
impl EmbeddingTransport for FakeEmbedder {
    async fn embed(
        &self,
        source: &SourceConfig,
        texts: &[String],
        _call_id: &str,
    ) -> Result<EmbeddingResult, AttemptError> {
        self.batches
            .lock()
            .unwrap()
            .push((source.name.clone(), texts.to_vec()));
        if let Some(Some(e)) = self.fail_next.lock().unwrap().pop_front() {
            return Err(e);
        }
        let unavailable = self
            .unavailable_marker
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|m| texts.iter().any(|t| t == m));
        let tokens: u64 = texts.iter().map(|t| t.len() as u64).sum();
        Ok(EmbeddingResult {
            vectors: texts
                .iter()
                .map(|t| {
                    vec![
                        t.len() as f32,
                        t.chars().next().map_or(0.0, |c| c as u32 as f32),
                    ]
                })
                .collect(),
            usage: if unavailable {
                Usage::default()
            } else {
                Usage::new(tokens, 0)
            },
            usage_source: if unavailable {
                UsageSource::Unavailable
            } else {
                UsageSource::Measured
            },
            model: Some(source.model.clone()),
            http_status: 200,
        })
    }
}

/// A fake OCR transport returning `text of <mime> (<n> bytes)`.
#[derive(Debug, Default)]
pub struct FakeOcr;

#[async_trait]
impl OcrTransport for FakeOcr {
    async fn recognize(
        &self,
        source: &SourceConfig,
        image: &[u8],
        mime: &str,
        _prompt: &str,
        _call_id: &str,
    ) -> Result<OcrResult, AttemptError> {
        Ok(OcrResult {
            text: format!("text of {mime} ({} bytes)", image.len()),
            model: Some(source.model.clone()),
            http_status: 200,
        })
    }
}

/// A telemetry recorder that keeps every row in memory.
#[derive(Debug, Default)]
pub struct RecordingTelemetry {
    rows: Mutex<Vec<TelemetryRow>>,
}

impl RecordingTelemetry {
    /// An empty recorder.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Every row so far.
    pub fn rows(&self) -> Vec<TelemetryRow> {
        self.rows.lock().unwrap().clone()
    }

    /// Rows of one logical call.
    pub fn rows_of(&self, logical_call_id: &str) -> Vec<TelemetryRow> {
        self.rows()
            .into_iter()
            .filter(|r| r.logical_call_id == logical_call_id)
            .collect()
    }
}

#[async_trait]
impl TelemetryRecorder for RecordingTelemetry {
    fn record(&self, row: TelemetryRow) {
        self.rows.lock().unwrap().push(row);
    }
    fn dropped(&self) -> u64 {
        0
    }
    async fn flush(&self) -> Result<FlushReport, TelemetryError> {
        Ok(FlushReport {
            written: self.rows.lock().unwrap().len() as u64,
            dropped: 0,
            pending: 0,
        })
    }
}
