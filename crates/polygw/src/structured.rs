//! Structured output (SPEC §10): `chat_json::<T>()` asks for JSON, parses it into `T`
//! (validating against a JSON Schema when given), and re-asks with the parse error up
//! to `STRUCTURED__MAX_REASKS` times, all inside one logical call.

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tracing::Instrument;

use polygw_core::{ChatRequest, GatewayError, LlmResponse, Message, TerminalReason};

use crate::client::{with_deadline, GatewayClient};
use crate::schema::Schema;

/// A parsed structured answer.
#[derive(Debug, Clone)]
pub struct Structured<T> {
    /// The value.
    pub value: T,
    /// The last round's response: its `call_stats` count the attempts of every round,
    /// its `generation_ms` is the last round's.
    pub response: LlmResponse,
    /// Rounds used (1 = no re-ask).
    pub rounds: u32,
}

/// The text of a JSON answer, without the Markdown code fence models often add.
pub fn strip_code_fence(s: &str) -> &str {
    let t = s.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let rest = rest.trim_start_matches(|c: char| c.is_ascii_alphanumeric());
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

fn mentions_json(req: &ChatRequest) -> bool {
    req.messages.iter().any(|m| {
        m.content
            .as_ref()
            .map(|c| c.to_string().to_ascii_lowercase().contains("json"))
            .unwrap_or(false)
    })
}

impl GatewayClient {
    /// Asks for a JSON answer and parses it into `T`.
    pub async fn chat_json<T: DeserializeOwned>(
        &self,
        request: ChatRequest,
    ) -> Result<Structured<T>, GatewayError> {
        self.chat_json_with_schema(request, None).await
    }

    /// Like [`GatewayClient::chat_json`], also validating against a JSON Schema
    /// (cargo feature `schema`; without it, giving a schema is an `InvalidRequest`
    /// naming the feature). The compiled schema is cached across calls.
    pub async fn chat_json_with_schema<T: DeserializeOwned>(
        &self,
        mut request: ChatRequest,
        schema: Option<&Value>,
    ) -> Result<Structured<T>, GatewayError> {
        request
            .validate()
            .map_err(|(field, message)| GatewayError::InvalidRequest { field, message })?;
        // Compiled once per schema (cached); without the `schema` feature, an error.
        let validator = schema.map(Schema::compile).transpose()?;
        // JSON mode unless the caller chose a format; a source that does not support
        // it drops the key with EXTRA_BODY {"response_format": null}.
        if request.response_format.is_none() {
            request.response_format = Some(json!({"type": "json_object"}));
        }
        if !mentions_json(&request) || schema.is_some() {
            let mut text = "Answer with a single JSON value and nothing else.".to_string();
            if let Some(s) = schema {
                text.push_str(&format!(" It must validate against this JSON Schema: {s}"));
            }
            request.messages.insert(0, Message::system(text));
        }
        let (call, span) = self.new_call(request.stream);
        let max_reasks = self.engine.scope.max_reasks;
        let body = async {
            let mut last_problem = String::new();
            for round in 0..=max_reasks {
                let response = self.run_chat(&request, &call, None).await?;
                let problem =
                    match serde_json::from_str::<Value>(strip_code_fence(&response.content)) {
                        Err(e) => format!("it is not valid JSON ({e})"),
                        Ok(v) => {
                            let schema_errors: Vec<String> = validator
                                .as_ref()
                                .map(|val| val.errors(&v, 5))
                                .unwrap_or_default();
                            if !schema_errors.is_empty() {
                                format!(
                                    "it does not match the schema: {}",
                                    schema_errors.join("; ")
                                )
                            } else {
                                match serde_json::from_value::<T>(v) {
                                    Ok(value) => {
                                        return Ok((
                                            Structured {
                                                value,
                                                response: response.clone(),
                                                rounds: round + 1,
                                            },
                                            response,
                                        ))
                                    }
                                    Err(e) => format!("it does not have the expected shape ({e})"),
                                }
                            }
                        }
                    };
                tracing::debug!(round, problem = %problem, "structured answer invalid");
                last_problem = problem;
                if round < max_reasks {
                    request
                        .messages
                        .push(Message::assistant(response.content.clone()));
                    request.messages.push(Message::user(format!(
                        "Your previous answer was invalid: {last_problem}. Reply again with only the corrected JSON."
                    )));
                }
            }
            Err(call.terminal(
                TerminalReason::StructuredInvalid,
                Some(format!(
                    "the answer stayed invalid after {max_reasks} re-asks: {last_problem}"
                )),
            ))
        };
        let result = with_deadline(&self.engine, &call, body)
            .instrument(span.clone())
            .await;
        let as_response = result
            .as_ref()
            .map(|(_, r)| r.clone())
            .map_err(|e| e.clone());
        self.finish_call(&call, &span, &as_response);
        result.map(|(s, _)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_are_stripped() {
        assert_eq!(strip_code_fence("```json\n{\"a\":1}\n```"), "{\"a\":1}");
        assert_eq!(strip_code_fence("  {\"a\":1} "), "{\"a\":1}");
        assert_eq!(strip_code_fence("```\n[1]\n```"), "[1]");
    }
}
