//! Secrets out of captured message contents (SPEC §26.1): a key that a user pasted into
//! a prompt must not reach a trace backend.

/// Prefixes of well-known credentials: OpenAI and Anthropic (`sk-`), polygw's client
/// keys (`pgw-`), GitHub, Slack, AWS access keys, Google API keys.
const PREFIXES: [&str; 11] = [
    "sk-",
    "sk_",
    "pgw-",
    "ghp_",
    "gho_",
    "ghs_",
    "github_pat_",
    "xoxb-",
    "xoxp-",
    "AKIA",
    "AIza",
];

/// Shortest credential-looking word that is redacted.
const MIN_LEN: usize = 16;

/// What replaces a secret.
pub const REDACTED: &str = "[REDACTED]";

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// `text` with credential-shaped words replaced by [`REDACTED`]: words of at least 16
/// characters that start with a known key prefix, and the token after `Bearer `.
pub fn redact_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut after_bearer = false;
    let mut rest = text;
    while !rest.is_empty() {
        let start = rest.find(is_word).unwrap_or(rest.len());
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if rest.is_empty() {
            break;
        }
        let end = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
        let word = &rest[..end];
        let secret =
            word.len() >= MIN_LEN && (after_bearer || PREFIXES.iter().any(|p| word.starts_with(p)));
        out.push_str(if secret { REDACTED } else { word });
        after_bearer = word.eq_ignore_ascii_case("bearer");
        rest = &rest[end..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_in_a_prompt_are_redacted_and_the_rest_kept() {
        let t = r#"{"role":"user","content":"my key is sk-proj-abcdefghijklmnop1234, use it; Authorization: Bearer abcdefghijklmnopqrstuvwx. Hi sk-short"}"#;
        let r = redact_secrets(t);
        assert!(!r.contains("abcdefghijklmnop1234"), "{r}");
        assert!(!r.contains("abcdefghijklmnopqrstuvwx"), "{r}");
        assert!(r.contains("my key is [REDACTED], use it"), "{r}");
        assert!(r.contains("Hi sk-short"), "{r}");
        assert!(r.starts_with(r#"{"role":"user","content":"#), "{r}");
        assert_eq!(
            redact_secrets("pgw-0123456789abcdef0123"),
            REDACTED,
            "a polygw client key"
        );
    }

    proptest! {
        #[test]
        fn no_key_survives_whatever_surrounds_it(
            before in "[ -~]{0,30}",
            key in "[A-Za-z0-9]{16,40}",
            prefix in prop::sample::select(PREFIXES.to_vec()),
            after in "[ ,;:!?\"'(){}]{1,3}[ -~]{0,30}",
        ) {
            let secret = format!("{prefix}{key}");
            // The key starts a word.
            let text = format!("{before} {secret}{after}");
            let r = redact_secrets(&text);
            prop_assert!(!r.contains(&secret), "{r}");
        }

        #[test]
        fn text_without_secrets_is_unchanged(t in "[a-z ,.!?]{0,80}") {
            prop_assert_eq!(redact_secrets(&t), t);
        }
    }
}
