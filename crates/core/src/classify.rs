//! Classification (SPEC §5): every way an attempt can fail, mapped to its class and
//! telemetry label by one function. Transports describe what happened as a
//! [`Failure`]; [`classify`] decides what it means.

use std::time::Duration;

use crate::error::{AttemptError, ErrorClass, ErrorLabel};

/// What went wrong in an attempt, as the transport saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// A non-2xx HTTP response.
    Http {
        /// The status code.
        status: u16,
        /// Retry-After, already resolved to a duration.
        retry_after: Option<Duration>,
        /// The provider's error code (`error.code`, else `error.type`), if the body had one.
        code: Option<String>,
        /// The provider's error message, if the body had one.
        message: Option<String>,
    },
    /// No connection could be made: refused, DNS or TLS failure, connect timeout.
    Connect {
        /// What the connection layer said (no URL credentials, no key).
        detail: String,
    },
    /// The request was sent; the upstream closed or reset the connection before any
    /// response (`server_error`: the server's fault, not a connection failure).
    NoResponse {
        /// What the connection layer said (no URL credentials, no key).
        detail: String,
    },
    /// The whole-request timeout of a plain call (`TIMEOUT_S`).
    Timeout,
    /// No incremental chunk within the TTFT budget.
    TtftTimeout {
        /// The budget that ran out.
        budget: Duration,
    },
    /// A gap between incremental chunks exceeded the inter-token budget.
    StallTimeout {
        /// The budget that ran out.
        budget: Duration,
    },
    /// The stream ended or broke before any `finish_reason`.
    Truncated {
        /// How it ended (clean end of body, reset, …).
        detail: String,
    },
    /// An error object inside a 200 body or an SSE event.
    InBand {
        /// A numeric status inside the object, if any.
        status: Option<u16>,
        /// `error.code` or `error.type`.
        code: Option<String>,
        /// `error.message`.
        message: Option<String>,
    },
    /// Invalid JSON, no choices, a frame of the wrong shape.
    Malformed {
        /// What was wrong (never the raw body).
        detail: String,
    },
    /// The body or the accumulated content exceeded the cap.
    TooLarge {
        /// The cap in bytes.
        limit: usize,
    },
    /// A 200 that generated nothing (no content, reasoning or tool call) while
    /// `finish_reason` is not `length`.
    NothingGenerated {
        /// The finish_reason given, if any.
        finish_reason: Option<String>,
    },
}

/// The longest retry hint taken from an upstream (24 h): a longer one is this one
/// (SPEC §17.6: no wrap or truncation reachable from a header; both governance
/// backends get the same value). Any hint above the call's wait bound already means
/// "beyond the window": the call does not wait for it (SPEC §17.2).
pub const MAX_RETRY_HINT: Duration = Duration::from_secs(24 * 3600);

/// A retry hint bounded by [`MAX_RETRY_HINT`].
pub fn clamp_hint(d: Duration) -> Duration {
    d.min(MAX_RETRY_HINT)
}

/// A duration in whole milliseconds, saturating (never truncated to a small value).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Class and label of an HTTP status (SPEC §5 table). `None` for 2xx.
pub fn classify_status(status: u16) -> Option<(ErrorClass, ErrorLabel)> {
    use ErrorClass as C;
    use ErrorLabel as L;
    Some(match status {
        200..=299 => return None,
        429 => (C::RateLimited, L::RateLimited),
        408 => (C::Transient, L::Timeout),
        500..=599 => (C::Transient, L::ServerError),
        401 | 403 | 404 => (C::Dead, L::Dead),
        // 402 Payment Required: the account cannot pay; retrying it is pointless.
        402 => (C::Dead, L::Dead),
        // Any other 4xx is about the request (400, 413, 422; 409 Conflict too, SPEC
        // §17.4): passed through, not retried.
        400..=499 => (C::Rejected, L::Rejected),
        // 1xx/3xx that reached us (redirects are not followed): the source misbehaves.
        _ => (C::Invalid, L::Invalid),
    })
}

/// Class and label of a provider error code or type found in a body (in-band errors,
/// and 200 bodies that carry an error object). Unknown codes are `invalid`.
pub fn classify_code(code: &str) -> (ErrorClass, ErrorLabel) {
    use ErrorClass as C;
    use ErrorLabel as L;
    let c = code.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| c.contains(n));
    if has(&["rate_limit", "ratelimit", "too_many_requests", "throttl"]) {
        (C::RateLimited, L::RateLimited)
    } else if has(&[
        "context_length",
        "content_policy",
        "content_filter",
        "invalid_request",
        "invalid_prompt",
        "string_above_max_length",
        "max_tokens",
        "safety",
        "request_too_large",
    ]) {
        (C::Rejected, L::Rejected)
    } else if has(&[
        "invalid_api_key",
        "authentication",
        "unauthorized",
        "permission",
        "forbidden",
        "model_not_found",
        "not_found",
        "insufficient_quota",
        "billing",
        "account_deactivated",
    ]) {
        (C::Dead, L::Dead)
    } else if has(&[
        "server_error",
        "api_error",
        "internal",
        "overloaded",
        "unavailable",
        "timeout",
        "bad_gateway",
        "upstream",
        "capacity",
    ]) {
        (C::Transient, L::ServerError)
    } else {
        (C::Invalid, L::Invalid)
    }
}

/// The one classification function of SPEC §5.
pub fn classify(failure: Failure) -> AttemptError {
    use ErrorClass as C;
    use ErrorLabel as L;
    match failure {
        Failure::Http {
            status,
            retry_after,
            code,
            message,
        } => {
            let (mut class, mut label) =
                classify_status(status).unwrap_or((C::Invalid, L::Invalid));
            // A spend cap's 429 (Anthropic's `enforced_spend_limit_reached`, no
            // Retry-After) does not pass with time: the source is out, like a dead key
            // (SPEC §23.4).
            if status == 429
                && retry_after.is_none()
                && code.as_deref().is_some_and(|c| c.contains("spend_limit"))
            {
                (class, label) = (C::Dead, L::Dead);
            }
            // The status is its own field (and printed by Display): not repeated here.
            let detail = match (&code, &message) {
                (_, Some(m)) => m.clone(),
                (Some(c), None) => c.clone(),
                (None, None) => "the upstream answered with an error status".to_string(),
            };
            // Retry-After only means something for 429 and 503-like answers; keep it
            // whenever given, the engine only uses it for rate limits and cooldown hints.
            let e = AttemptError::new(class, label, detail)
                .with_status(status)
                .with_retry_after(retry_after.map(clamp_hint))
                .with_provider(code, message);
            // A redirect is a misconfigured BASE_URL: not this call's source (SPEC §17.4).
            if (300..400).contains(&status) {
                e.excluding_source()
            } else {
                e
            }
        }
        Failure::Connect { detail } => AttemptError::new(
            C::Transient,
            L::Connect,
            format!("connection failed: {detail}"),
        ),
        Failure::NoResponse { detail } => AttemptError::new(
            C::Transient,
            L::ServerError,
            format!("the upstream closed the connection before any response: {detail}"),
        ),
        Failure::Timeout => AttemptError::new(C::Transient, L::Timeout, "request timed out"),
        Failure::TtftTimeout { budget } => AttemptError::new(
            C::Transient,
            L::TtftTimeout,
            format!(
                "no incremental chunk within the TTFT budget of {:.3}s",
                budget.as_secs_f64()
            ),
        ),
        Failure::StallTimeout { budget } => AttemptError::new(
            C::Transient,
            L::StallTimeout,
            format!(
                "no incremental chunk for the inter-token budget of {:.3}s",
                budget.as_secs_f64()
            ),
        ),
        Failure::Truncated { detail } => AttemptError::new(
            C::Transient,
            L::Truncated,
            format!("stream ended before a finish_reason: {detail}"),
        ),
        Failure::InBand {
            status,
            code,
            message,
        } => {
            let by_status = status.and_then(classify_status);
            let by_code = code.as_deref().map(classify_code);
            let by_message = message.as_deref().map(classify_code);
            let (class, label) = by_status
                .or(by_code.filter(|(c, _)| *c != C::Invalid))
                .or(by_message.filter(|(c, _)| *c != C::Invalid))
                .unwrap_or((C::Invalid, L::Invalid));
            let mut e = AttemptError::new(
                class,
                label,
                format!(
                    "error object in the response{}",
                    message
                        .as_deref()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                ),
            )
            .with_provider(code, message);
            if let Some(s) = status {
                e = e.with_status(s);
            }
            e
        }
        Failure::Malformed { detail } => AttemptError::new(
            C::Invalid,
            L::Invalid,
            format!("malformed response: {detail}"),
        ),
        Failure::TooLarge { limit } => AttemptError::new(
            C::Invalid,
            L::Invalid,
            format!("response exceeds the cap of {limit} bytes"),
        )
        .excluding_source(),
        Failure::NothingGenerated { finish_reason } => AttemptError::new(
            C::Invalid,
            L::Invalid,
            format!(
                "nothing generated (no content, reasoning or tool call; finish_reason {})",
                finish_reason.as_deref().unwrap_or("none")
            ),
        ),
    }
}

/// Whether a rejection says the source takes the output cap only as
/// `max_completion_tokens` (OpenAI's reasoning models: "Unsupported parameter:
/// 'max_tokens' is not supported with this model. Use 'max_completion_tokens'
/// instead.": SPEC §24.4).
pub fn wants_max_completion_tokens(e: &AttemptError) -> bool {
    if e.class != ErrorClass::Rejected {
        return false;
    }
    let text = format!(
        "{} {}",
        e.provider_message.as_deref().unwrap_or(""),
        e.detail
    );
    text.contains("max_tokens") && text.contains("max_completion_tokens")
}

/// Whether a rejection says the prompt is longer than the model's context window
/// (SPEC §14.9), by the provider's code or message.
pub fn is_context_length(e: &AttemptError) -> bool {
    if e.class != ErrorClass::Rejected {
        return false;
    }
    if e.provider_code.as_deref().is_some_and(|c| {
        c.contains("context_length") || c.contains("context_window") || c == "request_too_large"
    }) {
        return true;
    }
    let text = format!(
        "{} {}",
        e.provider_message.as_deref().unwrap_or(""),
        e.detail
    )
    .to_ascii_lowercase();
    [
        "context length",
        "context_length",
        "context window",
        "maximum context",
        "too many tokens",
        "prompt is too long",
        "reduce the length",
    ]
    .iter()
    .any(|k| text.contains(k))
}

#[cfg(test)]
mod tests {

    #[test]
    fn context_length_rejections_are_recognized() {
        let rej = |code: Option<&str>, msg: &str| {
            AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
                .with_provider(code.map(str::to_string), Some(msg.into()))
        };
        assert!(is_context_length(&rej(
            Some("context_length_exceeded"),
            "x"
        )));
        assert!(is_context_length(&rej(
            None,
            "This model's maximum context length is 8192 tokens"
        )));
        assert!(is_context_length(&rej(
            None,
            "prompt is too long: 210000 tokens"
        )));
        assert!(!is_context_length(&rej(
            Some("content_policy_violation"),
            "no"
        )));
        let server = AttemptError::new(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            "context length",
        );
        assert!(!is_context_length(&server));
    }
    use super::*;
    use ErrorClass as C;
    use ErrorLabel as L;

    fn http(status: u16) -> AttemptError {
        classify(Failure::Http {
            status,
            retry_after: None,
            code: None,
            message: None,
        })
    }

    #[test]
    fn http_status_table() {
        let table: &[(u16, C, L)] = &[
            (429, C::RateLimited, L::RateLimited),
            (408, C::Transient, L::Timeout),
            (409, C::Rejected, L::Rejected),
            (500, C::Transient, L::ServerError),
            (502, C::Transient, L::ServerError),
            (503, C::Transient, L::ServerError),
            (504, C::Transient, L::ServerError),
            (599, C::Transient, L::ServerError),
            (400, C::Rejected, L::Rejected),
            (413, C::Rejected, L::Rejected),
            (422, C::Rejected, L::Rejected),
            (401, C::Dead, L::Dead),
            (403, C::Dead, L::Dead),
            (404, C::Dead, L::Dead),
            (402, C::Dead, L::Dead),
            (418, C::Rejected, L::Rejected),
            (302, C::Invalid, L::Invalid),
        ];
        for &(status, class, label) in table {
            let e = http(status);
            assert_eq!((e.class, e.label), (class, label), "HTTP {status}");
            assert_eq!(e.http_status, Some(status));
        }
        assert_eq!(classify_status(200), None);
        // SPEC §17.4: a redirect keeps its source out of the call; so does an answer
        // over the cap; other failures do not.
        for s in [301, 302, 307, 308] {
            assert!(http(s).excludes_source, "{s}");
        }
        assert!(classify(Failure::TooLarge { limit: 16 }).excludes_source);
        for s in [400, 401, 429, 500] {
            assert!(!http(s).excludes_source, "{s}");
        }
    }

    /// SPEC §17.6: a hint from outside is bounded before any arithmetic.
    #[test]
    fn retry_hints_are_bounded() {
        let e = classify(Failure::Http {
            status: 429,
            retry_after: Some(Duration::from_secs(18_446_744_073_709_548)),
            code: None,
            message: None,
        });
        assert_eq!(e.retry_after, Some(MAX_RETRY_HINT));
        assert_eq!(millis(Duration::MAX), u64::MAX);
        assert_eq!(clamp_hint(Duration::from_secs(5)), Duration::from_secs(5));
        // The bound is a day: an hour-long hint is kept as it is.
        assert_eq!(MAX_RETRY_HINT, Duration::from_secs(86_400));
        assert_eq!(
            clamp_hint(Duration::from_secs(7_200)),
            Duration::from_secs(7_200)
        );
    }

    #[test]
    fn budget_and_breaker_per_spec_row() {
        // SPEC §5: 429 refunded/no breaker; transient 1/yes; rejected terminal/no;
        // dead 1/opens-dead; invalid 1/no.
        assert!(!http(429).class.consumes_budget() && !http(429).class.feeds_breaker());
        for s in [408, 500, 503] {
            assert!(
                http(s).class.consumes_budget() && http(s).class.feeds_breaker(),
                "{s}"
            );
        }
        // SPEC §17.4: 409 and 422 are the request's fault, passed through.
        for s in [400, 409, 413, 422] {
            assert!(http(s).class.is_terminal_for_call(), "{s}");
            assert!(!http(s).class.feeds_breaker(), "{s}");
        }
        for s in [401, 403, 404] {
            assert_eq!(http(s).class, C::Dead);
            assert!(http(s).class.consumes_budget());
        }
    }

    /// SPEC §24.4: OpenAI's refusal of `max_tokens` is recognized; other rejections are not.
    #[test]
    fn a_max_tokens_refusal_is_recognized() {
        let rej = |msg: &str| {
            AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
                .with_provider(Some("unsupported_parameter".into()), Some(msg.into()))
        };
        assert!(wants_max_completion_tokens(&rej(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead."
        )));
        assert!(!wants_max_completion_tokens(&rej(
            "max_tokens: must be at least 1"
        )));
        let transient = AttemptError::new(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            "max_tokens max_completion_tokens",
        );
        assert!(!wants_max_completion_tokens(&transient));
    }

    /// SPEC §23.4: Anthropic's error types classify as the spec says.
    #[test]
    fn anthropic_errors_classify() {
        let http = |status: u16, code: &str, ra: Option<Duration>| {
            classify(Failure::Http {
                status,
                retry_after: ra,
                code: Some(code.into()),
                message: Some("m".into()),
            })
        };
        assert_eq!(
            http(429, "enforced_spend_limit_reached", None).class,
            C::Dead
        );
        assert_eq!(
            http(429, "rate_limit_error", Some(Duration::from_secs(3))).class,
            C::RateLimited
        );
        assert_eq!(http(402, "billing_error", None).class, C::Dead);
        assert_eq!(http(529, "overloaded_error", None).class, C::Transient);
        assert!(is_context_length(&http(413, "request_too_large", None)));
        for kind in ["overloaded_error", "api_error", "timeout_error"] {
            let e = classify(Failure::InBand {
                status: None,
                code: Some(kind.into()),
                message: None,
            });
            assert_eq!(e.class, C::Transient, "{kind}");
        }
    }

    #[test]
    fn transport_failure_kinds() {
        let rows: Vec<(Failure, C, L)> = vec![
            (
                Failure::Connect {
                    detail: "refused".into(),
                },
                C::Transient,
                L::Connect,
            ),
            (Failure::Timeout, C::Transient, L::Timeout),
            (
                Failure::TtftTimeout {
                    budget: Duration::from_secs(1),
                },
                C::Transient,
                L::TtftTimeout,
            ),
            (
                Failure::StallTimeout {
                    budget: Duration::from_secs(1),
                },
                C::Transient,
                L::StallTimeout,
            ),
            (
                Failure::Truncated {
                    detail: "eof".into(),
                },
                C::Transient,
                L::Truncated,
            ),
            (
                Failure::Malformed {
                    detail: "bad json".into(),
                },
                C::Invalid,
                L::Invalid,
            ),
            (Failure::TooLarge { limit: 10 }, C::Invalid, L::Invalid),
            (
                Failure::NothingGenerated {
                    finish_reason: Some("stop".into()),
                },
                C::Invalid,
                L::Invalid,
            ),
        ];
        for (f, class, label) in rows {
            let name = format!("{f:?}");
            let e = classify(f);
            assert_eq!((e.class, e.label), (class, label), "{name}");
            assert_eq!(e.http_status, None);
        }
    }

    #[test]
    fn provider_code_and_retry_after_are_kept() {
        let e = classify(Failure::Http {
            status: 400,
            retry_after: None,
            code: Some("context_length_exceeded".into()),
            message: Some("This model's maximum context length is 8192 tokens".into()),
        });
        assert_eq!(e.class, C::Rejected);
        assert_eq!(e.provider_code.as_deref(), Some("context_length_exceeded"));
        assert!(e.to_string().contains("context_length_exceeded"));
        let e = classify(Failure::Http {
            status: 429,
            retry_after: Some(Duration::from_secs(7)),
            code: None,
            message: None,
        });
        assert_eq!(e.retry_after, Some(Duration::from_secs(7)));
    }

    #[test]
    fn body_code_table() {
        let table: &[(&str, C)] = &[
            ("rate_limit_exceeded", C::RateLimited),
            ("RateLimitError", C::RateLimited),
            ("context_length_exceeded", C::Rejected),
            ("content_policy_violation", C::Rejected),
            ("content_filter", C::Rejected),
            ("invalid_request_error", C::Rejected),
            ("invalid_api_key", C::Dead),
            ("model_not_found", C::Dead),
            ("insufficient_quota", C::Dead),
            ("server_error", C::Transient),
            ("overloaded_error", C::Transient),
            ("service_unavailable", C::Transient),
            ("something_new", C::Invalid),
        ];
        for &(code, class) in table {
            assert_eq!(classify_code(code).0, class, "{code}");
        }
    }

    #[test]
    fn in_band_errors_prefer_status_then_code_then_message() {
        let e = classify(Failure::InBand {
            status: Some(503),
            code: Some("weird".into()),
            message: None,
        });
        assert_eq!((e.class, e.http_status), (C::Transient, Some(503)));
        let e = classify(Failure::InBand {
            status: None,
            code: Some("rate_limit_exceeded".into()),
            message: Some("slow down".into()),
        });
        assert_eq!(e.class, C::RateLimited);
        let e = classify(Failure::InBand {
            status: None,
            code: None,
            message: Some("The server is overloaded".into()),
        });
        assert_eq!(e.class, C::Transient);
        let e = classify(Failure::InBand {
            status: None,
            code: None,
            message: Some("??".into()),
        });
        assert_eq!(e.class, C::Invalid);
    }
}
