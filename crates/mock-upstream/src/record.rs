//! The request log: one [`RecordedRequest`] per request received, updated when its
//! response ends, so tests can assert what reached the upstream and reconcile usage.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use polygw_core::Usage;
use serde_json::Value;
use tokio::sync::watch;

use crate::behavior::Behavior;
use crate::billing::{BillState, BillingEntry};
use crate::cache::PromptCacheSeen;
use crate::prefill::{PrefillOutcome, PrefillSeen};

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    /// Still being answered.
    InFlight,
    /// A complete answer (or a complete error frame / malformed answer as scripted).
    Completed,
    /// The connection was closed (RST) before any response.
    ResetBeforeHeaders,
    /// The connection was aborted (RST) in the middle of the body.
    ResetMidStream,
    /// The body ended cleanly without finish_reason, usage or `[DONE]`.
    Truncated,
    /// The client went away before the response ended.
    ClientDisconnected,
    /// An error response with this status.
    Error {
        /// The HTTP status sent.
        status: u16,
    },
    /// The mock was shut down while answering.
    ServerShutdown,
}

/// One image seen in a vision request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSeen {
    /// The data URI's media type (or `url` for a non-data URL).
    pub mime: String,
    /// Decoded bytes (0 for a non-data URL).
    pub bytes: usize,
}

/// One request the mock received.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// Sequence number, from 1.
    pub id: u64,
    /// HTTP method.
    pub method: String,
    /// Request path.
    pub path: String,
    /// `model` of the JSON body.
    pub model: Option<String>,
    /// The JSON body (`Value::Null` for none or when recording bodies is off).
    pub body: Value,
    /// `stream` of the body.
    pub stream: bool,
    /// The `x-polygw-call-id` header.
    pub call_id: Option<String>,
    /// Whether an `Authorization` header was present.
    pub authorization: bool,
    /// The `Authorization` header's bearer token, as sent (the mock's clients send test
    /// keys; tests check which key reached it, e.g. after a rotation).
    pub bearer: Option<String>,
    /// The W3C `traceparent` header, as sent.
    pub traceparent: Option<String>,
    /// When the request (head and body) had arrived.
    pub arrived_at: Instant,
    /// When the response headers were sent.
    pub headers_at: Option<Instant>,
    /// When the response ended (any way).
    pub ended_at: Option<Instant>,
    /// How it ended.
    pub end: EndKind,
    /// HTTP status sent (0 when none was).
    pub status: u16,
    /// Incremental chunks sent.
    pub chunks_sent: u32,
    /// SSE frames sent (any kind, keepalives excluded).
    pub frames_sent: u32,
    /// Keepalive comments sent.
    pub keepalives_sent: u32,
    /// The usage the response reported, if it got that far.
    pub usage: Option<Usage>,
    /// Content text actually sent.
    pub content: String,
    /// Reasoning text actually sent.
    pub reasoning: String,
    /// The complete answer's content, as planned (a successful client must see this);
    /// for a continued prefill, the prefix followed by the planned continuation.
    pub full_content: String,
    /// The prefill the request carried (a final assistant message to continue), and what
    /// the mock did with it.
    pub prefill: Option<PrefillSeen>,
    /// Images of a vision request.
    pub images: Vec<ImageSeen>,
    /// What the prefix cache did for the request (when one is on and the request was
    /// accepted).
    pub prompt_cache: Option<PromptCacheSeen>,
    /// The behavior played (for raw/profile debugging).
    pub behavior: Option<Behavior>,
    /// Whether an `x-api-key` header was present (its value is never kept).
    pub x_api_key: bool,
    /// The request's `anthropic-*` headers, names lower-case.
    pub anthropic_headers: Vec<(String, String)>,
    /// The query string, when the URL had one.
    pub query: Option<String>,
}

impl RecordedRequest {
    /// Whether the response has ended.
    pub fn ended(&self) -> bool {
        self.end != EndKind::InFlight
    }

    /// Whether the request was a prefill the mock rejected (a 400).
    pub fn prefill_rejected(&self) -> bool {
        self.prefill
            .as_ref()
            .is_some_and(|p| p.outcome == PrefillOutcome::Rejected)
    }
}

/// The shared log.
#[derive(Debug)]
pub(crate) struct Log {
    entries: Mutex<VecDeque<RecordedRequest>>,
    bills: Mutex<VecDeque<BillingEntry>>,
    capacity: usize,
    next_id: AtomicU64,
    version: watch::Sender<u64>,
    pub(crate) shutting_down: AtomicBool,
}

impl Log {
    /// A log keeping the `capacity` most recent requests (at least 1).
    pub(crate) fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Log {
            entries: Mutex::new(VecDeque::new()),
            bills: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            next_id: AtomicU64::new(1),
            version: watch::channel(0).0,
            shutting_down: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<RecordedRequest>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn push(&self, r: RecordedRequest) {
        {
            let mut g = self.lock();
            while g.len() >= self.capacity {
                g.pop_front();
            }
            g.push_back(r);
        }
        self.bump();
    }

    pub(crate) fn update(&self, id: u64, f: impl FnOnce(&mut RecordedRequest)) {
        {
            let mut g = self.lock();
            if let Some(r) = g.iter_mut().rev().find(|r| r.id == id) {
                f(r);
            }
        }
        self.bump();
    }

    pub(crate) fn snapshot(&self) -> Vec<RecordedRequest> {
        self.lock().iter().cloned().collect()
    }

    pub(crate) fn clear(&self) {
        self.lock().clear();
        self.bump();
    }

    fn bills(&self) -> std::sync::MutexGuard<'_, VecDeque<BillingEntry>> {
        self.bills.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push_bill(&self, e: BillingEntry) {
        {
            let mut g = self.bills();
            while g.len() >= self.capacity {
                g.pop_front();
            }
            g.push_back(e);
        }
        self.bump();
    }

    pub(crate) fn billing(&self) -> Vec<BillingEntry> {
        self.bills().iter().cloned().collect()
    }

    pub(crate) fn bills_len(&self) -> usize {
        self.bills().len()
    }

    pub(crate) fn clear_billing(&self) {
        self.bills().clear();
        self.bump();
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

/// Progress of one response; commits to the log when finished, or on drop (the client
/// left, or the server shut down).
#[derive(Debug)]
pub(crate) struct Guard {
    log: Arc<Log>,
    pub(crate) id: u64,
    pub(crate) chunks_sent: u32,
    pub(crate) frames_sent: u32,
    pub(crate) keepalives_sent: u32,
    pub(crate) usage: Option<Usage>,
    pub(crate) content: String,
    pub(crate) reasoning: String,
    /// Incremental chunks generated (their time had come; written or about to be).
    pub(crate) generated: u32,
    /// Set once the mock accepted a chat request: billed when the response ends.
    pub(crate) bill: Option<Box<BillState>>,
    done: bool,
}

impl Guard {
    pub(crate) fn new(log: Arc<Log>, id: u64) -> Self {
        Guard {
            log,
            id,
            chunks_sent: 0,
            frames_sent: 0,
            keepalives_sent: 0,
            usage: None,
            content: String::new(),
            reasoning: String::new(),
            generated: 0,
            bill: None,
            done: false,
        }
    }

    pub(crate) fn log_update(&self, f: impl FnOnce(&mut RecordedRequest)) {
        self.log.update(self.id, f);
    }

    pub(crate) fn headers_sent(&self, status: u16) {
        let at = now();
        self.log.update(self.id, |r| {
            r.status = status;
            r.headers_at = Some(at);
        });
    }

    pub(crate) fn finish(&mut self, end: EndKind) {
        if self.done {
            return;
        }
        self.done = true;
        let at = now();
        let (chunks, frames, keep, usage) = (
            self.chunks_sent,
            self.frames_sent,
            self.keepalives_sent,
            self.usage,
        );
        let content = std::mem::take(&mut self.content);
        let reasoning = std::mem::take(&mut self.reasoning);
        self.log.update(self.id, |r| {
            r.end = end;
            r.ended_at = Some(at);
            r.chunks_sent = chunks;
            r.frames_sent = frames;
            r.keepalives_sent = keep;
            r.usage = usage;
            r.content = content;
            r.reasoning = reasoning;
        });
        if let Some(bill) = self.bill.take() {
            let usage_sent = self.usage.is_some();
            self.log
                .push_bill((*bill).entry(self.id, self.generated, usage_sent, end, at));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.done {
            let end = if self.log.shutting_down.load(Ordering::Relaxed) {
                EndKind::ServerShutdown
            } else {
                EndKind::ClientDisconnected
            };
            self.finish(end);
        }
    }
}

/// Monotonic now (tokio's clock, so a paused runtime is consistent).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}
