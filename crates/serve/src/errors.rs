//! A failed logical call as an HTTP answer (docs/SERVE.md, "Errors"): which terminal
//! reasons are rate limits (429 with `Retry-After`), which are unavailability (503),
//! the deadline (504, saying what happened), and rejections (the upstream's status).

use std::time::Duration;

use axum::http::StatusCode;
use polygw::core::{ErrorClass, RefusalReason, SourceReason};
use polygw::{ErrorLabel, GatewayError, TerminalReason};

use crate::openai::ApiError;

/// `Retry-After` seconds for a duration: rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    (d.as_secs_f64().ceil() as u64).max(1)
}

/// Whether a source's reason says "busy, come back later" (a quota, a cooldown on an
/// upstream's rate-limit hint) rather than "broken".
fn is_rate_reason(r: &SourceReason) -> bool {
    match r {
        SourceReason::Refused(x) => matches!(
            x,
            RefusalReason::Rpm
                | RefusalReason::Tpm
                | RefusalReason::Concurrency
                | RefusalReason::ScopeRpm
                | RefusalReason::ScopeTpm
                | RefusalReason::Cooldown
        ),
        SourceReason::Failed(l) => *l == ErrorLabel::RateLimited,
    }
}

/// A dead source (401/403/404) cannot take the call later either; it does not make a
/// rate limit an outage.
fn is_dead(r: &SourceReason) -> bool {
    matches!(
        r,
        SourceReason::Refused(RefusalReason::Dead) | SourceReason::Failed(ErrorLabel::Dead)
    )
}

/// Whether a `stalled` / `no_runnable_source` failure is a rate limit: every source
/// that could take the call later is held back by a quota or by a cooldown on an
/// upstream's 429 (dead sources aside), or, when no source reason is known, the last
/// attempt was rate-limited.
pub fn is_rate_limited(e: &GatewayError) -> bool {
    let Some(ctx) = e.context() else {
        return false;
    };
    let live: Vec<&SourceReason> = ctx.reasons.values().filter(|r| !is_dead(r)).collect();
    if live.is_empty() {
        return ctx.reasons.is_empty()
            && ctx
                .last_error
                .as_deref()
                .is_some_and(|l| l.class == ErrorClass::RateLimited);
    }
    live.into_iter().all(is_rate_reason)
}

/// The answer to a failed call (SPEC §11, §15):
///
/// | terminal reason | status |
/// |---|---|
/// | `rejected` | the upstream's 4xx status, code and message |
/// | `stalled`, `no_runnable_source` that [`is_rate_limited`] | 429 `rate_limit_exceeded` + `Retry-After` |
/// | other `stalled`, `no_runnable_source`; `retry_exhausted`; `governance_backend` | 503, the reason as code (+ `Retry-After` when known) |
/// | `deadline_exceeded` | 504, attempts made and the last error |
/// | `structured_invalid` | 502 |
pub fn from_gateway(e: &GatewayError) -> ApiError {
    let ctx = e.context();
    let hint = ctx
        .and_then(|c| c.retry_after)
        .or_else(|| e.last_error().and_then(|l| l.retry_after));
    let retry_after = hint.map(retry_after_secs);
    let reason = match e {
        GatewayError::InvalidRequest { field, message } => {
            return ApiError::bad_request(field, format!("{field}: {message}"));
        }
        GatewayError::Config(c) => {
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "configuration",
                format!("the gateway is misconfigured: {c}"),
            );
        }
        _ => e
            .terminal_reason()
            .unwrap_or(TerminalReason::RetryExhausted),
    };
    let last = e.last_error();
    let attempts = ctx.map_or(0, |c| c.attempts);
    match reason {
        TerminalReason::Rejected => {
            let status = last
                .and_then(|l| l.http_status)
                .and_then(|s| StatusCode::from_u16(s).ok())
                .filter(|s| s.is_client_error())
                .unwrap_or(StatusCode::BAD_REQUEST);
            ApiError {
                status,
                message: last
                    .and_then(|l| l.provider_message.clone())
                    .unwrap_or_else(|| e.to_string()),
                kind: "invalid_request_error",
                param: None,
                code: last.and_then(|l| l.provider_code.clone()),
                retry_after: None,
            }
        }
        TerminalReason::Stalled | TerminalReason::NoRunnableSource if is_rate_limited(e) => {
            let wait = retry_after.map_or(String::new(), |s| format!(" in about {s} s"));
            let mut err = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                "rate_limit_exceeded",
                format!(
                    "Rate limit reached: no source of this model could take the request within \
                     the proxy's wait ({reason}, {attempts} attempt(s) made); retry{wait}. {e}"
                ),
            );
            err.retry_after = Some(retry_after.unwrap_or(1));
            err
        }
        TerminalReason::DeadlineExceeded => {
            let last_text = match last {
                Some(l) => format!("; the last attempt error was: {l}"),
                None if attempts > 0 => "; the deadline cut the attempt still running".to_string(),
                None => "; no attempt could be sent (waiting for admission)".to_string(),
            };
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                reason.as_str(),
                format!(
                    "The call's deadline (CALL_DEADLINE_S) passed after {attempts} attempt(s){last_text} (logical call {})",
                    ctx.map_or("", |c| c.logical_call_id.as_str())
                ),
            )
        }
        TerminalReason::StructuredInvalid => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            reason.as_str(),
            e.to_string(),
        ),
        TerminalReason::RetryExhausted
        | TerminalReason::Stalled
        | TerminalReason::NoRunnableSource
        | TerminalReason::GovernanceBackend => ApiError {
            retry_after,
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                reason.as_str(),
                e.to_string(),
            )
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw::core::{FailureContext, SourceReasons};
    use polygw::AttemptError;

    fn ctx(reasons: &[(&str, SourceReason)], last: Option<AttemptError>) -> FailureContext {
        FailureContext {
            logical_call_id: "lc-1".into(),
            last_error: last.map(Box::new),
            reasons: reasons
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect::<SourceReasons>(),
            attempts: 1,
            retry_after: Some(Duration::from_millis(1500)),
            detail: None,
        }
    }

    fn rate_limited() -> AttemptError {
        AttemptError::new(ErrorClass::RateLimited, ErrorLabel::RateLimited, "429")
            .with_status(429)
            .with_retry_after(Some(Duration::from_secs(30)))
    }

    #[test]
    fn rejections_keep_the_upstream_status_and_code() {
        let rej = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "x")
            .with_status(413)
            .with_provider(
                Some("context_length_exceeded".into()),
                Some("too long".into()),
            );
        let e = from_gateway(&GatewayError::terminal(
            TerminalReason::Rejected,
            ctx(&[], Some(rej)),
        ));
        assert_eq!(
            (e.status, e.code.as_deref(), e.message.as_str()),
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                Some("context_length_exceeded"),
                "too long"
            )
        );
    }

    #[test]
    fn busy_sources_are_a_rate_limit_and_broken_ones_an_outage() {
        use RefusalReason as R;
        use SourceReason::{Failed, Refused};
        type Case<'a> = (
            TerminalReason,
            &'a [(&'a str, SourceReason)],
            Option<AttemptError>,
            u16,
        );
        let cases: &[Case] = &[
            // Every source cooling down on an upstream hint, or over quota: 429.
            (
                TerminalReason::Stalled,
                &[("a", Refused(R::Cooldown))],
                Some(rate_limited()),
                429,
            ),
            (
                TerminalReason::Stalled,
                &[("a", Failed(ErrorLabel::RateLimited))],
                None,
                429,
            ),
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Rpm)), ("b", Refused(R::Concurrency))],
                None,
                429,
            ),
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::ScopeTpm))],
                None,
                429,
            ),
            // A dead source does not turn a rate limit into an outage.
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Tpm)), ("b", Refused(R::Dead))],
                None,
                429,
            ),
            // No reasons, but the last attempt was a 429.
            (TerminalReason::Stalled, &[], Some(rate_limited()), 429),
            // Broken sources: 503.
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::CircuitOpen))],
                None,
                503,
            ),
            (
                TerminalReason::Stalled,
                &[("a", Failed(ErrorLabel::ServerError))],
                None,
                503,
            ),
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Cooldown)), ("b", Refused(R::CircuitOpen))],
                None,
                503,
            ),
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Dead))],
                None,
                503,
            ),
            (TerminalReason::Stalled, &[], None, 503),
            // Whatever the sources say, these are never rate limits.
            (
                TerminalReason::RetryExhausted,
                &[("a", Failed(ErrorLabel::RateLimited))],
                None,
                503,
            ),
            (
                TerminalReason::GovernanceBackend,
                &[("a", Refused(R::Rpm))],
                None,
                503,
            ),
            (
                TerminalReason::DeadlineExceeded,
                &[("a", Refused(R::Rpm))],
                None,
                504,
            ),
        ];
        for (reason, reasons, last, status) in cases {
            let e = from_gateway(&GatewayError::terminal(*reason, ctx(reasons, last.clone())));
            assert_eq!(e.status.as_u16(), *status, "{reason} {reasons:?}");
            match status {
                429 => {
                    assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
                    assert_eq!(e.retry_after, Some(2), "ceil(1.5 s)");
                }
                503 => {
                    assert_eq!(e.code.as_deref(), Some(reason.as_str()));
                    assert_eq!(e.retry_after, Some(2));
                }
                _ => {}
            }
        }
    }

    #[test]
    fn a_504_says_what_happened() {
        let mut c = ctx(&[], None);
        let e = from_gateway(&GatewayError::terminal(
            TerminalReason::DeadlineExceeded,
            c.clone(),
        ));
        assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(e.message.contains("after 1 attempt(s)"), "{}", e.message);
        assert!(
            e.message.contains("cut the attempt still running"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("no attempt made"), "{}", e.message);
        c.last_error = Some(Box::new(
            AttemptError::new(ErrorClass::Transient, ErrorLabel::ServerError, "HTTP 502")
                .with_status(502),
        ));
        c.attempts = 2;
        let e = from_gateway(&GatewayError::terminal(TerminalReason::DeadlineExceeded, c));
        assert!(e.message.contains("after 2 attempt(s)"), "{}", e.message);
        assert!(e.message.contains("HTTP 502"), "{}", e.message);
    }
}
