//! The OpenAI Responses API (`POST /v1/responses`) as conversions to and from core
//! types: [`parse_request`] and [`to_chat`] (request → [`polygw_core::ChatRequest`]),
//! [`response_object`] / [`output_items`] (answer → `response` object),
//! [`ResponsesStream`] (stream deltas → typed events), [`check_stream`] (a conformance
//! check of an event sequence) and [`request_from_chat`] (the inverse conversion).

mod check;
mod input;
mod inverse;
mod output;
mod request;
mod stream;
mod tools;
mod translate;

pub use check::{check_stream, FinalCall, ResponsesFinal};
pub use inverse::request_from_chat;
pub use output::{output_items, response_object};
pub use request::{parse_request, ResponsesRequest};
pub use stream::ResponsesStream;
pub use tools::{ToolKind, ToolTarget};
pub use translate::{to_chat, ResponsesMeta, Translated};
