//! Native APIs (SPEC §23): a request that reaches a source of its own API as the client
//! sent it ([`NativeRequest`], with the edits of §23.2 made by the source's adapter), an
//! upstream event passed to the client as received ([`NativeEvent`]), and the pure
//! readers that tell the engine what each API's events mean ([`messages`]).

pub mod messages;

use serde_json::{Map, Value};

use crate::source::SourceApi;

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
