//! [`ChatStream`]: a streamed chat call as a `futures::Stream` (SPEC §13,
//! `GatewayClient::chat_stream`). The call's future is polled by the stream itself —
//! no task, no channel: the round forwards each chunk into a small queue that the
//! stream drains in the same poll. Passthrough semantics: the first leg to deliver
//! text is committed; a failure or a stall after that point is resumed on another
//! attempt when the scope allows it, and the stream stays one uninterrupted answer.
//! Dropping the stream cancels the call (every leg, rows `cancelled`).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures_util::Stream;
use polygw_core::ports::StreamDelta;
use polygw_core::{GatewayError, LlmResponse};

use crate::engine::round::{Commit, DeltaSink};

/// One event of a [`ChatStream`].
#[derive(Debug, Clone, PartialEq)]
pub enum ChatEvent {
    /// A leg was committed. The first one (`commit.first`) names the source the
    /// stream starts from; later ones are resume legs taking over.
    Committed(Commit),
    /// The next chunk of the answer (role once; text never repeated or lost across
    /// resumes). The upstream's frame, when the transport had one, is in `delta.raw` (an
    /// object) or, for a common frame read on the fast path, `delta.raw_text` (its JSON
    /// text, to pass through as is); `delta.raw_object()` reads either.
    Delta(StreamDelta),
    /// The call completed: the whole answer, usage summed over the legs whose text it
    /// contains, and the call's figures.
    Done(Box<LlmResponse>),
}

type CallFuture = Pin<Box<dyn Future<Output = Result<LlmResponse, GatewayError>> + Send>>;

/// The sink the round forwards into: a queue the stream drains, and the number of
/// attempts running.
#[derive(Default)]
pub(crate) struct QueueSink(Mutex<VecDeque<ChatEvent>>, AtomicUsize);

impl QueueSink {
    fn pop(&self) -> Option<ChatEvent> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    }
}

impl DeltaSink for QueueSink {
    fn committed(&self, commit: &Commit) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(ChatEvent::Committed(commit.clone()));
    }

    fn send(&self, delta: StreamDelta) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(ChatEvent::Delta(delta));
    }

    fn attempts_running(&self, n: usize) {
        self.1.store(n, Ordering::Relaxed);
    }
}

/// A streamed chat call. Items: [`ChatEvent`]s, then either [`ChatEvent::Done`] or one
/// `Err(GatewayError)` (the call failed: before any chunk, or after one when nothing
/// could resume it), then the end of the stream.
#[must_use = "a stream does nothing unless polled"]
pub struct ChatStream {
    call: Option<CallFuture>,
    queue: Arc<QueueSink>,
    outcome: Option<Result<LlmResponse, GatewayError>>,
    finished: bool,
}

impl std::fmt::Debug for ChatStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatStream")
            .field("running", &self.call.is_some())
            .field("finished", &self.finished)
            .finish()
    }
}

impl ChatStream {
    pub(crate) fn new(make: impl FnOnce(Arc<dyn DeltaSink>) -> CallFuture) -> ChatStream {
        let queue = Arc::new(QueueSink::default());
        let call = make(queue.clone());
        ChatStream {
            call: Some(call),
            queue,
            outcome: None,
            finished: false,
        }
    }

    /// How many of the call's attempts are running now: 0 while it waits for admission,
    /// backs off between rounds, or before it started (a proxy keeps a client's
    /// connection alive only while an attempt actually runs, SPEC §17.2).
    pub fn attempts_running(&self) -> usize {
        self.queue.1.load(Ordering::Relaxed)
    }

    /// Drains every event already available without waiting (a proxy writes them in
    /// one go). `None` when nothing is ready.
    pub fn poll_ready_batch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Option<Vec<Result<ChatEvent, GatewayError>>>> {
        let this = self.get_mut();
        let mut out = Vec::new();
        while out.len() < max.max(1) {
            match Pin::new(&mut *this).poll_next(cx) {
                Poll::Ready(Some(item)) => out.push(item),
                Poll::Ready(None) => {
                    return Poll::Ready(if out.is_empty() { None } else { Some(out) });
                }
                Poll::Pending => break,
            }
        }
        if out.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(Some(out))
        }
    }
}

impl Stream for ChatStream {
    type Item = Result<ChatEvent, GatewayError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(e) = this.queue.pop() {
                return Poll::Ready(Some(Ok(e)));
            }
            if let Some(outcome) = this.outcome.take() {
                this.finished = true;
                return Poll::Ready(Some(outcome.map(|r| ChatEvent::Done(Box::new(r)))));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            let Some(call) = this.call.as_mut() else {
                this.finished = true;
                return Poll::Ready(None);
            };
            match call.as_mut().poll(cx) {
                Poll::Ready(r) => {
                    this.call = None;
                    // Events queued by the last poll come before the outcome.
                    this.outcome = Some(r);
                }
                Poll::Pending => {
                    if let Some(e) = this.queue.pop() {
                        return Poll::Ready(Some(Ok(e)));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}
