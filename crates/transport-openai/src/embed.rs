//! Embeddings over `/embeddings`: a plain call under the whole-request timeout; vectors
//! as JSON numbers or base64 little-endian f32, put back in input order.

use async_trait::async_trait;
use base64::Engine as _;
use polygw_core::body::embedding_body;
use polygw_core::classify::Failure;
use polygw_core::ports::{EmbeddingResult, EmbeddingTransport};
use polygw_core::{AttemptError, SourceConfig, UsageSource};
use serde_json::{Map, Value};

use crate::aggregate::{in_band_error, parse_usage};
use crate::failure::fail;
use crate::OpenAiTransport;

fn malformed(detail: impl Into<String>) -> Failure {
    Failure::Malformed {
        detail: detail.into(),
    }
}

fn vector_of(item: &Map<String, Value>, pos: usize) -> Result<Vec<f32>, Failure> {
    match item.get("embedding") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| malformed(format!("embedding {pos} holds a non-number"))),
        Some(Value::String(b64)) => {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|_| malformed(format!("embedding {pos} is not valid base64")))?;
            if raw.len() % 4 != 0 {
                return Err(malformed(format!(
                    "embedding {pos} is not a whole number of f32"
                )));
            }
            Ok(raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        _ => Err(malformed(format!("embedding {pos} has no vector"))),
    }
}

/// The vectors of an `/embeddings` response, in input order.
pub(crate) fn parse_embeddings(
    obj: &Map<String, Value>,
    expected: usize,
) -> Result<EmbeddingResult, Failure> {
    if let Some(pe) = in_band_error(obj) {
        return Err(Failure::InBand {
            status: pe.status,
            code: pe.code,
            message: pe.message,
        });
    }
    let data = obj
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("no `data` array in the embeddings response"))?;
    if data.len() != expected {
        return Err(malformed(format!(
            "{} embeddings for {expected} inputs",
            data.len()
        )));
    }
    let mut slots: Vec<Option<Vec<f32>>> = vec![None; expected];
    for (pos, item) in data.iter().enumerate() {
        let item = item
            .as_object()
            .ok_or_else(|| malformed(format!("embedding {pos} is not an object")))?;
        let idx = match item.get("index") {
            None => pos,
            Some(v) => v
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| malformed(format!("embedding {pos} has a bad index")))?,
        };
        let slot = slots
            .get_mut(idx)
            .ok_or_else(|| malformed(format!("embedding index {idx} out of range")))?;
        if slot.is_some() {
            return Err(malformed(format!("embedding index {idx} given twice")));
        }
        *slot = Some(vector_of(item, pos)?);
    }
    let vectors = slots.into_iter().flatten().collect::<Vec<_>>();
    let usage = obj.get("usage").and_then(Value::as_object).map(parse_usage);
    Ok(EmbeddingResult {
        vectors,
        usage_source: if usage.is_some() {
            UsageSource::Measured
        } else {
            UsageSource::Unavailable
        },
        usage: usage.unwrap_or_default(),
        model: obj
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .map(str::to_string),
        http_status: 200,
    })
}

#[async_trait]
impl EmbeddingTransport for OpenAiTransport {
    async fn embed(
        &self,
        source: &SourceConfig,
        texts: &[String],
        call_id: &str,
    ) -> Result<EmbeddingResult, AttemptError> {
        let key = source.api_key.expose();
        let body = embedding_body(source, texts);
        let (status, obj) = self
            .plain_object(source, "embeddings", &body, call_id)
            .await?;
        let mut r = parse_embeddings(&obj, texts.len()).map_err(|f| fail(f, key))?;
        r.http_status = status;
        Ok(r)
    }

    async fn embed_inputs(
        &self,
        source: &SourceConfig,
        inputs: &[polygw_core::EmbeddingInput],
        call_id: &str,
    ) -> Result<EmbeddingResult, AttemptError> {
        let key = source.api_key.expose();
        let body = polygw_core::body::embedding_body_inputs(source, inputs);
        let (status, obj) = self
            .plain_object(source, "embeddings", &body, call_id)
            .await?;
        let mut r = parse_embeddings(&obj, inputs.len()).map_err(|f| fail(f, key))?;
        r.http_status = status;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn vectors_in_input_order_numbers_and_base64() {
        let b64 = base64::engine::general_purpose::STANDARD.encode(
            [1.5f32, -2.0]
                .iter()
                .flat_map(|f| f.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let r = parse_embeddings(
            &obj(
                json!({"data":[{"index":1,"embedding":b64},{"index":0,"embedding":[0.5,0.25]}],
                "model":"e","usage":{"prompt_tokens":4,"total_tokens":4}}),
            ),
            2,
        )
        .unwrap();
        assert_eq!(r.vectors, vec![vec![0.5, 0.25], vec![1.5, -2.0]]);
        assert_eq!(r.usage.prompt_tokens, 4);
        assert_eq!(r.usage_source, UsageSource::Measured);
    }

    #[test]
    fn wrong_shapes_are_invalid() {
        for (v, n) in [
            (json!({"data":[]}), 1),
            (json!({"nodata":1}), 1),
            (json!({"data":[{"index":0,"embedding":["x"]}]}), 1),
            (
                json!({"data":[{"index":0,"embedding":[1]},{"index":0,"embedding":[1]}]}),
                2,
            ),
            (json!({"data":[{"index":5,"embedding":[1]}]}), 1),
        ] {
            assert!(matches!(
                parse_embeddings(&obj(v), n),
                Err(Failure::Malformed { .. })
            ));
        }
        assert!(matches!(
            parse_embeddings(
                &obj(json!({"error":{"message":"x","code":"server_error"}})),
                1
            ),
            Err(Failure::InBand { .. })
        ));
        let r = parse_embeddings(&obj(json!({"data":[{"embedding":[1.0]}]})), 1).unwrap();
        assert_eq!(r.usage_source, UsageSource::Unavailable);
    }
}
