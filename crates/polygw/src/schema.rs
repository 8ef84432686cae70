//! JSON Schema validation for `chat_json_with_schema` (cargo feature `schema`, off by
//! default: jsonschema brings ~30 crates and turns on serde_json's `float_roundtrip`
//! for the whole build). A compiled validator is cached per schema, keyed by the
//! schema's canonical JSON (object keys sorted), so a schema given on every call is
//! compiled once. Without the feature, giving a schema is an error naming the feature:
//! never a silent skip.

use serde_json::Value;

use polygw_core::GatewayError;

/// How many compiled schemas are kept (oldest dropped first).
#[cfg(feature = "schema")]
pub(crate) const CACHE_CAPACITY: usize = 64;

/// A compiled JSON Schema.
#[derive(Debug, Clone)]
pub(crate) struct Schema {
    #[cfg(feature = "schema")]
    validator: std::sync::Arc<jsonschema::Validator>,
    #[cfg(not(feature = "schema"))]
    never: std::convert::Infallible,
}

fn invalid(message: String) -> GatewayError {
    GatewayError::InvalidRequest {
        field: "schema".into(),
        message,
    }
}

/// The error of a build without the `schema` feature.
#[cfg_attr(
    feature = "schema",
    allow(dead_code, reason = "used without the feature")
)]
pub(crate) fn feature_missing() -> GatewayError {
    invalid(
        "validating against a JSON Schema needs the `schema` cargo feature of polygw, \
         which this build does not have (polygw = { features = [\"schema\"] })"
            .into(),
    )
}

/// The schema's canonical JSON: object keys sorted at every level.
#[cfg(any(test, feature = "schema"))]
pub(crate) fn canonical(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&m[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

#[cfg(feature = "schema")]
mod cache {
    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Mutex, OnceLock};

    type Validator = Arc<jsonschema::Validator>;

    #[derive(Default)]
    pub(super) struct Cache {
        pub(super) map: HashMap<String, Validator>,
        order: VecDeque<String>,
    }

    pub(super) fn get() -> std::sync::MutexGuard<'static, Cache> {
        static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
        CACHE
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    impl Cache {
        pub(super) fn lookup(&self, key: &str) -> Option<Validator> {
            self.map.get(key).cloned()
        }

        pub(super) fn insert(&mut self, key: String, v: Validator) -> Validator {
            if let Some(existing) = self.map.get(&key) {
                return existing.clone();
            }
            while self.map.len() >= super::CACHE_CAPACITY {
                match self.order.pop_front() {
                    Some(old) => {
                        self.map.remove(&old);
                    }
                    None => break,
                }
            }
            self.order.push_back(key.clone());
            self.map.insert(key, v.clone());
            v
        }
    }
}

impl Schema {
    /// The compiled schema (from the cache when this schema was compiled before).
    pub(crate) fn compile(schema: &Value) -> Result<Schema, GatewayError> {
        #[cfg(feature = "schema")]
        {
            let key = canonical(schema);
            if let Some(validator) = cache::get().lookup(&key) {
                return Ok(Schema { validator });
            }
            // Compiled outside the lock: a slow schema does not hold up other calls.
            let compiled = jsonschema::validator_for(schema)
                .map_err(|e| invalid(format!("not a valid JSON Schema: {e}")))?;
            let validator = cache::get().insert(key, std::sync::Arc::new(compiled));
            Ok(Schema { validator })
        }
        #[cfg(not(feature = "schema"))]
        {
            let _ = schema;
            Err(feature_missing())
        }
    }

    /// Up to `max` violations of `value`, each with its location.
    pub(crate) fn errors(&self, value: &Value, max: usize) -> Vec<String> {
        #[cfg(feature = "schema")]
        {
            self.validator
                .iter_errors(value)
                .map(|e| format!("{} at {}", e, e.instance_path()))
                .take(max)
                .collect()
        }
        #[cfg(not(feature = "schema"))]
        {
            let _ = (value, max);
            match self.never {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_ignores_key_order() {
        let a = json!({"type": "object", "properties": {"b": {"type": "string"}, "a": {}}});
        let b = json!({"properties": {"a": {}, "b": {"type": "string"}}, "type": "object"});
        assert_eq!(canonical(&a), canonical(&b));
        assert_ne!(canonical(&a), canonical(&json!({"type": "array"})));
    }

    #[test]
    fn the_missing_feature_is_named() {
        let GatewayError::InvalidRequest { field, message } = feature_missing() else {
            panic!("an invalid request");
        };
        assert_eq!(field, "schema");
        assert!(message.contains("`schema` cargo feature"), "{message}");
    }

    #[cfg(not(feature = "schema"))]
    #[test]
    fn without_the_feature_a_schema_is_refused() {
        let e = Schema::compile(&json!({"type": "object"})).unwrap_err();
        assert!(e.to_string().contains("`schema` cargo feature"), "{e}");
    }

    #[cfg(feature = "schema")]
    #[test]
    fn a_schema_is_compiled_once_and_validates() {
        let s1 = Schema::compile(&json!({"type": "object", "required": ["x"]})).unwrap();
        let s2 = Schema::compile(&json!({"required": ["x"], "type": "object"})).unwrap();
        assert!(
            std::sync::Arc::ptr_eq(&s1.validator, &s2.validator),
            "the same schema (keys in another order) comes from the cache"
        );
        assert!(s1.errors(&json!({"x": 1}), 5).is_empty());
        let errs = s1.errors(&json!({}), 5);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].contains("\"x\" is a required property"), "{errs:?}");
        let bad = Schema::compile(&json!({"type": 12})).unwrap_err();
        assert!(bad.to_string().contains("not a valid JSON Schema"), "{bad}");
    }

    #[cfg(feature = "schema")]
    #[test]
    fn the_cache_is_bounded() {
        for i in 0..(CACHE_CAPACITY + 10) {
            Schema::compile(&json!({"type": "object", "title": format!("bounded-{i}")})).unwrap();
        }
        assert!(cache::get()
            .lookup(&canonical(&json!({"type": "object", "title": "bounded-0"})))
            .is_none());
        assert!(cache::get().map.len() <= CACHE_CAPACITY);
    }
}
