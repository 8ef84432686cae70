//! [`DialectError`]: a request a dialect cannot translate, with the status the client
//! should see and the request field at fault.

use std::fmt;

/// A request that cannot be served as sent: malformed, or asking for something a
/// chat-completions source cannot honour. The handler answers it in the dialect's own
/// error shape (OpenAI's `error` object, Anthropic's `{"type":"error",…}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DialectError {
    /// The HTTP status: 400 unless stated (413 for a body too large to read).
    pub status: u16,
    /// The request field at fault, as a path (`input[2].content[0].file_id`), when one is.
    pub param: Option<String>,
    /// What is wrong, naming the field; shown to the client as is.
    pub message: String,
}

impl DialectError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        DialectError {
            status: 400,
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A 400 about the body as a whole (not JSON, not an object).
    pub fn body(message: impl Into<String>) -> Self {
        DialectError {
            status: 400,
            param: None,
            message: message.into(),
        }
    }
}

impl fmt::Display for DialectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DialectError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_the_field_and_displays_the_message() {
        let e = DialectError::invalid("tools[0].name", "tools[0].name is required");
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("tools[0].name"));
        assert_eq!(e.to_string(), "tools[0].name is required");
        assert_eq!(DialectError::body("not JSON").param, None);
    }
}
