//! [`Secret`]: a string that is never printed, logged, serialized or shown in errors.

use std::fmt;

use serde::{Serialize, Serializer};

/// The text every redacted value prints as.
pub const REDACTED: &str = "<redacted>";

/// A secret string (API keys, URLs with passwords). `Debug`, `Display` and `Serialize`
/// print [`REDACTED`]; only [`Secret::expose`] gives the value, for the one place that
/// must send it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value. Call it only where the secret is sent (an HTTP header, a connect call).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the secret is empty (local servers need no key).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("\"\"")
        } else {
            f.write_str(REDACTED)
        }
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if self.0.is_empty() { "" } else { REDACTED })
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret::new(s)
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret::new(s)
    }
}

/// The shortest run of a secret that counts as giving it away (SPEC §17, issue 22,
/// item 18): 12 characters — longer than a word a message may share with a key
/// ("upstream says …" for a key `upstream-…`), as long as the part of a key a provider's
/// own mask shows (`sk-proj-abcd****`).
pub const MIN_SECRET_FRAGMENT: usize = 12;

/// `text` with the secret redacted: every run of at least [`MIN_SECRET_FRAGMENT`] bytes
/// (or the whole secret, when shorter) that also occurs in `secret`, compared ASCII
/// case-insensitively (an upstream that lowercases the key it echoes gives it away just
/// the same), replaced by [`REDACTED`]. Secrets shorter than 4 bytes are not secrets
/// worth garbling messages for. Greedy, left to right, longest match first. (Encoded
/// forms — base64 — are the transport's: `polygw_transport_openai::failure::redact`.)
pub fn redact_fragments(text: &str, secret: &str) -> String {
    let (t, k) = (text.as_bytes(), secret.as_bytes());
    if k.len() < 4 {
        return text.to_string();
    }
    let min = MIN_SECRET_FRAGMENT.min(k.len());
    let mut out = String::with_capacity(text.len());
    let (mut i, mut copied) = (0, 0);
    while i + min <= t.len() {
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let mut best = 0;
        for j in 0..=k.len() - min {
            let n = t[i..]
                .iter()
                .zip(&k[j..])
                .take_while(|(a, b)| a.eq_ignore_ascii_case(b))
                .count();
            best = best.max(n);
        }
        while best > 0 && !text.is_char_boundary(i + best) {
            best -= 1;
        }
        if best >= min {
            out.push_str(&text[copied..i]);
            out.push_str(REDACTED);
            i += best;
            copied = i;
        } else {
            i += 1;
        }
    }
    out.push_str(&text[copied..]);
    out
}

/// A URL with any password (and the query, which may carry tokens) replaced by
/// [`REDACTED`], for printing connection URLs.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        // Nothing to hide: show it as written.
        Ok(u) if u.password().is_none() && u.query().is_none() => raw.to_string(),
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some(REDACTED));
            }
            if u.query().is_some() {
                u.set_query(Some(REDACTED));
            }
            u.to_string()
        }
        // A multi-host URL (Redis Cluster seeds): hide the password and the query.
        Err(_)
            if raw
                .split_once("://")
                .is_some_and(|(s, _)| s.ends_with("+cluster")) =>
        {
            let (scheme, rest) = raw.split_once("://").unwrap_or_default();
            let (userinfo, rest) = match rest.rsplit_once('@') {
                Some((u, r)) => (Some(u), r),
                None => (None, rest),
            };
            let (rest, query) = match rest.split_once('?') {
                Some((r, _)) => (r, format!("?{REDACTED}")),
                None => (rest, String::new()),
            };
            let user = match userinfo {
                Some(u) => match u.split_once(':') {
                    Some((name, _)) => format!("{name}:{REDACTED}@"),
                    None => format!("{u}@"),
                },
                None => String::new(),
            };
            format!("{scheme}://{user}{rest}{query}")
        }
        // Not a URL: print nothing of it that could be a credential.
        Err(_) => match raw.split_once("://") {
            Some((scheme, _)) => format!("{scheme}://{REDACTED}"),
            None => REDACTED.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("sk-very-secret");
        assert_eq!(format!("{s:?}"), REDACTED);
        assert_eq!(format!("{s}"), REDACTED);
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            format!("\"{REDACTED}\"")
        );
        assert_eq!(s.expose(), "sk-very-secret");
        assert_eq!(format!("{:?}", Secret::default()), "\"\"");
    }

    #[test]
    fn cluster_urls_lose_passwords() {
        assert_eq!(
            redact_url("redis+cluster://u:hunter2@h1:7001,h2:7002/0?x=secret"),
            format!("redis+cluster://u:{REDACTED}@h1:7001,h2:7002/0?{REDACTED}")
        );
        assert_eq!(
            redact_url("rediss+cluster://:pw@h1:7001,h2:7002"),
            format!("rediss+cluster://:{REDACTED}@h1:7001,h2:7002")
        );
        assert_eq!(
            redact_url("redis+cluster://h1:7001,h2:7002"),
            "redis+cluster://h1:7001,h2:7002"
        );
    }

    #[test]
    fn fragments_of_a_secret_are_redacted() {
        let key = "sk-upstream-secret-0123456789";
        // Whole, a long prefix (the provider masked the rest), a long middle part.
        let t = redact_fragments(
            "key sk-upstream-secret-0123456789 bad; key sk-upstream-secre*** is bad; cret-01 ok; eam-secret-012 end",
            key,
        );
        assert_eq!(
            t,
            "key <redacted> bad; key <redacted>*** is bad; cret-01 ok; <redacted> end"
        );
        // Issue 22, item 18: a word shared with the key is not the key; a lowercased or
        // uppercased echo is.
        assert_eq!(
            redact_fragments("upstream says 400", "upstream-key-0123456789abcdef"),
            "upstream says 400"
        );
        let key = "sk-AbCdEfGhIjKlMnOpQrStUvWxYz0123";
        let lower = key.to_ascii_lowercase();
        let echoed = format!("invalid key {}", &lower[..27]);
        assert_eq!(redact_fragments(&echoed, key), "invalid key <redacted>");
        assert_eq!(
            redact_fragments(&format!("KEY {}", key.to_ascii_uppercase()), key),
            "KEY <redacted>"
        );
        // Eleven characters are not a fragment of a long key; unrelated text stays.
        assert_eq!(
            redact_fragments("sk-AbCdEfGh and more", key),
            "sk-AbCdEfGh and more"
        );
        assert_eq!(
            redact_fragments("é sk-AbCdEfGhIjKlM ü", key),
            "é <redacted> ü"
        );
        assert_eq!(redact_fragments("anything", ""), "anything");
        // A short key is hidden whole only.
        assert_eq!(redact_fragments("a short-k b", "short-k"), "a <redacted> b");
        assert_eq!(redact_fragments("a short- b", "short-k"), "a short- b");
        assert_eq!(redact_fragments("a abc b", "abc"), "a abc b");
    }

    #[test]
    fn urls_lose_passwords() {
        let r = redact_url("postgres://user:hunter2@db:5432/x?sslpassword=zz");
        assert!(!r.contains("hunter2") && !r.contains("zz"), "{r}");
        assert!(r.contains("user"), "{r}");
        assert_eq!(redact_url("sqlite://polygw.db"), "sqlite://polygw.db");
        assert!(!redact_url("not a url hunter2").contains("hunter2"));
    }
}
