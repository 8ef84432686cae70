//! One client connection under the server's limits: [`ConnIo`] wraps the socket
//! between hyper and the network, [`ConnCtx`] is what the request handlers know of
//! their connection.
//!
//! What [`ConnIo`] enforces (hyper's HTTP/1.1 parser stays the one that parses):
//!
//! - **Phases** follow the requests: *idle* (no request), *head* (bytes of a request
//!   head arrived, the head is not complete), *request* (hyper handed the request to the
//!   router; until its answer is done), *passthrough* (the connection is closing).
//! - **Header limits**: a head must be complete within `header_timeout` of its first
//!   byte (a new connection: of its accept) and within `max_header_bytes`; otherwise
//!   the client gets a 408 or 431 in OpenAI's error format and the connection closes.
//! - **Idle**: a kept-alive connection without a new request for `idle_timeout` is
//!   closed; so is one whose answer the client does not read for `idle_timeout`.
//! - **hyper's own error answers** (a malformed request line or header, too many
//!   headers: written by hyper with an empty body) are replaced by the same status with
//!   an OpenAI error body — recognized as a response hyper writes while a head is
//!   being read, before the router ever saw it.
//! - **The client's half of the connection**: the end of what the client sends is
//!   seen by [`ConnCtx::closed`] (polled by the handlers while a call runs: hyper does
//!   not read while a request is in flight), and a call whose client is gone is
//!   cancelled (docs/SERVE.md, "Clients that half-close").

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::errors::ApiError;
use crate::metrics::ProxyCounters;

/// What the request handlers know of their connection (a request extension set by
/// [`crate::serve`]; absent when the router is mounted in another server).
#[derive(Debug)]
pub struct ConnCtx {
    /// The client's address.
    pub peer: SocketAddr,
    stream: Arc<TcpStream>,
    started: AtomicU64,
    in_flight: AtomicUsize,
    body_done: AtomicBool,
    closing: AtomicBool,
    read_eof: AtomicBool,
    eof: watch::Sender<bool>,
}

impl ConnCtx {
    fn new(peer: SocketAddr, stream: Arc<TcpStream>) -> ConnCtx {
        ConnCtx {
            peer,
            stream,
            started: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            body_done: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            read_eof: AtomicBool::new(false),
            eof: watch::channel(false).0,
        }
    }

    /// A request was handed to the router; the guard marks it done when dropped (with
    /// the answer's body, or the handler's future if it never answered).
    pub fn request_started(self: &Arc<Self>, body_done: bool) -> InFlight {
        self.body_done.store(body_done, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.started.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// The request's body was read to its end.
    pub fn body_finished(&self) {
        self.body_done.store(true, Ordering::Release);
    }

    /// Whether the current request's body was read to its end.
    pub fn body_is_done(&self) -> bool {
        self.body_done.load(Ordering::Acquire)
    }

    /// The connection closes after the current answer (its request body was not read:
    /// what follows on the wire is not a request).
    pub fn close_after_answer(&self) {
        self.closing.store(true, Ordering::Release);
    }

    fn mark_eof(&self) {
        if !self.read_eof.swap(true, Ordering::AcqRel) {
            self.eof.send_replace(true);
        }
    }

    /// Whether the client has ended its side of the connection (closed, or half-closed
    /// after its request), checked now without waiting.
    pub fn client_gone_now(&self) -> bool {
        if self.read_eof.load(Ordering::Acquire) {
            return true;
        }
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let _ = self.peek_eof(&mut cx);
        self.read_eof.load(Ordering::Acquire)
    }

    /// `Ready` once the client ended its side; `Pending` while it has not, or when
    /// the next request is already waiting (then it is still there).
    fn peek_eof(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.read_eof.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        let mut one = [0u8; 1];
        let mut buf = ReadBuf::new(&mut one);
        match self.stream.poll_peek(cx, &mut buf) {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                self.mark_eof();
                Poll::Ready(())
            }
            // Bytes of a next request: the client is there. Stay pending (no waker is
            // kept for this: the request's own answer ends the wait).
            Poll::Ready(Ok(_)) | Poll::Pending => Poll::Pending,
        }
    }

    /// Resolves when the client ends its side of the connection.
    pub async fn closed(self: &Arc<Self>) {
        let mut seen = self.eof.subscribe();
        let peek = PeekEof {
            ctx: self.clone(),
            data_seen: false,
        };
        tokio::select! {
            _ = seen.wait_for(|eof| *eof) => {}
            () = peek => {}
        }
    }
}

/// Watches the socket for the end of what the client sends, without reading it.
#[derive(Debug)]
struct PeekEof {
    ctx: Arc<ConnCtx>,
    data_seen: bool,
}

impl Future for PeekEof {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.data_seen {
            return Poll::Pending;
        }
        let mut one = [0u8; 1];
        let mut buf = ReadBuf::new(&mut one);
        match self.ctx.stream.poll_peek(cx, &mut buf) {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                self.ctx.mark_eof();
                Poll::Ready(())
            }
            Poll::Ready(Ok(_)) => {
                // The client sent more (a pipelined request): it is there, and the
                // readiness stays set, so stop peeking rather than spin (the reader
                // still reports the end through the watch).
                self.data_seen = true;
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A request in flight on a connection (see [`ConnCtx::request_started`]).
#[derive(Debug)]
pub struct InFlight(Arc<ConnCtx>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The server's limits as the socket wrapper applies them.
#[derive(Debug, Clone)]
pub struct IoLimits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_header_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No request; `first`: the connection's first (it gets `header_timeout`).
    Idle { since: Instant, first: bool },
    /// A head is arriving; `base` is the request count when it began.
    Head {
        base: u64,
        since: Instant,
        len: usize,
        newlines: u8,
        text: bool,
        complete: bool,
    },
    /// hyper handed the request to the router.
    Request,
    /// The connection closes after the current answer; nothing more is tracked.
    Passthrough,
}

/// The socket as hyper sees it (see the module documentation).
pub struct ConnIo {
    stream: Arc<TcpStream>,
    ctx: Arc<ConnCtx>,
    limits: IoLimits,
    counters: Arc<ProxyCounters>,
    phase: Phase,
    read_timer: Pin<Box<Sleep>>,
    read_deadline: Option<Instant>,
    /// How much of hyper's read buffer the next read offers the socket (see
    /// [`READ_SPAN`]).
    read_span: usize,
    write_timer: Pin<Box<Sleep>>,
    write_blocked: bool,
    /// Our own answer being written (a replaced hyper error, a 408, a 431).
    out: Bytes,
    /// After `out`: fail the reads (the connection ends).
    ending: Option<io::ErrorKind>,
    /// After our own answer: our side is shut down, and what the client still sends is
    /// read and dropped (briefly), so that closing does not reset the connection before
    /// the client read the answer.
    linger: Option<(Instant, usize)>,
}

/// The bytes a read first offers the socket. hyper hands over its whole spare buffer,
/// uninitialized, and a safe read must zero what it offers: all of it cost more than
/// the rest of reading a request (8 000 instructions per plain call, issue 42). So a
/// read offers twice what the last short read on the connection brought (a client
/// sends requests of a like size), at least this; a read that fills its span doubles
/// the next one, so a large body is still read in large reads.
const READ_SPAN: usize = 1024;

/// The next read's span after a read of `n` bytes into an offer of `offered`.
fn next_read_span(span: usize, n: usize, offered: usize) -> usize {
    if n == offered {
        span.saturating_mul(2)
    } else {
        n.saturating_mul(2).next_power_of_two().max(READ_SPAN)
    }
}

/// How long, and how much, a connection closed by a limit keeps reading.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1024 * 1024;

impl std::fmt::Debug for ConnIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnIo")
            .field("peer", &self.ctx.peer)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

/// An error answer written by the connection itself, with `connection: close`.
pub fn raw_error_response(e: &ApiError) -> Bytes {
    let body = e.body().to_string();
    let reason = e.status.canonical_reason().unwrap_or("Error");
    let id = polygw::CallOptions::new_logical_call_id();
    let retry = e
        .retry_after
        .map_or(String::new(), |s| format!("retry-after: {s}\r\n"));
    Bytes::from(format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nx-request-id: {id}\r\n{retry}\r\n{body}",
        e.status.as_u16(),
        body.len()
    ))
}

/// The OpenAI error that replaces an empty error answer of the given status.
pub fn status_error(status: axum::http::StatusCode, max_header_bytes: usize) -> ApiError {
    use axum::http::StatusCode as S;
    let (code, message) = match status {
        S::BAD_REQUEST => (
            "bad_request",
            "the request could not be parsed (malformed request line or header)".to_string(),
        ),
        S::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            "request_header_fields_too_large",
            format!(
                "the request head is over {max_header_bytes} bytes or has too many header fields"
            ),
        ),
        S::URI_TOO_LONG => ("uri_too_long", "the request target is too long".to_string()),
        S::REQUEST_TIMEOUT => (
            "request_timeout",
            "the request did not arrive in time".to_string(),
        ),
        S::METHOD_NOT_ALLOWED => (
            "method_not_allowed",
            "this route does not accept that method".to_string(),
        ),
        S::NOT_FOUND => ("not_found", "no such route".to_string()),
        S::PAYLOAD_TOO_LARGE => (
            "request_too_large",
            "the request body is too large".to_string(),
        ),
        S::HTTP_VERSION_NOT_SUPPORTED => (
            "http_version_not_supported",
            "polygw serve speaks HTTP/1.1 (HTTP/2 is not served)".to_string(),
        ),
        s => ("http_error", format!("HTTP {}", s.as_u16())),
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    ApiError::new(status, kind, code, message)
}

impl ConnIo {
    /// Wraps an accepted socket; returns it with the context the handlers get.
    pub fn new(
        stream: TcpStream,
        peer: SocketAddr,
        limits: IoLimits,
        counters: Arc<ProxyCounters>,
    ) -> (ConnIo, Arc<ConnCtx>) {
        let stream = Arc::new(stream);
        let ctx = Arc::new(ConnCtx::new(peer, stream.clone()));
        let now = Instant::now();
        let io = ConnIo {
            stream,
            ctx: ctx.clone(),
            limits,
            counters,
            phase: Phase::Idle {
                since: now,
                first: true,
            },
            read_timer: Box::pin(tokio::time::sleep_until(now)),
            read_deadline: None,
            read_span: READ_SPAN,
            write_timer: Box::pin(tokio::time::sleep_until(now)),
            write_blocked: false,
            out: Bytes::new(),
            ending: None,
            linger: None,
        };
        (io, ctx)
    }

    /// Brings the phase up to date with the requests hyper handed over.
    fn sync_phase(&mut self) {
        if self.ctx.closing.load(Ordering::Acquire) {
            self.phase = Phase::Passthrough;
            return;
        }
        let started = self.ctx.started.load(Ordering::Acquire);
        let busy = self.ctx.in_flight.load(Ordering::Acquire) > 0;
        let now = Instant::now();
        self.phase = match self.phase {
            Phase::Head { base, .. } if started > base => {
                if busy {
                    Phase::Request
                } else {
                    Phase::Idle {
                        since: now,
                        first: false,
                    }
                }
            }
            Phase::Request if !busy => Phase::Idle {
                since: now,
                first: false,
            },
            Phase::Idle { .. } if busy => Phase::Request,
            p => p,
        };
    }

    /// Accounts for bytes read; `Err` is the status to answer with.
    fn on_bytes(&mut self, bytes: &[u8]) -> Result<(), axum::http::StatusCode> {
        if let Phase::Idle { .. } = self.phase {
            self.phase = Phase::Head {
                base: self.ctx.started.load(Ordering::Acquire),
                since: Instant::now(),
                len: 0,
                newlines: 0,
                text: false,
                complete: false,
            };
        }
        let max = self.limits.max_header_bytes;
        if let Phase::Head {
            len,
            newlines,
            text,
            complete,
            ..
        } = &mut self.phase
        {
            if *complete {
                return Ok(());
            }
            for &b in bytes {
                *len += 1;
                match b {
                    b'\n' if *text => {
                        *newlines += 1;
                        if *newlines == 2 {
                            *complete = true;
                            break;
                        }
                    }
                    b'\r' | b'\n' => {}
                    _ => {
                        *text = true;
                        *newlines = 0;
                    }
                }
                if *len > max {
                    return Err(axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
                }
            }
        }
        Ok(())
    }

    /// The read-side deadline of the current phase.
    fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Idle { since, first: true } => Some(since + self.limits.header_timeout),
            Phase::Idle {
                since,
                first: false,
            } => Some(since + self.limits.idle_timeout),
            Phase::Head {
                since,
                complete: false,
                ..
            } => Some(since + self.limits.header_timeout),
            _ => None,
        }
    }

    /// Starts writing our own answer, after which the connection ends.
    fn end_with(&mut self, e: &ApiError, reason: &'static str) {
        self.counters.closed(reason);
        self.out = raw_error_response(e);
        self.ending = Some(io::ErrorKind::TimedOut);
        tracing::debug!(peer = %self.ctx.peer, reason, "closing a connection");
    }

    /// Ends the connection after our own answer: write it, shut our side down, read and
    /// drop what the client still sends (up to [`LINGER`] / [`LINGER_BYTES`]), then fail
    /// the read so that hyper closes.
    fn poll_end(&mut self, cx: &mut Context<'_>, kind: io::ErrorKind) -> Poll<io::Result<()>> {
        let done = || Poll::Ready(Err(io::Error::new(kind, "connection closed by a limit")));
        match self.poll_out(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(_)) => return done(),
            Poll::Ready(Ok(())) => {}
        }
        if self.linger.is_none() {
            let _ = socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Write);
            let until = Instant::now() + LINGER;
            self.linger = Some((until, 0));
            self.read_timer.as_mut().reset(until);
        }
        let mut scratch = [0u8; 8192];
        loop {
            let Some((_, dropped)) = self.linger.as_mut() else {
                return done();
            };
            if *dropped > LINGER_BYTES {
                return done();
            }
            match self.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) => return done(),
                Poll::Pending => break,
            }
            match self.stream.try_read(&mut scratch) {
                Ok(0) => return done(),
                Ok(n) => *dropped += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return done(),
            }
        }
        match self.read_timer.as_mut().poll(cx) {
            Poll::Ready(()) => done(),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Writes what is left of `out`.
    fn poll_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.out.is_empty() {
            match self.poll_inner_write(cx, None) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    let _ = self.out.split_to(n);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// One write to the socket (`buf`, or else the head of `out`), with the
    /// blocked-write timer.
    fn poll_inner_write(
        &mut self,
        cx: &mut Context<'_>,
        buf: Option<&[io::IoSlice<'_>]>,
    ) -> Poll<io::Result<usize>> {
        loop {
            match self.stream.poll_write_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return self.write_blocked(cx),
            }
            let r = match buf {
                Some(slices) => self.stream.try_write_vectored(slices),
                None => self.stream.try_write(&self.out),
            };
            match r {
                Ok(n) => {
                    self.write_blocked = false;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// The socket cannot take more: the client is not reading. Past `idle_timeout`
    /// the connection ends.
    fn write_blocked<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if !self.write_blocked {
            self.write_blocked = true;
            let at = Instant::now() + self.limits.idle_timeout;
            self.write_timer.as_mut().reset(at);
        }
        match self.write_timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.counters.closed("write_stalled");
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not read its answer",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Whether hyper is writing its own error answer: a response while a head is
    /// being read and before the router got the request.
    fn hyper_error_status(&self, first: &[u8]) -> Option<axum::http::StatusCode> {
        let Phase::Head { base, .. } = self.phase else {
            return None;
        };
        if self.ctx.started.load(Ordering::Acquire) != base {
            return None;
        }
        let rest = first.strip_prefix(b"HTTP/1.1 ")?;
        let code = std::str::from_utf8(rest.get(..3)?)
            .ok()?
            .parse::<u16>()
            .ok()?;
        axum::http::StatusCode::from_u16(code)
            .ok()
            .filter(|s| s.is_client_error() || s.is_server_error())
    }

    fn write_impl(
        &mut self,
        cx: &mut Context<'_>,
        slices: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if !self.out.is_empty() {
            match self.poll_out(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        let total: usize = slices.iter().map(|s| s.len()).sum();
        let first = slices
            .iter()
            .find(|s| !s.is_empty())
            .map_or(&[][..], |s| &s[..]);
        self.sync_phase();
        if let Some(status) = self.hyper_error_status(first) {
            // Same status, with a body. hyper closes the connection after it.
            self.counters.refused(match status.as_u16() {
                431 => "header_too_large",
                414 => "uri_too_long",
                _ => "malformed_request",
            });
            let e = status_error(status, self.limits.max_header_bytes);
            self.out = raw_error_response(&e);
            let _ = self.poll_out(cx)?;
            return Poll::Ready(Ok(total));
        }
        self.poll_inner_write(cx, Some(slices))
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(kind) = this.ending {
            return this.poll_end(cx, kind);
        }
        this.sync_phase();
        let before = buf.filled().len();
        loop {
            match this.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
            let span = buf.remaining().min(this.read_span);
            let unfilled = buf.initialize_unfilled_to(span);
            let offered = unfilled.len();
            // The read runs inside `try_io`, which takes the socket's readiness before
            // it: a read that did not fill the buffer drained the socket (epoll is
            // edge-triggered; tokio's own reads assume the same), so that readiness is
            // forgotten (`WouldBlock`), and the end-of-client watch
            // ([`ConnCtx::closed`]) waits for the next event instead of peeking with a
            // system call that finds nothing (issue 27). Only that readiness: bytes
            // that arrive after the read raise a newer one, which stays. (Clearing a
            // readiness taken after the read lost the event of a body that came right
            // after its head — a request then waited for `--body-timeout-s`.) A close
            // the driver has seen stays visible.
            let stream = &this.stream;
            let mut got = None;
            let read = stream.try_io(tokio::io::Interest::READABLE, || {
                let n = stream.try_read(unfilled)?;
                got = Some(n);
                if n > 0 && n < offered {
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Ok(n)
                }
            });
            let n = match (read, got) {
                (Ok(n), _) => n,
                (Err(e), Some(n)) if e.kind() == io::ErrorKind::WouldBlock => n,
                (Err(e), _) if e.kind() == io::ErrorKind::WouldBlock => continue,
                (Err(e), _) => return Poll::Ready(Err(e)),
            };
            match n {
                0 => {
                    this.ctx.mark_eof();
                    return Poll::Ready(Ok(()));
                }
                n => {
                    this.read_span = next_read_span(this.read_span, n, offered);
                    buf.advance(n);
                    if let Err(status) = this.on_bytes(&buf.filled()[before..]) {
                        // Not handed to hyper: the answer is ours.
                        buf.set_filled(before);
                        let e = status_error(status, this.limits.max_header_bytes);
                        this.end_with(&e, "header_too_large");
                        this.counters.refused("header_too_large");
                        return this.poll_end(cx, io::ErrorKind::InvalidData);
                    }
                    return Poll::Ready(Ok(()));
                }
            }
        }
        // Nothing to read: the phase's timer.
        let deadline = this.deadline();
        if deadline != this.read_deadline {
            this.read_deadline = deadline;
            if let Some(at) = deadline {
                this.read_timer.as_mut().reset(at);
            }
        }
        if deadline.is_some() && this.read_timer.as_mut().poll(cx).is_ready() {
            this.read_deadline = None;
            match this.phase {
                Phase::Idle { first: false, .. } => {
                    // A kept-alive connection idle too long: end it quietly.
                    this.counters.closed("idle");
                    this.ctx.mark_eof();
                    return Poll::Ready(Ok(()));
                }
                _ => {
                    let e = status_error(
                        axum::http::StatusCode::REQUEST_TIMEOUT,
                        this.limits.max_header_bytes,
                    );
                    let e = ApiError {
                        message: format!(
                            "the request head did not arrive within {} s",
                            this.limits.header_timeout.as_secs_f64()
                        ),
                        ..e
                    };
                    this.end_with(&e, "header_timeout");
                    return this.poll_end(cx, io::ErrorKind::TimedOut);
                }
            }
        }
        Poll::Pending
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write_impl(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write_impl(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_out(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.poll_out(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let _ = socket2::SockRef::from(&*this.stream).shutdown(std::net::Shutdown::Write);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod read_span_tests {
    use super::*;

    #[test]
    fn a_span_follows_the_reads() {
        // A short read: twice its size, at least the floor.
        assert_eq!(next_read_span(READ_SPAN, 300, 1024), READ_SPAN);
        assert_eq!(next_read_span(READ_SPAN, 900, 1024), 2048);
        // A full read: the next offers twice as much.
        assert_eq!(next_read_span(2048, 2048, 2048), 4096);
        // Then a small request again: back down.
        assert_eq!(next_read_span(4096, 10, 4096), READ_SPAN);
    }
}
