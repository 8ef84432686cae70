//! The response cache key (SPEC §10): a hash of the canonical request — messages and
//! every generation parameter, not the source, not `stream` — and the scope.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::request::ChatRequest;

/// Writes `v` as JSON with object keys sorted at every level (independent of how
/// serde_json orders maps in this build).
pub fn canonical_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                canonical_json(&m[k.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The cache key of a request in a scope (hex SHA-256).
pub fn cache_key(scope: &str, req: &ChatRequest) -> String {
    let mut r = req.clone();
    r.stream = false;
    let v = serde_json::to_value(&r).unwrap_or(Value::Null);
    let mut canon = String::with_capacity(256);
    canonical_json(&v, &mut canon);
    let mut h = Sha256::new();
    h.update(b"polygw-cache-v1\0");
    h.update(scope.as_bytes());
    h.update(b"\0");
    h.update(canon.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The canonical form, byte for byte: keys sorted at every level, commas between
    /// members and elements only (a stored cache key depends on it).
    #[test]
    fn canonical_json_is_sorted_compact_json() {
        let mut out = String::new();
        canonical_json(
            &json!({"b": [1, 2, {"z": null, "y": "s"}], "a": {}, "c": []}),
            &mut out,
        );
        assert_eq!(out, r#"{"a":{},"b":[1,2,{"y":"s","z":null}],"c":[]}"#);
    }

    #[test]
    fn key_covers_generation_parameters_not_stream() {
        let base = ChatRequest::user("hi");
        let k = cache_key("LLM", &base);
        assert_eq!(k.len(), 64);
        assert_eq!(k, cache_key("LLM", &base.clone().with_stream(true)));
        assert_ne!(k, cache_key("OTHER", &base));
        assert_ne!(k, cache_key("LLM", &base.clone().with_temperature(0.1)));
        assert_ne!(k, cache_key("LLM", &base.clone().with_max_tokens(5)));
        assert_ne!(
            k,
            cache_key("LLM", &base.clone().with_overlay("top_p", json!(1)))
        );
        assert_ne!(k, cache_key("LLM", &ChatRequest::user("hi!")));
    }

    #[test]
    fn key_ignores_map_order() {
        let a = ChatRequest::user("x")
            .with_overlay("a", json!({"x": 1, "y": 2}))
            .with_overlay("b", json!(2));
        let b = ChatRequest::user("x")
            .with_overlay("b", json!(2))
            .with_overlay("a", json!({"y": 2, "x": 1}));
        assert_eq!(cache_key("S", &a), cache_key("S", &b));
    }
}
