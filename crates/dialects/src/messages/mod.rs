//! The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as
//! conversions to and from core types: [`parse_request`] and [`to_chat`] (request →
//! [`polygw_core::ChatRequest`]), [`count_tokens`], [`message_object`] (answer →
//! `message`), [`MessagesStream`] (stream deltas → events), [`error_body`] (Anthropic's
//! error shape and status), [`check_stream`] (a conformance check of an event sequence)
//! and [`request_from_chat`] (the inverse conversion).

mod check;
mod inverse;
mod output;
mod request;
mod stream;
mod translate;

pub use check::{check_stream, FinalToolUse, MessagesFinal};
pub use inverse::request_from_chat;
pub use output::{error_body, message_object, tool_input, RAW_ARGUMENTS_KEY};
pub use request::{parse_request, MessagesRequest};
pub use stream::MessagesStream;
pub use translate::{count_tokens, to_chat, MessagesMeta, Translated};
