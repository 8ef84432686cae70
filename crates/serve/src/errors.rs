//! A failed call as an HTTP answer (docs/SERVE.md, "Errors"): [`ApiError`], the
//! API-neutral description every route renders in its own shape (OpenAI's error object
//! for chat completions and Responses, Anthropic's for Messages), and
//! [`from_gateway`]: which terminal reasons are rate limits (429 with `Retry-After`),
//! which are unavailability (503), which are a source's misconfiguration (502), the
//! deadline (504, saying what happened), and rejections (the upstream's status).

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use polygw::core::{ErrorClass, RefusalReason, SourceReason};
use polygw::{ErrorLabel, GatewayError, TerminalReason};
use serde_json::{json, Value};

/// An error as the proxy answers it: an HTTP status and OpenAI's error fields (every
/// route renders these in its API's shape).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// `error.message`.
    pub message: String,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.param`: the request field at fault, when one is.
    pub param: Option<String>,
    /// `error.code`.
    pub code: Option<String>,
    /// `Retry-After` (seconds).
    pub retry_after: Option<u64>,
    /// `x-should-retry`: whether a client library's own retry can help (the OpenAI and
    /// Anthropic SDKs obey it). `None`: the header is not sent.
    pub should_retry: Option<bool>,
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn bad_request(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
            should_retry: None,
        }
    }

    /// An error with a status, a type and a code.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code.to_string()),
            retry_after: None,
            should_retry: None,
        }
    }

    /// With `Retry-After` (seconds).
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// With `param`.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// `Retry-After` and `x-should-retry` on an answer.
    pub fn set_headers(&self, h: &mut axum::http::HeaderMap) {
        if let Some(s) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(r) = self.should_retry {
            h.insert(
                crate::names::X_SHOULD_RETRY,
                HeaderValue::from_static(if r { "true" } else { "false" }),
            );
        }
    }
}

/// An OpenAI error as a response (status, JSON body, `Retry-After`, `x-should-retry`).
pub fn error_response(e: &ApiError) -> Response {
    let mut resp = (e.status, Json(e.body())).into_response();
    e.set_headers(resp.headers_mut());
    resp
}

/// `Retry-After` seconds for a duration: rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    (d.as_secs_f64().ceil() as u64).max(1)
}

/// The longest `Retry-After` a client library waits out on its own (the OpenAI SDKs
/// retry a 429 after its `Retry-After` only up to 60 s); beyond it, retrying soon cannot
/// help and the answer says so (`x-should-retry: false`).
pub const CLIENT_RETRY_HORIZON_S: u64 = 60;

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

/// SPEC §17.4: the call failed because the sources it could use are misconfigured —
/// every source reason is a dead source (401/403/404/402 `BREAKER__DEAD_AFTER` times),
/// or a source kept out of the call (a redirect, an answer over the size cap), and the
/// last error is one of those: a 502 that names the source and the upstream status,
/// not a retryable 503.
fn source_fault(e: &GatewayError) -> Option<String> {
    let ctx = e.context()?;
    let Some(last) = ctx.last_error.as_deref() else {
        // No attempt this call: every source was already out, marked dead by earlier
        // calls' 401/402/403/404 (SPEC §23.2: the sources' fault, not the client's).
        let dead: Vec<&str> = ctx
            .reasons
            .iter()
            .filter(|(_, r)| matches!(r, SourceReason::Refused(RefusalReason::Dead)))
            .map(|(s, _)| s.as_str())
            .collect();
        if dead.is_empty() || dead.len() != ctx.reasons.len() {
            return None;
        }
        return Some(format!(
            "The upstream source(s) `{}` cannot serve this call: each failed on its own \
             credentials, billing or model in an earlier call and is out until BREAKER__DEAD_S \
             passes; check its API_KEY and MODEL",
            dead.join("`, `")
        ));
    };
    let fault = last.class == ErrorClass::Dead || last.excludes_source;
    let only_faults = ctx.reasons.values().all(|r| {
        is_dead(r) || matches!(r, SourceReason::Failed(ErrorLabel::Invalid)) && last.excludes_source
    });
    if !fault || !only_faults {
        return None;
    }
    let source = ctx.last_source.as_deref().unwrap_or("a source");
    let status = last
        .http_status
        .map_or(String::new(), |s| format!(" HTTP {s}"));
    let what = last
        .provider_message
        .as_deref()
        .or(last.provider_code.as_deref())
        .unwrap_or(last.detail.as_str());
    let hint = if last.class == ErrorClass::Dead {
        "check its API_KEY and MODEL"
    } else if last.http_status.is_some_and(|s| (300..400).contains(&s)) {
        "check its BASE_URL (polygw does not follow redirects)"
    } else {
        "its answer is over polygw's size cap"
    };
    Some(format!(
        "The upstream source `{source}` cannot serve this call: it answered{status} ({what}); {hint}"
    ))
}

/// The answer to a failed call (SPEC §11, §15, §17):
///
/// | terminal reason | status |
/// |---|---|
/// | `rejected` | the upstream's 4xx status, code and message |
/// | `stalled`, `no_runnable_source` that [`is_rate_limited`] | 429 `rate_limit_exceeded` + `Retry-After` |
/// | a failure caused only by misconfigured sources (dead, redirecting, oversize) | 502 naming the source and the upstream status |
/// | other `stalled`, `no_runnable_source`; `retry_exhausted`; `governance_backend` | 503, the reason as code (+ `Retry-After` when known) |
/// | `deadline_exceeded` | 504, attempts made and the last error |
/// | `structured_invalid` | 502 |
///
/// `x-should-retry: false` goes with answers a client's own retry cannot fix soon
/// (a rejection, a misconfigured source, a `Retry-After` beyond
/// [`CLIENT_RETRY_HORIZON_S`]).
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
    let mut out = match reason {
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
                should_retry: Some(false),
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
        TerminalReason::RetryExhausted
        | TerminalReason::Stalled
        | TerminalReason::NoRunnableSource
            if source_fault(e).is_some() =>
        {
            ApiError {
                should_retry: Some(false),
                ..ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "upstream_misconfigured",
                    source_fault(e).unwrap_or_default(),
                )
            }
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
        // SPEC §25.4: a 503 always says when to come back, and once polygw made its own
        // attempts (and retries, as far as the throttle allowed) a client library's
        // retry would only multiply the outage: `x-should-retry: false`.
        TerminalReason::RetryExhausted
        | TerminalReason::Stalled
        | TerminalReason::NoRunnableSource => ApiError {
            retry_after: Some(retry_after.unwrap_or(1)),
            should_retry: (attempts > 0).then_some(false),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                reason.as_str(),
                e.to_string(),
            )
        },
        TerminalReason::GovernanceBackend => ApiError {
            retry_after,
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                reason.as_str(),
                e.to_string(),
            )
        },
    };
    if out.retry_after.is_some_and(|s| s > CLIENT_RETRY_HORIZON_S) {
        out.should_retry = Some(false);
    }
    out
}

/// SPEC §21.1, §24.2: a client key's refusal as the proxy answers it, before any source
/// is asked: 429 with `Retry-After` (the refusal's hint: the window's expiry, the
/// earliest lease end, the budget period's end, or a second when calls in flight hold the
/// budget) and a body whose `code` is the reason (`key_rpm`, `key_tpm`,
/// `key_concurrency`, `key_budget_day`, `key_budget_month`) and whose message names the
/// key, its limit and when it resets (UTC). `x-should-retry` is false beyond a client
/// library's horizon and for a budget spent for its period; true for a budget held by
/// calls in flight. A call that can never pass (a reservation above the budget itself,
/// an estimate above the TPM) is a 403 with `x-should-retry: false`, as is
/// `key_budget_unpriced` (a budgeted key on a scope without prices cannot be served until
/// the operator sets prices). `now_unix_ms` is the proxy's clock.
pub fn from_key_refusal(
    r: &polygw::core::ports::Refusal,
    key: &polygw::core::ports::KeyAcquire<'_>,
    now_unix_ms: u64,
) -> ApiError {
    use polygw::core::client_key::format_nanos;
    use polygw::core::key_quota::format_utc;
    let id = key.key_id;
    let reset = r.retry_after.map(|d| {
        let at = now_unix_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        // To the nearest whole second: the limiter decided a moment before `now` (on its
        // own clock: Redis's, for a shared one), so `at` is a few milliseconds past the
        // instant it meant; a period's end is on a whole second. Rounding up made a day's
        // end read 00:00:01 whenever the two readings straddled a second.
        format_utc(at.saturating_add(500) / 1000 * 1000)
    });
    let resets = reset.as_deref().map_or_else(
        || "it cannot pass: retrying will not help".to_string(),
        |t| format!("resets at {t}"),
    );
    let budget = |b: Option<u64>| b.map_or_else(|| "?".to_string(), format_nanos);
    let (kind, message) = match r.reason {
        RefusalReason::KeyRpm => (
            "requests",
            format!("client key {id} reached its limit of {} requests per minute; {resets}", key.rpm),
        ),
        RefusalReason::KeyTpm => (
            "tokens",
            format!("client key {id} reached its limit of {} tokens per minute; {resets}", key.tpm),
        ),
        RefusalReason::KeyConcurrency => (
            "requests",
            format!(
                "client key {id} has {} calls in flight, its limit; {resets}",
                key.max_concurrency
            ),
        ),
        RefusalReason::KeyBudgetDay => (
            "insufficient_quota",
            format!(
                "client key {id} reached its budget of {} per day (UTC; this call reserves {}); {resets}",
                budget(key.budget_day_nanos),
                format_nanos(key.reserve_nanos)
            ),
        ),
        RefusalReason::KeyBudgetMonth => (
            "insufficient_quota",
            format!(
                "client key {id} reached its budget of {} per month (UTC; this call reserves {}); {resets}",
                budget(key.budget_month_nanos),
                format_nanos(key.reserve_nanos)
            ),
        ),
        RefusalReason::KeyBudgetUnpriced => {
            let mut e = ApiError::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                r.reason.as_str(),
                format!(
                    "client key {id} has a spend budget but this model's sources have no prices: \
                     what the call would cost cannot be known, so it is not served"
                ),
            );
            e.should_retry = Some(false);
            return e;
        }
        other => ("requests", format!("client key {id} refused: {other}")),
    };
    // SPEC §24.2: a call that can never pass (above the key's limit itself) is a 403; a
    // budget spent for its period a 429 until the reset, not for a client library to
    // retry; a budget held only by calls in flight a 429 with a short Retry-After.
    let Some(after) = r.retry_after else {
        let mut e = ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            r.reason.as_str(),
            message,
        );
        e.should_retry = Some(false);
        return e;
    };
    let budget = matches!(
        r.reason,
        RefusalReason::KeyBudgetDay | RefusalReason::KeyBudgetMonth
    );
    let in_flight = budget
        && after == std::time::Duration::from_millis(polygw::core::key_quota::IN_FLIGHT_RETRY_MS);
    let message = if in_flight {
        format!("{message}; calls of this key in flight hold the rest of its budget: retry when they settle")
    } else {
        message
    };
    let mut e = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        kind,
        r.reason.as_str(),
        message,
    );
    let secs = retry_after_secs(after);
    e.retry_after = Some(secs);
    e.should_retry = Some(if budget {
        in_flight
    } else {
        secs <= CLIENT_RETRY_HORIZON_S
    });
    e
}

/// An error in Anthropic's shape (`{"type":"error","error":{"type","message"}}`) and
/// status (a 503 of polygw is Anthropic's 529 `overloaded_error`), with `Retry-After`
/// and `x-should-retry`: every answer of `/v1/messages*`, the guards' refusals included.
pub(crate) fn anthropic_error(e: &ApiError) -> Response {
    let (status, body) = polygw_dialects::messages::error_body(e.status.as_u16(), &e.message);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, Json(body)).into_response();
    e.set_headers(resp.headers_mut());
    with_reason_phrase(&mut resp);
    resp
}

/// A status without a canonical reason phrase (Anthropic's 529) gets one on the status
/// line (SPEC §25.5): hyper writes `<none>` otherwise, and some clients log that.
pub(crate) fn with_reason_phrase(resp: &mut Response) {
    if resp.status().canonical_reason().is_some() {
        return;
    }
    let phrase: &'static [u8] = match resp.status().as_u16() {
        529 => b"Overloaded",
        _ => b"Unknown",
    };
    resp.extensions_mut()
        .insert(hyper::ext::ReasonPhrase::from_static(phrase));
}

/// `e` in the shape of the API that `path` belongs to: Anthropic's under `/v1/messages`,
/// OpenAI's elsewhere (the guards answer before any route runs).
pub(crate) fn error_for_path(path: &str, e: &ApiError) -> Response {
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        anthropic_error(e)
    } else {
        error_response(e)
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
            last_source: Some("a".into()),
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

    /// SPEC §21.1: a key's refusal is a 429 naming the key, its limit and its reset, with
    /// `Retry-After`; an unpriced budget a 403.
    #[test]
    fn key_refusals_are_429_naming_the_limit_and_reset() {
        use polygw::core::ports::{KeyAcquire, Refusal};
        let key = KeyAcquire {
            key_id: "key_1",
            rpm: 60,
            tpm: 0,
            max_concurrency: 0,
            budget_day_nanos: Some(25_000_000_000),
            budget_month_nanos: None,
            est_tokens: 0,
            reserve_nanos: 1_500_000,
            lease: Duration::from_secs(60),
            top_up: false,
        };
        let now = 1_706_745_540_000; // 2024-01-31T23:59:00Z
        let refusal = |reason, secs: Option<u64>| Refusal {
            reason,
            retry_after: secs.map(Duration::from_secs),
        };
        let e = from_key_refusal(&refusal(RefusalReason::KeyRpm, Some(12)), &key, now);
        assert_eq!(
            (e.status, e.code.as_deref()),
            (StatusCode::TOO_MANY_REQUESTS, Some("key_rpm"))
        );
        assert_eq!((e.retry_after, e.should_retry), (Some(12), Some(true)));
        assert!(
            e.message.contains("key_1") && e.message.contains("60 requests per minute"),
            "{}",
            e.message
        );
        assert!(
            e.message.contains("resets at 2024-01-31T23:59:12Z"),
            "{}",
            e.message
        );
        let e = from_key_refusal(&refusal(RefusalReason::KeyBudgetDay, Some(60)), &key, now);
        assert_eq!(
            (e.status, e.code.as_deref(), e.kind),
            (
                StatusCode::TOO_MANY_REQUESTS,
                Some("key_budget_day"),
                "insufficient_quota"
            )
        );
        assert!(e.message.contains("budget of 25 per day"), "{}", e.message);
        assert!(
            e.message.contains("resets at 2024-02-01T00:00:00Z"),
            "{}",
            e.message
        );
        let mut h = axum::http::HeaderMap::new();
        e.set_headers(&mut h);
        assert_eq!(h[header::RETRY_AFTER], "60");
        // The limiter decided at 23:59:00.999 (a day's end 59.001 s away); the proxy read
        // its clock 3 ms later, in the next second: the reset is still midnight, not 00:00:01.
        let late = Refusal {
            reason: RefusalReason::KeyBudgetDay,
            retry_after: Some(Duration::from_millis(59_001)),
        };
        for proxy_now in [now + 1_002, now + 999, now + 1_400] {
            let e = from_key_refusal(&late, &key, proxy_now);
            assert!(
                e.message.contains("resets at 2024-02-01T00:00:00Z"),
                "{proxy_now}: {}",
                e.message
            );
        }
        // beyond the client's horizon, or never: no client retry
        let e = from_key_refusal(
            &refusal(RefusalReason::KeyBudgetMonth, Some(86_400)),
            &key,
            now,
        );
        assert_eq!(e.should_retry, Some(false));
        // Never (a reservation above the budget itself): 403, no retry.
        let e = from_key_refusal(&refusal(RefusalReason::KeyBudgetDay, None), &key, now);
        assert_eq!(
            (e.status, e.retry_after, e.should_retry),
            (StatusCode::FORBIDDEN, None, Some(false))
        );
        assert!(e.message.contains("cannot pass"), "{}", e.message);
        // Spent for the day, even a minute before its end: no client retry.
        let e = from_key_refusal(&refusal(RefusalReason::KeyBudgetDay, Some(30)), &key, now);
        assert_eq!((e.retry_after, e.should_retry), (Some(30), Some(false)));
        // Held by calls in flight: a short Retry-After, and a retry may pass.
        let held = Refusal {
            reason: RefusalReason::KeyBudgetDay,
            retry_after: Some(Duration::from_millis(
                polygw::core::key_quota::IN_FLIGHT_RETRY_MS,
            )),
        };
        let e = from_key_refusal(&held, &key, now);
        assert_eq!(
            (e.status, e.retry_after, e.should_retry),
            (StatusCode::TOO_MANY_REQUESTS, Some(1), Some(true))
        );
        assert!(e.message.contains("in flight"), "{}", e.message);
        let e = from_key_refusal(&refusal(RefusalReason::KeyBudgetUnpriced, None), &key, now);
        assert_eq!(
            (e.status, e.code.as_deref()),
            (StatusCode::FORBIDDEN, Some("key_budget_unpriced"))
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
            // Only a dead source, and the last error its 401: a misconfiguration (502).
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Dead))],
                Some(
                    AttemptError::new(ErrorClass::Dead, ErrorLabel::Dead, "HTTP 401")
                        .with_status(401),
                ),
                502,
            ),
            // Every source already out, dead after earlier calls: no attempt, still 502.
            (
                TerminalReason::NoRunnableSource,
                &[("a", Refused(R::Dead))],
                None,
                502,
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
                502 => {
                    assert_eq!(e.code.as_deref(), Some("upstream_misconfigured"));
                    assert!(
                        e.message.contains("`a`")
                            && (last.is_none() || e.message.contains("HTTP 401")),
                        "{}",
                        e.message
                    );
                    assert_eq!(e.should_retry, Some(false));
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
