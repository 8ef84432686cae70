//! The wire formats clients speak to `polygw serve` besides chat completions — the
//! OpenAI Responses API ([`responses`]) and the Anthropic Messages API ([`messages`]) —
//! as pure conversions between their requests, answers and stream events and
//! polygw-core's types (SPEC §18).
//!
//! Nothing here does I/O, reads a clock or draws randomness: ids and timestamps come in
//! as parameters. Each dialect has the same shape:
//! - `parse_request(body)` reads and checks a body once (errors name the field,
//!   [`error::DialectError`]); `to_chat` gives the core
//!   [`ChatRequest`](polygw_core::ChatRequest) and the dialect's meta (what writing the
//!   answer needs), as a [`Translated`];
//! - an answer function (`response_object`, `message_object`) for plain answers;
//! - a stream state machine (`ResponsesStream`, `MessagesStream`): `start`, `delta`,
//!   `finish` or `fail`, each returning [`sse::SseEvent`]s, exactly one terminal event;
//! - `check_stream`, a conformance check of a whole event sequence, and
//!   `request_from_chat`, the inverse conversion, for tests.

#![warn(missing_docs, unreachable_pub)]

mod chat;
pub mod error;
mod json;
pub mod messages;
pub mod responses;
pub mod source;
pub mod sse;

pub use error::DialectError;
pub use sse::{parse_sse, SseEvent};

/// A dialect's request translated: the core chat request (`stream` as the client
/// asked) and the dialect's meta, what writing the answer needs.
#[derive(Debug, Clone)]
pub struct Translated<M> {
    /// The request for polygw's engine.
    pub request: polygw_core::ChatRequest,
    /// What the answer needs (echoed fields, tool-name map, …).
    pub meta: M,
}
