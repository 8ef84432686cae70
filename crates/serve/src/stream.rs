//! Streamed answers, for every API route (SPEC §13, §15, §17.2–17.3): the call is a
//! [`polygw::ChatStream`]; an [`Encoder`] writes its events in the route's wire format.
//!
//! - Until a leg commits (its first chunk), the call is polled by the handler: a call
//!   that fails then gets its HTTP error status, rendered by the route. If no leg has
//!   committed after `keepalive` and an attempt is running, the answer starts anyway —
//!   200 and the stream headers — so that an idle timeout in front of the proxy never
//!   cuts a reasoning model's long first token; while the call only waits (for
//!   admission, a backoff), nothing is sent, so a call that then fails still gets its
//!   status (a 429 with `Retry-After`, not a 200 and an error event).
//! - Once the answer has started, every `keepalive` of silence gets the encoder's
//!   keepalive (an SSE comment, Anthropic's `ping`), whatever the call is doing — a
//!   stall being rescued, a resume leg being admitted or replayed (SPEC §17.3).
//! - After the headers, a failure is the encoder's error event, never a silent end; so
//!   are the end of a shutdown's grace period (`server_shutdown`) and a client that
//!   ends its side (`client_closed_request`, the call is cancelled). Events that are
//!   ready together go out in one write.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use polygw::{
    CallOptions, ChatEvent, ChatRequest, ChatStream, Commit, GatewayClient, GatewayError,
    LlmResponse, StreamDelta,
};
use tokio::time::{Instant, Sleep};

use crate::conn::ConnCtx;
use crate::errors::{from_gateway, ApiError};
use crate::http::{
    answer_headers, client_closed, client_gone, commit_headers, failure_headers, set_request_id,
    shutting_down,
};
use crate::scope::Slot;
use crate::state::{cut_done, State};

/// The most events written in one body chunk.
const MAX_BATCH: usize = 256;

/// How an API writes a stream.
pub(crate) trait Encoder: Send + 'static {
    /// The stream's first bytes, written when the answer starts (before any chunk).
    fn open(&mut self, out: &mut Vec<u8>);
    /// A leg was committed (the first one, or a resume leg taking over).
    fn committed(&mut self, _c: &Commit) {}
    /// The next chunk of the answer.
    fn delta(&mut self, d: StreamDelta, out: &mut Vec<u8>);
    /// The call completed: closes the stream (the whole answer when no chunk was sent,
    /// as for a cache hit).
    fn done(&mut self, r: &LlmResponse, out: &mut Vec<u8>);
    /// The call failed after the answer started: the API's error event, last.
    fn fail(&mut self, e: &ApiError, out: &mut Vec<u8>);
    /// Work to finish before the stream's last bytes go out (storing the answer, so a
    /// client that reads the end can refer to it at once).
    fn finished(&mut self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        None
    }
    /// A keepalive on silence.
    fn keepalive(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(b": keepalive\n\n");
    }
}

/// Whether a stream passes a native source's events or translates chunks, once its
/// first chunk says (SPEC §23.2). A route whose scope has sources of its own API
/// (`lazy`) writes nothing before that first chunk: a native leg's events then pass
/// unchanged, another leg's are translated by the route's encoder.
#[derive(Debug)]
pub(crate) struct Passing {
    /// The client's API: only its events pass as received.
    api: polygw::core::source::SourceApi,
    lazy: bool,
    mode: Mode,
    /// The event names that end a native stream (`message_stop`, `response.completed`).
    terminal: &'static [&'static str],
    /// Every native event written (name, data), until a leg continues them: the
    /// route's encoder then follows them (SPEC §23.6). The last one is the stream's
    /// terminal event once it ended.
    passed: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Undecided,
    Native {
        ended: bool,
    },
    /// Native events passed, then another leg took over after a cut (SPEC §23.6): its
    /// chunks are written by the route's encoder, continuing the same stream.
    Continued,
    Translated,
}

/// What a [`Passing`] stream's end needs from the route's encoder.
pub(crate) enum Ending {
    /// Translated (or nothing came): the encoder closes its own stream.
    Translate,
    /// Native, and the source's terminal event went out.
    Ended,
    /// Native, accepted without its terminal event (it broke after its stop): the
    /// encoder closes the stream.
    Unended,
}

impl Passing {
    /// A stream of a client of `api` that may pass its API's events (`lazy`) ending with
    /// one of `terminal`; events of another API's source are translated (SPEC §23.3).
    pub(crate) fn new(
        api: polygw::core::source::SourceApi,
        lazy: bool,
        terminal: &'static [&'static str],
    ) -> Self {
        Passing {
            api,
            lazy,
            mode: Mode::Undecided,
            terminal,
            passed: Vec::new(),
        }
    }

    /// A leg was committed: when it continues a native stream cut before its end (a
    /// resume leg), the stream is written by the encoder from now on, and the events
    /// passed so far are given back for the encoder to follow.
    pub(crate) fn continue_after(&mut self, c: &Commit) -> Option<Vec<(String, String)>> {
        if c.first || !matches!(self.mode, Mode::Native { ended: false }) {
            return None;
        }
        self.mode = Mode::Continued;
        Some(std::mem::take(&mut self.passed))
    }

    /// At the stream's start: whether the encoder writes its opening events now (not
    /// `lazy`: the stream is translated from the start).
    pub(crate) fn open_translated(&mut self) -> bool {
        if !self.lazy {
            self.mode = Mode::Translated;
        }
        !self.lazy
    }

    /// A chunk: a native event is written as received (`None` back); any other chunk
    /// is given back for the encoder to translate.
    pub(crate) fn pass(&mut self, d: StreamDelta, out: &mut Vec<u8>) -> Option<StreamDelta> {
        self.pass_edited(d, out, |_| {})
    }

    /// [`Self::pass`], with `edit` applied to a native event before it is written (an
    /// edit of SPEC §23.2's list).
    pub(crate) fn pass_edited(
        &mut self,
        d: StreamDelta,
        out: &mut Vec<u8>,
        edit: impl FnOnce(&mut polygw::core::native::NativeEvent),
    ) -> Option<StreamDelta> {
        let native = d.native.filter(|ev| ev.api == self.api);
        match (self.mode, native) {
            (Mode::Undecided | Mode::Native { .. }, Some(mut ev)) => {
                edit(&mut ev);
                let ended = matches!(self.mode, Mode::Native { ended: true })
                    || ev
                        .event
                        .as_deref()
                        .is_some_and(|e| self.terminal.contains(&e));
                self.mode = Mode::Native { ended };
                ev.write_to(out);
                let ev = *ev;
                let name = match ev.event {
                    Some(name) => name,
                    None => event_type(&ev.data).unwrap_or_default(),
                };
                self.passed.push((name, ev.data));
                None
            }
            (Mode::Native { .. }, None) => {
                // A leg of another API continuing a native stream without a commit:
                // not reached (a continuation is committed first).
                tracing::error!("a translated chunk in a native stream, dropped");
                None
            }
            (Mode::Continued, _) => Some(StreamDelta { native: None, ..d }),
            (_, native) => {
                self.mode = Mode::Translated;
                Some(StreamDelta { native, ..d })
            }
        }
    }

    /// Whether the stream passes native events (and no other leg continued them).
    pub(crate) fn is_native(&self) -> bool {
        matches!(self.mode, Mode::Native { .. })
    }

    /// The data of the last native event written.
    pub(crate) fn last_event(&self) -> Option<&str> {
        self.passed.last().map(|(_, data)| data.as_str())
    }

    /// How the stream ends.
    pub(crate) fn ending(&self) -> Ending {
        match self.mode {
            Mode::Native { ended: true } => Ending::Ended,
            Mode::Native { ended: false } => Ending::Unended,
            Mode::Undecided | Mode::Continued | Mode::Translated => Ending::Translate,
        }
    }
}

/// The `type` of an event's JSON data, read without building it.
fn event_type(data: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Typed<'a> {
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_str::<Typed<'_>>(data)
        .ok()?
        .kind
        .map(std::borrow::Cow::into_owned)
}

/// Renders an error before the answer started, in the route's shape.
pub(crate) type RenderError = fn(&ApiError) -> Response;

type Signal = Pin<Box<dyn Future<Output = ()> + Send>>;

fn signal(f: impl Future<Output = ()> + Send + 'static) -> Signal {
    Box::pin(f)
}

struct Pump<E> {
    stream: ChatStream,
    enc: E,
    opened: bool,
    done: bool,
    keepalive: std::time::Duration,
    tick: Pin<Box<Sleep>>,
    cut: Signal,
    gone: Signal,
    /// The scope's call slot, held until the stream ends.
    _slot: Slot,
}

impl<E: Encoder> Pump<E> {
    fn push(&mut self, out: &mut Vec<u8>, item: Result<ChatEvent, GatewayError>) {
        match item {
            Ok(ChatEvent::Committed(c)) => {
                if !c.first {
                    let mode = c.resume_mode.map_or("none", |m| m.as_str());
                    tracing::info!(source = %c.source, mode, "the stream resumed on another attempt");
                }
                self.enc.committed(&c);
            }
            Ok(ChatEvent::Delta(d)) => self.enc.delta(d, out),
            Ok(ChatEvent::Done(r)) => {
                self.enc.done(&r, out);
                self.done = true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "stream failed after its headers");
                self.enc.fail(&from_gateway(&e), out);
                self.done = true;
            }
        }
    }

    /// The next body chunk: every event available now, in one write.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            let mut out = Vec::new();
            if !self.opened {
                // The stream's first events go out at once, before any chunk.
                self.opened = true;
                self.enc.open(&mut out);
                if !out.is_empty() {
                    let next = Instant::now() + self.keepalive;
                    self.tick.as_mut().reset(next);
                    return Some(Bytes::from(out));
                }
            }
            tokio::select! {
                biased;
                () = &mut self.cut => {
                    self.enc.fail(&shutting_down(), &mut out);
                    self.done = true;
                }
                () = &mut self.gone => {
                    // The call is dropped with this state (every leg cancelled).
                    self.enc.fail(&client_closed(), &mut out);
                    self.done = true;
                }
                item = self.stream.next() => {
                    match item {
                        None => self.done = true,
                        Some(item) => self.push(&mut out, item),
                    }
                    let mut n = 1;
                    while !self.done && n < MAX_BATCH {
                        match self.stream.next().now_or_never() {
                            Some(Some(item)) => {
                                self.push(&mut out, item);
                                n += 1;
                            }
                            Some(None) => self.done = true,
                            None => break,
                        }
                    }
                }
                () = &mut self.tick => self.enc.keepalive(&mut out),
            }
            if self.done {
                if let Some(f) = self.enc.finished() {
                    f.await;
                }
            }
            if !out.is_empty() {
                // Silence is measured from the last write.
                let next = Instant::now() + self.keepalive;
                self.tick.as_mut().reset(next);
                return Some(Bytes::from(out));
            }
        }
    }
}

fn stream_headers(resp: &mut Response, logical_call_id: &str) {
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies in front (nginx) must not buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    set_request_id(h, logical_call_id);
}

/// Runs a streamed chat and answers with the encoder's stream, or with an error status
/// (rendered by `render`) when the call fails before its first chunk and before the
/// stream started.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn respond<E: Encoder>(
    st: Arc<State>,
    client: GatewayClient,
    request: ChatRequest,
    options: CallOptions,
    slot: Slot,
    ctx: Option<Arc<ConnCtx>>,
    mut enc: E,
    render: RenderError,
) -> Response {
    let id = options.logical_call_id.clone().unwrap_or_default();
    let keepalive = st.cfg.keepalive;
    let mut stream = client.chat_stream_with(request, options);
    let tick = tokio::time::sleep(keepalive);
    tokio::pin!(tick);
    // Until a leg commits, the call ends, or (an attempt running) the keepalives start.
    let mut early_done: Option<Box<LlmResponse>> = None;
    // When an attempt was first seen running at a tick (reset when none runs).
    let mut running_since: Option<Instant> = None;
    let commit: Option<Commit> = loop {
        tokio::select! {
            biased;
            ev = stream.next() => match ev {
                Some(Ok(ChatEvent::Committed(c))) => break Some(c),
                // Chunks come after their leg's commit.
                Some(Ok(ChatEvent::Delta(_))) => {}
                Some(Ok(ChatEvent::Done(r))) => {
                    early_done = Some(r);
                    break None;
                }
                Some(Err(e)) => {
                    let mut r = render(&from_gateway(&e));
                    failure_headers(r.headers_mut(), &e, &id);
                    return r;
                }
                None => {
                    let mut r = render(&ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "internal",
                        "the call ended without an answer",
                    ));
                    set_request_id(r.headers_mut(), &id);
                    return r;
                }
            },
            () = client_gone(&ctx) => return render(&client_closed()),
            () = cut_done(st.cut_signal()) => {
                let mut r = render(&shutting_down());
                set_request_id(r.headers_mut(), &id);
                return r;
            }
            () = &mut tick => {
                let now = Instant::now();
                if stream.attempts_running() == 0 {
                    // Only waiting (admission, a backoff): no 200 yet (SPEC §17.2).
                    running_since = None;
                } else if running_since.is_some_and(|t| now >= t + keepalive / 4) {
                    break None;
                } else if running_since.is_none() {
                    // Seen running once: the 200 only if it still runs a quarter of the
                    // keepalive later. An attempt caught in flight that is answered
                    // at once (a 429 after a hint waited out) must keep its status.
                    running_since = Some(now);
                }
                tick.as_mut().reset(now + keepalive / 4);
            }
        }
    };
    if let Some(c) = &commit {
        enc.committed(c);
    }
    let mut first = Vec::new();
    let done = early_done.is_some();
    let mut opened = done;
    if commit.is_none() && !done {
        // Started by the keepalive (an attempt runs, no chunk yet): the stream's first
        // events, and a keepalive at once.
        enc.open(&mut first);
        enc.keepalive(&mut first);
        opened = true;
    }
    if let Some(r) = &early_done {
        // Answered before any leg committed (a cache hit): the whole answer at once.
        enc.open(&mut first);
        enc.done(r, &mut first);
        if let Some(f) = enc.finished() {
            f.await;
        }
    }
    let gone: Signal = match ctx {
        Some(c) => signal(async move { c.closed().await }),
        None => signal(std::future::pending()),
    };
    let pump = Pump {
        stream,
        enc,
        opened,
        done,
        keepalive,
        tick: Box::pin(tokio::time::sleep(keepalive)),
        cut: signal(cut_done(st.cut_signal())),
        gone,
        _slot: slot,
    };
    let head = (!first.is_empty()).then(|| Ok::<Bytes, std::io::Error>(Bytes::from(first)));
    let body = futures_util::stream::iter(head).chain(futures_util::stream::unfold(
        pump,
        |mut s| async move {
            s.next_bytes()
                .await
                .map(|b| (Ok::<Bytes, std::io::Error>(b), s))
        },
    ));
    let mut resp = Response::new(Body::from_stream(body));
    stream_headers(&mut resp, &id);
    if let Some(c) = &commit {
        commit_headers(resp.headers_mut(), c);
    }
    if let Some(r) = &early_done {
        answer_headers(resp.headers_mut(), r);
    }
    resp
}
