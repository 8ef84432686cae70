//! Playing one behavior: the frames of a stream or the body of a plain answer, on a
//! schedule, with keepalives, faults and the request log kept up to date.
//!
//! The player is a future polled by the response body itself ([`PlayerBody`]), so no
//! task is spawned per response: when hyper drops the body (the client left, the
//! connection was aborted, the server shut down) the player is dropped with it and its
//! [`Guard`] records how the response ended.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame};
use polygw_core::Usage;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::behavior::{Behavior, Fault, ReasoningField, UsageMode};
use crate::cache::{CacheDialect, CacheUse};
use crate::record::{EndKind, Guard};
use crate::responses_wire::ResponsesWriter;

type PlayerFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A response body driven by a player future.
pub(crate) struct PlayerBody {
    rx: mpsc::Receiver<Bytes>,
    player: Option<PlayerFuture>,
}

impl PlayerBody {
    /// A body whose bytes the future sends through `tx`.
    pub(crate) fn new<F, Fut>(make: F) -> Self
    where
        F: FnOnce(Out) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(1);
        PlayerBody {
            rx,
            player: Some(Box::pin(make(Out { tx }))),
        }
    }
}

impl Body for PlayerBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        loop {
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(b)) => return Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => {}
            }
            match this.player.as_mut() {
                Some(p) => match p.as_mut().poll(cx) {
                    // The sender is dropped with the player: drain, then end.
                    Poll::Ready(()) => this.player = None,
                    Poll::Pending => return Poll::Pending,
                },
                None => return Poll::Pending,
            }
        }
    }
}

/// The player's end of the body.
pub(crate) struct Out {
    tx: mpsc::Sender<Bytes>,
}

impl Out {
    async fn send(&self, b: impl Into<Bytes>) {
        // The receiver lives in the body that polls us: it cannot be gone while we run.
        let _ = self.tx.send(b.into()).await;
    }

    /// Waits until the body has handed every byte to hyper.
    async fn drained(&self) {
        while self.tx.capacity() < self.tx.max_capacity() {
            tokio::task::yield_now().await;
        }
    }
}

/// The API a request came in (and is answered in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireApi {
    /// OpenAI's chat completions.
    Chat,
    /// Anthropic's Messages.
    Messages,
    /// OpenAI's Responses.
    Responses,
}

/// What the player needs besides the behavior.
pub(crate) struct Ctx {
    /// The API to answer in.
    pub(crate) api: WireApi,
    pub(crate) guard: Guard,
    pub(crate) kill: Arc<Notify>,
    pub(crate) model: String,
    pub(crate) prompt_tokens: u64,
    /// The seed of generated words ([`crate::text::request_seed`]).
    pub(crate) seed: u64,
    pub(crate) created: u64,
    pub(crate) image_summary: Option<String>,
    /// A prefill prefix to continue from (an honoured prefill request).
    pub(crate) prefill: Option<String>,
    /// The request's output cap (`max_tokens`, `max_completion_tokens`, `max_output_tokens`).
    pub(crate) max_tokens: Option<u64>,
    /// What the prefix cache read and wrote for the request, when one is on.
    pub(crate) cache: Option<CacheUse>,
}

/// One incremental item of an answer.
#[derive(Debug, Clone)]
pub(crate) enum Item {
    Reasoning(String),
    Content(String),
    Tool { first: bool, args: String },
}

/// The planned answer of a behavior.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) items: Vec<Item>,
    pub(crate) finish_reason: String,
    pub(crate) usage: Usage,
    /// For a continued prefill: whether the planned content started with the prefix.
    pub(crate) prefill_matched: Option<bool>,
    /// The dialect usage reports the prefix cache in (when one is on).
    pub(crate) cache_dialect: Option<CacheDialect>,
}

/// Extends generated content (`chunk_count` words) with the next words of the request's
/// word stream while they keep matching `prefix`, until the content covers it: a
/// prefix delivered by a longer draw of the same request is continued, not mismatched.
/// Leaves `content` as planned when the word stream departs from the prefix.
fn extend_generated(content: &mut Vec<String>, seed: u64, prefix: &str) {
    let p = prefix.as_bytes();
    let mut len: usize = content.iter().map(String::len).sum();
    if len >= p.len() || !p.starts_with(content.concat().as_bytes()) {
        return;
    }
    let mut extra = Vec::new();
    let mut i = content.len() as u32;
    while len < p.len() {
        let w = crate::text::word(seed, i);
        let end = (len + w.len()).min(p.len());
        if p[len..end] != w.as_bytes()[..end - len] {
            return;
        }
        len += w.len();
        i = i.saturating_add(1);
        extra.push(w);
    }
    content.extend(extra);
}

impl Plan {
    pub(crate) fn new(b: &Behavior, ctx: &Ctx) -> Plan {
        let mut reasoning: Vec<String> = b.reasoning.clone();
        let mut content: Vec<String> = Vec::new();
        if !b.chunks.is_empty() {
            content.clone_from(&b.chunks);
        } else if let Some(n) = b.chunk_count {
            content.extend((0..n).map(|i| crate::text::word(ctx.seed, i)));
        } else if b.reasoning.is_empty() && b.tool_call.is_none() {
            match &ctx.image_summary {
                Some(s) => content.push(s.clone()),
                None => content.extend(
                    ["Hello", " from", " the", " polygw", " mock."]
                        .iter()
                        .map(|s| s.to_string()),
                ),
            }
        }
        let mut prefill_matched = None;
        if let Some(prefix) = &ctx.prefill {
            if b.chunks.is_empty() && b.chunk_count.is_some() {
                extend_generated(&mut content, ctx.seed, prefix);
            }
            let matched = match crate::prefill::continue_from(&content, prefix) {
                Some(rest) => {
                    content = rest;
                    true
                }
                // A different answer: sent whole, as the continuation.
                None => false,
            };
            // The reasoning came before the delivered content: not thought again.
            if !prefix.is_empty() {
                reasoning.clear();
            }
            prefill_matched = Some(matched);
        }
        let mut items: Vec<Item> = reasoning.into_iter().map(Item::Reasoning).collect();
        items.extend(content.into_iter().map(Item::Content));
        if let Some(t) = &b.tool_call {
            let n = t.fragments.max(1) as usize;
            let chars: Vec<char> = t.arguments.chars().collect();
            let per = chars.len().div_ceil(n).max(1);
            let mut pieces: Vec<String> = chars.chunks(per).map(|c| c.iter().collect()).collect();
            while pieces.len() < n {
                pieces.push(String::new());
            }
            for (i, p) in pieces.into_iter().enumerate() {
                items.push(Item::Tool {
                    first: i == 0,
                    args: p,
                });
            }
        }
        let mut finish_reason = b.finish_reason.clone().unwrap_or_else(|| {
            if b.tool_call.is_some() {
                "tool_calls".into()
            } else {
                "stop".into()
            }
        });
        if let Some(max) = ctx.max_tokens {
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            if items.len() > max {
                items.truncate(max);
                finish_reason = "length".into();
            }
        }
        let reasoning_n = items
            .iter()
            .filter(|i| matches!(i, Item::Reasoning(_)))
            .count() as u64;
        let prompt_tokens = b.prompt_tokens.unwrap_or(ctx.prompt_tokens);
        let cache = ctx.cache.map(|c| c.clamped(prompt_tokens));
        // A behavior's own `completion_tokens` may exceed its chunks (hidden reasoning, as
        // a reasoning model bills); like a provider, the mock stops at the request's cap.
        let completion = b.completion_tokens.unwrap_or(items.len() as u64);
        let completion = ctx.max_tokens.map_or(completion, |m| completion.min(m));
        let mut usage = Usage {
            prompt_tokens,
            completion_tokens: completion,
            reasoning_tokens: (reasoning_n > 0).then_some(reasoning_n),
            ..Usage::default()
        };
        usage.cached_prompt_tokens = cache.map(|c| c.cached);
        usage.cache_write_tokens = cache.and_then(|c| c.reported_write());
        Plan {
            items,
            finish_reason,
            usage,
            prefill_matched,
            cache_dialect: cache.map(|c| c.dialect),
        }
    }

    /// The tool-call arguments of the plan, if it has any tool fragment.
    fn tool_arguments(&self) -> Option<String> {
        let mut out: Option<String> = None;
        for i in &self.items {
            if let Item::Tool { args, .. } = i {
                out.get_or_insert_with(String::new).push_str(args);
            }
        }
        out
    }

    pub(crate) fn full_content(&self) -> String {
        self.items
            .iter()
            .filter_map(|i| match i {
                Item::Content(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    fn reasoning(&self) -> String {
        self.items
            .iter()
            .filter_map(|i| match i {
                Item::Reasoning(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// The usage object of a plan: OpenAI's fields, and the prefix cache's in its dialect
/// (cached and written tokens are part of `prompt_tokens` in every dialect).
pub(crate) fn usage_json(u: &Usage, dialect: Option<CacheDialect>) -> Value {
    let mut o = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if let Some(r) = u.reasoning_tokens {
        o["completion_tokens_details"] = json!({ "reasoning_tokens": r });
    }
    let cached = u.cached_prompt_tokens.unwrap_or(0);
    match dialect {
        None => {}
        Some(CacheDialect::Openai) => {
            o["prompt_tokens_details"] = json!({ "cached_tokens": cached });
        }
        Some(CacheDialect::Deepseek) => {
            o["prompt_cache_hit_tokens"] = json!(cached);
            o["prompt_cache_miss_tokens"] = json!(u.prompt_tokens.saturating_sub(cached));
            o["prompt_tokens_details"] = json!({ "cached_tokens": cached });
        }
        Some(CacheDialect::Anthropic) => {
            o["cache_read_input_tokens"] = json!(cached);
            o["cache_creation_input_tokens"] = json!(u.cache_write_tokens.unwrap_or(0));
        }
    }
    o
}

/// The default in-band error object (Anthropic's `overloaded_error` for Messages).
pub(crate) fn default_error_object(api: WireApi) -> Value {
    match api {
        WireApi::Chat => json!({"error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "code": "server_error"
        }}),
        WireApi::Messages => json!({"type": "error", "error": {
            "type": "overloaded_error",
            "message": "Overloaded"
        }}),
        WireApi::Responses => json!({"code": "server_error",
            "message": "The server had an error while processing your request."}),
    }
}

/// Anthropic's usage object of a plan: `input_tokens` excludes the cache's reads and
/// writes (SPEC §23.4).
pub(crate) fn messages_usage_json(u: &Usage, output_tokens: u64) -> Value {
    let read = u.cached_prompt_tokens.unwrap_or(0);
    let write = u.cache_write_tokens.unwrap_or(0);
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(read + write),
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": write,
        "output_tokens": output_tokens,
    })
}

/// Anthropic's `stop_reason` for a plan's finish reason.
fn stop_reason(finish: &str) -> &str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        "content_filter" => "refusal",
        _ => "end_turn",
    }
}

/// The plain Responses answer (`response`) of a plan.
pub(crate) fn response_json(b: &Behavior, ctx: &Ctx, plan: &Plan) -> Value {
    let mut w = ResponsesWriter::new(ctx.guard.id, &ctx.model, ctx.created, b.tool_call.clone())
        .signed_by(b.signing_group.as_deref());
    for item in &plan.items {
        w.item(item);
    }
    let usage = (b.usage != UsageMode::None).then_some(&plan.usage);
    w.final_response(&plan.finish_reason, usage)
}

/// The signature of a thinking block of `text` this answer sends
/// (`Behavior::signing_group`).
fn signature(b: &Behavior, text: &str) -> String {
    b.signing_group.as_ref().map_or_else(
        || "mock-signature".to_string(),
        |g| crate::signing::thinking_signature(g, text),
    )
}

/// The plain Messages answer (`message`) of a plan.
pub(crate) fn message_json(b: &Behavior, ctx: &Ctx, plan: &Plan) -> Value {
    let mut content = Vec::new();
    let reasoning = plan.reasoning();
    if !reasoning.is_empty() {
        let sig = signature(b, &reasoning);
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": sig}));
    }
    let text = plan.full_content();
    if !text.is_empty() || b.tool_call.is_none() {
        content.push(json!({"type": "text", "text": text}));
    }
    if let (Some(t), Some(args)) = (&b.tool_call, plan.tool_arguments()) {
        let input = serde_json::from_str::<Value>(&args).unwrap_or_else(|_| json!({}));
        content.push(json!({"type": "tool_use", "id": t.id, "name": t.name, "input": input}));
    }
    let mut v = json!({
        "id": format!("msg_mock-{}", ctx.guard.id),
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        "stop_reason": stop_reason(&plan.finish_reason),
        "stop_sequence": null,
    });
    if b.usage != UsageMode::None {
        v["usage"] = messages_usage_json(&plan.usage, plan.usage.completion_tokens);
    }
    v
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

struct Stream<'a> {
    b: &'a Behavior,
    ctx: Ctx,
    out: &'a Out,
    last_write: Instant,
    /// Messages: the open content block (its index and kind), and the next index.
    block: Option<(u32, BlockKind)>,
    next_block: u32,
    /// Messages: the open thinking block's text as the client receives it (what its
    /// signature covers).
    thinking: String,
    /// Responses: the events' writer.
    responses: Option<ResponsesWriter>,
}

/// The kind of a Messages content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    Tool,
}

impl Stream<'_> {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": format!("chatcmpl-mock-{}", self.ctx.guard.id),
            "object": "chat.completion.chunk",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }

    async fn write(&mut self, b: Bytes) {
        self.out.send(b).await;
        self.last_write = Instant::now();
    }

    async fn frame(&mut self, v: &Value) {
        self.write(sse(v)).await;
        self.ctx.guard.frames_sent += 1;
    }

    /// The faults after the stop (its usage sent, the terminal event not yet): a reset,
    /// or silence until the client leaves. Neither returns.
    async fn after_finish_faults(&mut self) {
        if self.b.fault == Some(Fault::ResetAfterFinish) {
            self.reset(EndKind::ResetMidStream).await;
        }
        if self.b.fault == Some(Fault::HangAfterFinish) {
            self.out.drained().await;
            self.hang().await;
        }
    }

    /// Responses events.
    async fn responses_events(&mut self, evs: Vec<Value>) {
        for v in evs {
            self.write(Bytes::from(crate::responses_wire::sse(&v)))
                .await;
            self.ctx.guard.frames_sent += 1;
        }
    }

    /// A named event (Messages): `event: <type>` and the object as its data.
    async fn event(&mut self, v: &Value) {
        let name = v.get("type").and_then(Value::as_str).unwrap_or("message");
        let b = format!("event: {name}\ndata: {v}\n\n");
        self.write(Bytes::from(b)).await;
        self.ctx.guard.frames_sent += 1;
    }

    /// Closes the open Messages block (a thinking block gets its signature first).
    async fn close_block(&mut self) {
        if let Some((index, kind)) = self.block.take() {
            if kind == BlockKind::Thinking {
                let v = json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": signature(self.b, &self.thinking)}});
                self.thinking.clear();
                self.event(&v).await;
            }
            self.event(&json!({"type": "content_block_stop", "index": index}))
                .await;
        }
    }

    /// The Messages events of one item: a new block when the kind changes, then its
    /// delta.
    async fn messages_item(&mut self, item: &Item) {
        let kind = match item {
            Item::Reasoning(_) => BlockKind::Thinking,
            Item::Content(_) => BlockKind::Text,
            Item::Tool { .. } => BlockKind::Tool,
        };
        let new_tool = matches!(item, Item::Tool { first: true, .. });
        if self.block.map(|(_, k)| k) != Some(kind) || new_tool {
            self.close_block().await;
            let index = self.next_block;
            self.next_block += 1;
            let start = match kind {
                BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                BlockKind::Text => json!({"type": "text", "text": ""}),
                BlockKind::Tool => {
                    let t = self.b.tool_call.clone().unwrap_or_default();
                    json!({"type": "tool_use", "id": t.id, "name": t.name, "input": {}})
                }
            };
            let v = json!({"type": "content_block_start", "index": index, "content_block": start});
            self.event(&v).await;
            self.block = Some((index, kind));
        }
        let index = self.block.map_or(0, |(i, _)| i);
        if kind == BlockKind::Thinking && self.b.thinking_omitted {
            return;
        }
        if let Item::Reasoning(t) = item {
            self.thinking.push_str(t);
        }
        let delta = match item {
            Item::Reasoning(s) => json!({"type": "thinking_delta", "thinking": s}),
            Item::Content(s) => json!({"type": "text_delta", "text": s}),
            Item::Tool { args, .. } => json!({"type": "input_json_delta", "partial_json": args}),
        };
        self.event(&json!({"type": "content_block_delta", "index": index, "delta": delta}))
            .await;
    }

    /// The end of a Messages stream: the open block closed, `message_delta` with the
    /// stop reason (and usage, unless the behavior has none), `message_stop`.
    async fn messages_finish(&mut self, plan: &Plan) {
        self.close_block().await;
        let mut v = json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(&plan.finish_reason), "stop_sequence": null}});
        if self.b.usage != UsageMode::None {
            v["usage"] = messages_usage_json(&plan.usage, plan.usage.completion_tokens);
        }
        self.event(&v).await;
    }

    /// Silence until `at`, with keepalive comments when configured.
    async fn wait_until(&mut self, at: Instant) {
        if let Some(k) = self.b.keepalive_ms.filter(|k| *k > 0.0) {
            let every = Duration::from_secs_f64(k / 1000.0);
            loop {
                let next = self.last_write + every;
                if next >= at {
                    break;
                }
                tokio::time::sleep_until(next).await;
                let k: &'static [u8] = match self.ctx.api {
                    WireApi::Chat | WireApi::Responses => b": keepalive\n\n",
                    WireApi::Messages => b"event: ping\ndata: {\"type\": \"ping\"}\n\n",
                };
                self.write(Bytes::from_static(k)).await;
                self.ctx.guard.keepalives_sent += 1;
            }
        }
        tokio::time::sleep_until(at).await;
    }

    /// Silence forever (keepalives aside): until the client leaves.
    async fn hang(&mut self) {
        loop {
            let far = Instant::now() + Duration::from_secs(3600);
            self.wait_until(far).await;
        }
    }

    /// Aborts the connection (RST) after letting hyper flush what was sent.
    async fn reset(&mut self, end: EndKind) {
        self.out.drained().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
        self.ctx.guard.finish(end);
        self.ctx.kill.notify_one();
        std::future::pending::<()>().await;
    }

    fn finish_frame(&self, plan: &Plan) -> Value {
        let mut v = self.chunk(json!({}), Some(&plan.finish_reason));
        match self.b.usage {
            UsageMode::Inline => v["usage"] = usage_json(&plan.usage, plan.cache_dialect),
            UsageMode::Choice => {
                v["choices"][0]["usage"] = usage_json(&plan.usage, plan.cache_dialect)
            }
            UsageMode::FinalFrame | UsageMode::None => {}
        }
        v
    }

    async fn play(mut self) {
        let plan = Plan::new(self.b, &self.ctx);
        let start = Instant::now();
        let messages = self.ctx.api == WireApi::Messages;
        if let Some(w) = self.responses.as_mut() {
            let evs = w.start();
            self.responses_events(evs).await;
        } else if messages {
            let mut usage = messages_usage_json(&plan.usage, 1);
            if self.b.usage == UsageMode::None {
                usage = Value::Null;
            }
            let v = json!({"type": "message_start", "message": {
                "id": format!("msg_mock-{}", self.ctx.guard.id), "type": "message",
                "role": "assistant", "model": self.ctx.model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": usage}});
            self.event(&v).await;
            self.event(&json!({"type": "ping"})).await;
        } else if self.b.role_chunk {
            let v = self.chunk(json!({"role": "assistant", "content": ""}), None);
            self.frame(&v).await;
        }
        let n = plan.items.len();
        let mut at = start;
        let ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1000.0);
        at += ms(self.b.ttft_ms);
        for i in 0..=n {
            // Faults at chunk i (i == n: after every incremental chunk, before finish).
            let fault_here = |c: u32| c as usize == i || (i == n && c as usize >= n);
            match &self.b.fault {
                Some(Fault::ResetAfter { chunks }) if fault_here(*chunks) => {
                    return self.reset(EndKind::ResetMidStream).await;
                }
                Some(Fault::TruncateAfter { chunks }) if fault_here(*chunks) => {
                    self.ctx.guard.finish(EndKind::Truncated);
                    return;
                }
                _ => {}
            }
            if i == n {
                break;
            }
            if i > 0 {
                at += ms(self.b.gap_before(i));
            }
            at += ms(self.b.stall_before(i));
            self.wait_until(at).await;
            let responses = self.responses.is_some();
            match &self.b.fault {
                Some(Fault::ErrorFrameAt { chunk, error }) if *chunk as usize == i && responses => {
                    if let Some(w) = self.responses.as_mut() {
                        let v = w.failed(error.clone());
                        self.responses_events(vec![v]).await;
                    }
                    self.ctx.guard.finish(EndKind::Completed);
                    return;
                }
                Some(Fault::ErrorFrameAt { chunk, error }) if *chunk as usize == i && messages => {
                    let e = error
                        .clone()
                        .unwrap_or_else(|| default_error_object(WireApi::Messages));
                    let b = format!("event: error\ndata: {e}\n\n");
                    self.write(Bytes::from(b)).await;
                    self.ctx.guard.frames_sent += 1;
                    self.ctx.guard.finish(EndKind::Completed);
                    return;
                }
                Some(Fault::MalformedAt { chunk }) if *chunk as usize == i => {
                    // An event cut inside its JSON, in the request's API.
                    let broken: &'static [u8] = match self.ctx.api {
                        WireApi::Chat => b"data: {\"id\":\"chatcmpl-mock\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"br\n\n",
                        WireApi::Messages => b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"br\n\n",
                        WireApi::Responses => b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"br\n\n",
                    };
                    self.write(Bytes::from_static(broken)).await;
                    self.ctx.guard.frames_sent += 1;
                }
                Some(Fault::ErrorFrameAt { chunk, error }) if *chunk as usize == i => {
                    let e = error
                        .clone()
                        .unwrap_or_else(|| default_error_object(WireApi::Chat));
                    self.frame(&e).await;
                    self.ctx.guard.finish(EndKind::Completed);
                    return;
                }
                _ => {}
            }
            // Its time has come: generated (billed) even if the client leaves before
            // the write completes.
            self.ctx.guard.generated += 1;
            if let Some(w) = self.responses.as_mut() {
                let evs = w.item(&plan.items[i]);
                match &plan.items[i] {
                    Item::Reasoning(s) => self.ctx.guard.reasoning.push_str(s),
                    Item::Content(s) => self.ctx.guard.content.push_str(s),
                    Item::Tool { .. } => {}
                }
                self.responses_events(evs).await;
                self.ctx.guard.chunks_sent += 1;
                continue;
            }
            if messages {
                match &plan.items[i] {
                    Item::Reasoning(s) => self.ctx.guard.reasoning.push_str(s),
                    Item::Content(s) => self.ctx.guard.content.push_str(s),
                    Item::Tool { .. } => {}
                }
                let item = plan.items[i].clone();
                self.messages_item(&item).await;
                self.ctx.guard.chunks_sent += 1;
                continue;
            }
            let delta = match &plan.items[i] {
                Item::Reasoning(s) => {
                    self.ctx.guard.reasoning.push_str(s);
                    match self.b.reasoning_field {
                        ReasoningField::ReasoningContent => json!({"reasoning_content": s}),
                        ReasoningField::Reasoning => json!({"reasoning": s}),
                    }
                }
                Item::Content(s) => {
                    self.ctx.guard.content.push_str(s);
                    json!({"content": s})
                }
                Item::Tool { first, args } => {
                    let t = self.b.tool_call.clone().unwrap_or_default();
                    if *first {
                        json!({"tool_calls": [{"index": 0, "id": t.id, "type": "function",
                            "function": {"name": t.name, "arguments": args}}]})
                    } else {
                        json!({"tool_calls": [{"index": 0, "function": {"arguments": args}}]})
                    }
                }
            };
            let v = self.chunk(delta, None);
            self.frame(&v).await;
            self.ctx.guard.chunks_sent += 1;
        }
        if let Some(mut w) = self.responses.take() {
            let with_usage = self.b.usage != UsageMode::None;
            let mut evs = w.finish(&plan.finish_reason, with_usage.then_some(&plan.usage));
            let terminal = evs.pop();
            self.responses_events(evs).await;
            if with_usage {
                self.ctx.guard.usage = Some(plan.usage);
            }
            self.after_finish_faults().await;
            self.responses_events(terminal.into_iter().collect()).await;
            self.out.drained().await;
            self.ctx.guard.finish(EndKind::Completed);
            return;
        }
        if messages {
            self.messages_finish(&plan).await;
            if self.b.usage != UsageMode::None {
                self.ctx.guard.usage = Some(plan.usage);
            }
            self.after_finish_faults().await;
            self.event(&json!({"type": "message_stop"})).await;
            self.out.drained().await;
            self.ctx.guard.finish(EndKind::Completed);
            return;
        }
        let fin = self.finish_frame(&plan);
        self.frame(&fin).await;
        if matches!(self.b.usage, UsageMode::Inline | UsageMode::Choice) {
            self.ctx.guard.usage = Some(plan.usage);
        }
        if self.b.fault == Some(Fault::ResetAfterFinish) {
            return self.reset(EndKind::ResetMidStream).await;
        }
        if self.b.usage == UsageMode::FinalFrame {
            let v = json!({
                "id": format!("chatcmpl-mock-{}", self.ctx.guard.id),
                "object": "chat.completion.chunk",
                "created": self.ctx.created,
                "model": self.ctx.model,
                "choices": [],
                "usage": usage_json(&plan.usage, plan.cache_dialect),
            });
            self.frame(&v).await;
            self.ctx.guard.usage = Some(plan.usage);
        }
        if self.b.fault == Some(Fault::HangAfterFinish) {
            self.out.drained().await;
            return self.hang().await;
        }
        if self.b.done {
            self.write(Bytes::from_static(b"data: [DONE]\n\n")).await;
        }
        self.out.drained().await;
        self.ctx.guard.finish(EndKind::Completed);
    }
}

/// Plays a generated SSE stream (headers already sent).
pub(crate) async fn play_stream(b: Behavior, ctx: Ctx, out: Out) {
    let responses = (ctx.api == WireApi::Responses).then(|| {
        ResponsesWriter::new(ctx.guard.id, &ctx.model, ctx.created, b.tool_call.clone())
            .signed_by(b.signing_group.as_deref())
    });
    let s = Stream {
        b: &b,
        ctx,
        out: &out,
        last_write: Instant::now(),
        block: None,
        next_block: 0,
        thinking: String::new(),
        responses,
    };
    s.play().await;
}

/// Plays a raw body in writes of `raw_chunk_bytes` with `raw_chunk_gap_ms` between
/// them, after `ttft_ms`.
pub(crate) async fn play_raw(b: Behavior, mut ctx: Ctx, out: Out, body: Bytes) {
    let ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1000.0);
    tokio::time::sleep(ms(b.ttft_ms)).await;
    let size = b.raw_chunk_bytes.unwrap_or(body.len().max(1));
    let mut off = 0;
    while off < body.len() {
        if off > 0 && b.raw_chunk_gap_ms > 0.0 {
            tokio::time::sleep(ms(b.raw_chunk_gap_ms)).await;
        }
        let end = (off + size).min(body.len());
        out.send(body.slice(off..end)).await;
        ctx.guard.frames_sent += 1;
        off = end;
    }
    out.drained().await;
    ctx.guard.finish(EndKind::Completed);
}

/// The plain `chat.completion` of a plan.
pub(crate) fn completion_json(b: &Behavior, ctx: &Ctx, plan: &Plan) -> Value {
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    let content = plan.full_content();
    msg.insert(
        "content".into(),
        if content.is_empty() && b.tool_call.is_some() {
            Value::Null
        } else {
            json!(content)
        },
    );
    let reasoning = plan.reasoning();
    if !reasoning.is_empty() {
        let key = match b.reasoning_field {
            ReasoningField::ReasoningContent => "reasoning_content",
            ReasoningField::Reasoning => "reasoning",
        };
        msg.insert(key.into(), json!(reasoning));
    }
    if let (Some(t), Some(args)) = (&b.tool_call, plan.tool_arguments()) {
        msg.insert(
            "tool_calls".into(),
            json!([{"index": 0, "id": t.id, "type": "function",
                "function": {"name": t.name, "arguments": args}}]),
        );
    }
    let mut v = json!({
        "id": format!("chatcmpl-mock-{}", ctx.guard.id),
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{"index": 0, "message": Value::Object(msg), "finish_reason": plan.finish_reason}],
    });
    if b.usage != UsageMode::None {
        v["usage"] = usage_json(&plan.usage, plan.cache_dialect);
    }
    v
}

/// Plays a plain body with a fault (headers already sent): half the body then an abort
/// or a clean end, an invalid body, or a body that never ends.
pub(crate) async fn play_plain_fault(
    b: Behavior,
    mut ctx: Ctx,
    out: Out,
    body: Bytes,
    plan_usage: Usage,
) {
    let half = body.slice(..body.len() / 2);
    match b.fault {
        Some(Fault::ResetAfter { .. }) | Some(Fault::ResetAfterFinish) => {
            out.send(half).await;
            out.drained().await;
            tokio::time::sleep(Duration::from_millis(2)).await;
            ctx.guard.finish(EndKind::ResetMidStream);
            ctx.kill.notify_one();
            std::future::pending::<()>().await;
        }
        Some(Fault::TruncateAfter { .. }) | Some(Fault::MalformedAt { .. }) => {
            out.send(half).await;
            out.drained().await;
            let end = if matches!(b.fault, Some(Fault::TruncateAfter { .. })) {
                EndKind::Truncated
            } else {
                EndKind::Completed
            };
            ctx.guard.finish(end);
        }
        Some(Fault::HangAfterFinish) => {
            if b.usage != UsageMode::None {
                ctx.guard.usage = Some(plan_usage);
            }
            out.send(body).await;
            std::future::pending::<()>().await;
        }
        _ => {
            out.send(body).await;
            out.drained().await;
            ctx.guard.finish(EndKind::Completed);
        }
    }
}

/// Records the usage and full content of a plain answer that is sent whole.
pub(crate) fn plain_sent(ctx: &mut Ctx, b: &Behavior, plan: &Plan) {
    ctx.guard.content = plan.full_content();
    ctx.guard.reasoning = plan.reasoning();
    ctx.guard.chunks_sent = plan.items.len() as u32;
    if b.usage != UsageMode::None {
        ctx.guard.usage = Some(plan.usage);
    }
}
