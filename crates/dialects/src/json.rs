//! Typed reads of request JSON that name the field at fault: each helper takes the
//! value out of its object (no copies) and returns a [`DialectError`] whose `param` is
//! the field's path (`tools[3].function.name`).

use serde_json::{Map, Value};

use crate::error::DialectError;

/// Parses a request body that must be one JSON object.
pub(crate) fn parse_body(body: &[u8]) -> Result<Map<String, Value>, DialectError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(DialectError::body("the body must be a JSON object")),
        Err(e) => Err(DialectError::body(format!(
            "the body is not valid JSON: {e}"
        ))),
    }
}

/// `path.key` (or `key` at the top level).
pub(crate) fn at(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// `path[i]`.
pub(crate) fn idx(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

/// The JSON type's name, for messages.
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(path: &str, want: &str, got: &Value) -> DialectError {
    DialectError::invalid(
        path,
        format!("{path} must be {want} (got {})", type_name(got)),
    )
}

/// Removes `key`; `null` reads as absent.
pub(crate) fn take(o: &mut Map<String, Value>, key: &str) -> Option<Value> {
    match o.remove(key) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v),
    }
}

/// An optional string.
pub(crate) fn opt_string(v: Option<Value>, path: &str) -> Result<Option<String>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong(path, "a string", &other)),
    }
}

/// A required string (absent or `null` → 400 naming it).
pub(crate) fn req_string(v: Option<Value>, path: &str) -> Result<String, DialectError> {
    opt_string(v, path)?.ok_or_else(|| DialectError::invalid(path, format!("{path} is required")))
}

/// An optional boolean.
pub(crate) fn opt_bool(v: Option<Value>, path: &str) -> Result<Option<bool>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(other) => Err(wrong(path, "a boolean", &other)),
    }
}

/// An optional finite number within `lo..=hi`.
pub(crate) fn opt_number(
    v: Option<Value>,
    path: &str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(DialectError::invalid(
                path,
                format!("{path} must be a number in {lo}..={hi} (got {n})"),
            )),
        },
        Some(other) => Err(wrong(path, "a number", &other)),
    }
}

/// An optional integer ≥ `min` that fits a u32.
pub(crate) fn opt_int(v: Option<Value>, path: &str, min: u64) -> Result<Option<u32>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let ok = n
                .as_u64()
                .or_else(|| {
                    n.as_f64()
                        .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= f64::from(u32::MAX))
                        .map(|x| x as u64)
                })
                .filter(|x| *x >= min)
                .and_then(|x| u32::try_from(x).ok());
            ok.map(Some).ok_or_else(|| {
                DialectError::invalid(
                    path,
                    format!("{path} must be an integer of at least {min} (got {n})"),
                )
            })
        }
        Some(other) => Err(wrong(path, "an integer", &other)),
    }
}

/// An optional object.
pub(crate) fn opt_object(
    v: Option<Value>,
    path: &str,
) -> Result<Option<Map<String, Value>>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(other) => Err(wrong(path, "an object", &other)),
    }
}

/// An optional array.
pub(crate) fn opt_array(v: Option<Value>, path: &str) -> Result<Option<Vec<Value>>, DialectError> {
    match v {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(other) => Err(wrong(path, "an array", &other)),
    }
}

/// An object, or a 400 naming `path`.
pub(crate) fn object(v: Value, path: &str) -> Result<Map<String, Value>, DialectError> {
    match v {
        Value::Object(o) => Ok(o),
        other => Err(wrong(path, "an object", &other)),
    }
}

/// Whether `s` is one of `allowed`, else a 400 listing them.
pub(crate) fn one_of(s: &str, allowed: &[&str], path: &str) -> Result<(), DialectError> {
    if allowed.contains(&s) {
        Ok(())
    } else {
        Err(DialectError::invalid(
            path,
            format!("{path} must be one of {} (got {s:?})", allowed.join(", ")),
        ))
    }
}

/// A borrowed string field of an object.
pub(crate) fn str_of<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    o.get(key).and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn helpers_name_the_path() {
        let e = opt_string(Some(json!(1)), "a.b").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("a.b"));
        assert_eq!(e.message, "a.b must be a string (got a number)");
        assert_eq!(opt_int(Some(json!(5.0)), "n", 1).unwrap(), Some(5));
        assert!(opt_int(Some(json!(0)), "n", 1).is_err());
        assert!(opt_int(Some(json!(1.5)), "n", 1).is_err());
        assert!(opt_number(Some(json!(3)), "t", 0.0, 2.0).is_err());
        assert_eq!(
            req_string(None, "model").unwrap_err().message,
            "model is required"
        );
        assert_eq!(at("", "x"), "x");
        assert_eq!(idx(&at("a", "b"), 2), "a.b[2]");
        assert!(parse_body(b"[1]").is_err());
        assert!(parse_body(b"{")
            .unwrap_err()
            .message
            .contains("not valid JSON"));
        assert!(one_of("x", &["a", "b"], "p")
            .unwrap_err()
            .message
            .contains("a, b"));
    }
}
