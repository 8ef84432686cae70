//! The response headers polygw adds, as prepared [`HeaderName`]s: a `&str` name is
//! parsed and checked again on every insert (≈ 1 000 instructions each, a visible share
//! of a proxied call; docs/BENCHMARKS.md "Proxy overhead").

use axum::http::HeaderName;

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const X_LOGICAL_CALL_ID: HeaderName = HeaderName::from_static("x-polygw-logical-call-id");
pub const X_SOURCE: HeaderName = HeaderName::from_static("x-polygw-source");
pub const X_HEDGED: HeaderName = HeaderName::from_static("x-polygw-hedged");
pub const X_HEDGES: HeaderName = HeaderName::from_static("x-polygw-hedges");
pub const X_ATTEMPTS: HeaderName = HeaderName::from_static("x-polygw-attempts");
pub const X_USAGE_SOURCE: HeaderName = HeaderName::from_static("x-polygw-usage-source");
pub const X_TERMINAL_REASON: HeaderName = HeaderName::from_static("x-polygw-terminal-reason");
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
pub const X_UPSTREAM_REQUEST_ID: HeaderName =
    HeaderName::from_static("x-polygw-upstream-request-id");
pub const X_UNSUPPORTED_TOOLS: HeaderName = HeaderName::from_static("x-polygw-unsupported-tools");
pub const X_IGNORED_PARAMS: HeaderName = HeaderName::from_static("x-polygw-ignored-params");
/// What a source of another API could not be sent (SPEC §23.3): `api: field, …`.
pub const X_UNTRANSLATED: HeaderName = HeaderName::from_static("x-polygw-untranslated");
pub const X_RESUMES: HeaderName = HeaderName::from_static("x-polygw-resumes");
