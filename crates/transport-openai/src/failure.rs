//! From HTTP to [`Failure`]: Retry-After parsing, error bodies, reqwest errors, and
//! redaction of the API key from everything that may be shown.

use std::time::{Duration, SystemTime};

use polygw_core::classify::{classify, Failure, MAX_RETRY_HINT};
use polygw_core::secret::REDACTED;
use polygw_core::AttemptError;
use reqwest::header::HeaderMap;

use crate::aggregate::ProviderError;

/// Parses a `Retry-After` value: delay-seconds (integer, or a float as some providers
/// send) or an HTTP-date, relative to `now`. Zero, a date in the past (or now) and
/// anything else (negative, NaN, garbage) are `None`: no hint, so the retry loop's own
/// backoff applies (SPEC §14.1: a zero hint never makes a tight loop).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if let Ok(secs) = v.parse::<f64>() {
        // 0 and negative are no hint (SPEC §14.1): the backoff applies instead.
        if secs.is_finite() && secs > 0.0 {
            // Bounded (SPEC §17.6): a hint of 2^64 s is a long cooldown, not an overflow.
            return Some(
                Duration::try_from_secs_f64(secs)
                    .map_or(MAX_RETRY_HINT, polygw_core::classify::clamp_hint),
            );
        }
        return None;
    }
    let at = httpdate::parse_http_date(v).ok()?;
    // A date in the past (or now) is no hint either.
    at.duration_since(now)
        .ok()
        .filter(|d| !d.is_zero())
        .map(polygw_core::classify::clamp_hint)
}

/// Retry-After of a response: `retry-after-ms` (OpenAI's precise variant) when present
/// and valid, else `retry-after` (seconds or HTTP-date, relative to the system clock).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms > 0.0)
    {
        return Some(
            Duration::try_from_secs_f64(ms / 1000.0)
                .map_or(MAX_RETRY_HINT, polygw_core::classify::clamp_hint),
        );
    }
    let raw = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    // An HTTP-date is relative to the wall clock of this host by definition; no
    // injected clock can stand in for it.
    #[allow(clippy::disallowed_methods)]
    let now = SystemTime::now();
    parse_retry_after(raw, now)
}

/// Removes the API key from a text (issue 22, item 18): the key and any run of 12 or
/// more of its characters, whatever their case (`polygw_core::secret::redact_fragments`),
/// and its base64 forms (standard and URL-safe, with and without padding, as a Basic
/// credential or an echoed header carries it); keys shorter than 4 bytes are not secrets
/// worth garbling messages for.
pub fn redact(text: String, key: &str) -> String {
    use base64::Engine as _;
    if key.len() < 4 {
        return text;
    }
    let mut out = polygw_core::secret::redact_fragments(&text, key);
    let engines = [
        &base64::engine::general_purpose::STANDARD,
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ];
    for e in engines {
        // The key at each of the three byte alignments it can have inside a longer
        // encoded value (`user:key`, `Bearer key`): the characters that depend on the
        // key's bytes alone are all but the first group (when shifted) and the last.
        for shift in 0..3usize {
            let mut bytes = vec![0u8; shift];
            bytes.extend_from_slice(key.as_bytes());
            let encoded = e.encode(&bytes);
            let start = if shift == 0 { 0 } else { 4 };
            let end = encoded.len().saturating_sub(4);
            if let Some(stable) = encoded.get(start..end).filter(|t| t.len() >= 8) {
                if out.contains(stable) {
                    out = out.replace(stable, REDACTED);
                }
            }
        }
    }
    debug_assert!(!out.contains(key) || key.contains(REDACTED));
    out
}

fn redact_opt(text: Option<String>, key: &str) -> Option<String> {
    text.map(|t| redact(t, key))
}

/// Redacts the key from every text field of a classified error (belt and braces: the
/// transport never puts the key anywhere, but a provider may echo it back).
pub fn scrub(mut e: AttemptError, key: &str) -> AttemptError {
    e.detail = redact(std::mem::take(&mut e.detail), key);
    e.provider_code = redact_opt(e.provider_code.take(), key);
    e.provider_message = redact_opt(e.provider_message.take(), key);
    e
}

/// Classifies a failure (core's one function) and scrubs the key from the result.
pub fn fail(f: Failure, key: &str) -> AttemptError {
    scrub(classify(f), key)
}

/// The failure of a non-2xx response.
pub fn http_failure(
    status: u16,
    retry_after: Option<Duration>,
    err: Option<ProviderError>,
) -> Failure {
    let err = err.unwrap_or_default();
    Failure::Http {
        status,
        retry_after,
        code: err.code,
        message: err.message,
    }
}

/// A description of a reqwest error without its URL (which may carry credentials in a
/// query string): its kind, then the chain of underlying causes.
pub fn describe(e: &reqwest::Error, key: &str) -> String {
    let kind = if e.is_connect() {
        "connect"
    } else if e.is_timeout() {
        "timed out"
    } else if e.is_body() {
        "body"
    } else if e.is_decode() {
        "decode"
    } else if e.is_request() {
        "request"
    } else if e.is_redirect() {
        "redirect"
    } else {
        "transport"
    };
    let mut out = String::from(kind);
    let mut src = std::error::Error::source(e);
    let mut depth = 0;
    while let Some(s) = src {
        let text = s.to_string();
        if !text.is_empty() && !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        src = s.source();
        depth += 1;
        if depth > 6 {
            break;
        }
    }
    redact(strip_urls(out), key)
}

/// Replaces anything that looks like a URL (`scheme://…` up to whitespace) by its scheme
/// and host marker, so no query string or userinfo survives.
pub fn strip_urls(text: String) -> String {
    if !text.contains("://") {
        return text;
    }
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        match word.find("://") {
            Some(p) => {
                let start = word[..p]
                    .rfind(|c: char| !c.is_ascii_alphanumeric() && c != '+' && c != '-' && c != '.')
                    .map(|q| q + 1)
                    .unwrap_or(0);
                out.push_str(&word[..start]);
                out.push_str(&word[start..p]);
                out.push_str("://");
                out.push_str(REDACTED);
            }
            None => out.push_str(word),
        }
    }
    out
}

/// A send error (before any response) as a failure: `connect` when no connection could
/// be made (refused, DNS, TLS, the connect timeout), a `timeout` when reqwest timed
/// out, and otherwise — the request was sent and the upstream closed or reset the
/// connection before any response — a server fault (`server_error`), never `connect`
/// (issue 22, item 16).
pub fn send_failure(e: &reqwest::Error, key: &str) -> Failure {
    if e.is_connect() {
        Failure::Connect {
            detail: describe(e, key),
        }
    } else if e.is_timeout() {
        Failure::Timeout
    } else {
        Failure::NoResponse {
            detail: describe(e, key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, item 18: the key's case and base64 forms are redacted (also inside a
    /// Basic credential), a word it shares with the message is not.
    #[test]
    fn the_key_and_its_common_forms_are_redacted() {
        use base64::Engine as _;
        let key = "sk-Upstream-Key-0123456789abcdefXYZ";
        assert_eq!(redact("upstream says 400".into(), key), "upstream says 400");
        let lower = redact(format!("bad key {}", key.to_ascii_lowercase()), key);
        assert!(
            !lower.to_ascii_lowercase().contains("0123456789abcdef"),
            "{lower}"
        );
        for text in [
            base64::engine::general_purpose::STANDARD.encode(key),
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key),
            base64::engine::general_purpose::STANDARD.encode(format!("user:{key}")),
            base64::engine::general_purpose::STANDARD.encode(format!("ab:{key}")),
            base64::engine::general_purpose::STANDARD.encode(format!("a:{key}")),
        ] {
            let r = redact(format!("echo {text} end"), key);
            assert!(r.contains(REDACTED), "{r}");
            let b64 = &text[8..text.len() - 8];
            assert!(!r.contains(b64), "{r}");
        }
    }

    #[test]
    fn retry_after_seconds_floats_and_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after(" 1.5 ", now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        // SPEC §14.1: zero, past, negative or unparsable is no hint.
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:00 GMT", now),
            None
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            None
        );
        for bad in ["0", "0.0", "-1", "NaN", "inf", "soon", ""] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad}");
        }
    }

    #[test]
    fn retry_after_ms_header_wins() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", "3".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
        h.insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_millis(250)));
        // A zero retry-after-ms is no hint: the seconds header is used.
        h.insert("retry-after-ms", "0".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
    }

    #[test]
    fn redaction_and_url_stripping() {
        assert_eq!(
            redact("key sk-abcdef leaked".into(), "sk-abcdef"),
            "key <redacted> leaked"
        );
        assert_eq!(redact("abc".into(), "ab"), "abc");
        let s = strip_urls("error sending request for url (http://u:p@host/v1?key=zz) x".into());
        assert!(!s.contains("zz") && !s.contains("u:p"), "{s}");
        assert!(
            s.starts_with("error sending request for url (http://"),
            "{s}"
        );
    }

    #[test]
    fn scrub_covers_every_text_field() {
        let e = fail(
            Failure::Http {
                status: 401,
                retry_after: None,
                code: Some("bad key sk-secret-1".into()),
                message: Some("Incorrect API key provided: sk-secret-1".into()),
            },
            "sk-secret-1",
        );
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains("sk-secret-1"), "{shown}");
    }
}
