//! Native APIs (SPEC §23): a request that reaches a source of its own API as the client
//! sent it ([`NativeRequest`], with the edits of §23.2 made by the source's adapter), an
//! upstream event passed to the client as received ([`NativeEvent`]), and the pure
//! readers that tell the engine what each API's events mean ([`messages`]).

pub mod family;
pub mod messages;
pub mod responses;
pub mod signed;

use serde_json::{Map, Value};

use crate::ports::StreamDelta;
use crate::response::Usage;
use crate::source::SourceApi;

/// An error a source sent in its answer (an `error` event, `response.failed`, an error
/// body): its type or code, and its message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NativeError {
    /// `error.type` (`overloaded_error`, …) or `error.code` (`server_error`, …).
    pub kind: Option<String>,
    /// `error.message`.
    pub message: Option<String>,
}

/// Why an event could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// The data is not a JSON object.
    Malformed(String),
    /// The source sent an error.
    Provider(NativeError),
}

/// An event's data as a JSON object; an `error` event whose data is not one is the
/// source's error all the same (its text as the message).
fn event_object(event: Option<&str>, data: &str, n: u64) -> Result<Map<String, Value>, ReadError> {
    let text = data.trim();
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => Ok(o),
        _ if event == Some("error") => Err(ReadError::Provider(NativeError {
            kind: None,
            message: (!text.is_empty()).then(|| crate::error::shorten(text.to_string(), 512)),
        })),
        Ok(_) => Err(ReadError::Malformed(format!(
            "event #{n} is not a JSON object"
        ))),
        Err(e) => Err(ReadError::Malformed(format!(
            "invalid JSON in event #{n} ({e})"
        ))),
    }
}

/// An event's data as a JSON object and its type (its `type`, else the SSE event
/// name), the `n`-th of its stream.
fn typed_event(
    event: Option<&str>,
    data: &str,
    n: u64,
) -> Result<(Map<String, Value>, String), ReadError> {
    let obj = event_object(event, data, n)?;
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .or(event)
        .unwrap_or_default()
        .to_string();
    Ok((obj, kind))
}

/// The event as the client receives it, with what the reader found it means.
fn as_received(
    api: SourceApi,
    event: Option<&str>,
    data: &str,
    progress: bool,
    patient: bool,
    opaque: bool,
) -> Box<NativeEvent> {
    Box::new(NativeEvent {
        api,
        event: event.map(str::to_string),
        data: data.to_string(),
        progress,
        patient,
        opaque,
    })
}

/// What a plain (non-streamed) native answer holds, as the engine reads it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlainAnswer {
    /// The answer's text, joined.
    pub content: String,
    /// Its reasoning (thinking, reasoning summaries), joined.
    pub reasoning: String,
    /// Its tool calls: (position, id, name, arguments as JSON text).
    pub tool_calls: Vec<(u32, Option<String>, Option<String>, String)>,
    /// Chat's finish reason for its stop reason or status.
    pub finish_reason: Option<String>,
    /// Its usage, as polygw counts it; `None` when it reported none.
    pub usage: Option<Usage>,
    /// Its `model`.
    pub model: Option<String>,
    /// Whether it holds any content at all (a server-tool block, a redacted or
    /// encrypted reasoning item counts: the answer is not empty).
    pub has_blocks: bool,
}

/// A native API's event reader (one per stream).
#[derive(Debug, Clone)]
pub enum NativeReader {
    /// Anthropic's Messages.
    Messages(messages::MessagesReader),
    /// OpenAI's Responses.
    Responses(responses::ResponsesReader),
}

impl NativeReader {
    /// The reader of a source of `api` (`None` for chat: its frames are read by the
    /// transport's own aggregator).
    pub fn for_api(api: SourceApi) -> Option<Self> {
        match api {
            SourceApi::Chat => None,
            SourceApi::Messages => Some(NativeReader::Messages(messages::MessagesReader::new())),
            SourceApi::Responses => {
                Some(NativeReader::Responses(responses::ResponsesReader::new()))
            }
        }
    }

    /// Reads one event (see each reader).
    pub fn on_event(&mut self, event: Option<&str>, data: &str) -> Result<StreamDelta, ReadError> {
        match self {
            NativeReader::Messages(r) => r.on_event(event, data),
            NativeReader::Responses(r) => r.on_event(event, data),
        }
    }

    /// Whether the stream's last event came.
    pub fn done(&self) -> bool {
        match self {
            NativeReader::Messages(r) => r.done(),
            NativeReader::Responses(r) => r.done(),
        }
    }
}

/// Reads a plain answer of `api`: `Err` when the body is the source's error.
pub fn read_plain(api: SourceApi, obj: &Map<String, Value>) -> Result<PlainAnswer, NativeError> {
    match api {
        SourceApi::Messages => {
            if obj.get("type").and_then(Value::as_str) == Some("error") {
                return Err(messages::error_of(obj).unwrap_or_default());
            }
            Ok(messages::read_message(obj))
        }
        SourceApi::Responses | SourceApi::Chat => responses::read_response(obj),
    }
}

/// A client's request in a source API's own shape, for the sources that speak it
/// (SPEC §23.2). Carried beside the chat form of the request, which the engine decides
/// from and which sources of other APIs are sent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NativeRequest {
    /// The API the body is in.
    pub api: SourceApi,
    /// The client's body as it sent it (fields polygw does not read included).
    pub body: Map<String, Value>,
    /// The request headers to forward (`anthropic-*`), names lower-case.
    pub headers: Vec<(String, String)>,
    /// The client's query string (`beta=true`), without `?`.
    pub query: Option<String>,
}

impl NativeRequest {
    /// The body a source gets: the client's, with the edits of SPEC §23.2 that apply
    /// here — `model` is the source's, `stream` as the engine reads it, then the
    /// source's `EXTRA_BODY` merged on top (as on chat sources).
    pub fn body_for(
        &self,
        model: &str,
        stream: bool,
        extra: &Map<String, Value>,
    ) -> Map<String, Value> {
        let mut body = self.body.clone();
        body.insert("model".into(), Value::String(model.to_string()));
        if stream {
            body.insert("stream".into(), Value::Bool(true));
        } else if body.get("stream").and_then(Value::as_bool) == Some(true) {
            body.insert("stream".into(), Value::Bool(false));
        }
        crate::body::merge_patch(&mut body, extra);
        body
    }
}

/// One upstream event in a native API's stream, as the client receives it
/// (SPEC §23.2: pings included).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NativeEvent {
    /// The API of the source that sent it: only a client of that API receives it as
    /// sent; a client of another gets the translation of what it says (SPEC §23.3).
    pub api: SourceApi,
    /// The SSE `event:` name (`message_start`, `ping`, …), when the source named it.
    pub event: Option<String>,
    /// The event's `data:`, as received.
    pub data: String,
    /// Whether it is a content event: the first one commits a leg and moves the
    /// first-token and stall clocks (SPEC §23.4).
    pub progress: bool,
    /// Whether a silence may follow that is not a stall: a thinking block whose deltas
    /// may be omitted, a server tool running. The silence after it is measured against
    /// the first-token budget, not the stall one (SPEC §23.4).
    pub patient: bool,
    /// Whether it opens output that is neither text, reasoning nor a call of the
    /// client's — a server tool's call or result, a hosted tool's item, a block type
    /// polygw does not read: a prefill (text only) cannot carry it, so an answer that
    /// delivered one is resumed by replay (SPEC §23.6).
    pub opaque: bool,
}

impl NativeEvent {
    /// Writes it as an SSE event.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        if let Some(e) = &self.event {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(e.as_bytes());
            out.push(b'\n');
        }
        for line in self.data.split('\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
    }
}
