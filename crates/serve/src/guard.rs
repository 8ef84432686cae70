//! The router's middleware: client keys (`/v1/*`), the loopback checks of a keyless
//! proxy (`Host`, `Origin`, a JSON `Content-Type`), the request-target limit, and what
//! every answer gets — an `x-request-id`, and an OpenAI error body on every error
//! status (axum's own 404/405 included).

use std::sync::Arc;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::conn::{status_error, ConnCtx};
use crate::errors::{error_for_path, ApiError};
use crate::http::ensure_request_id;
use crate::keys::Lookup;
use crate::names;
use crate::state::State as AppState;

fn peer(req: &Request) -> Option<std::net::SocketAddr> {
    req.extensions().get::<Arc<ConnCtx>>().map(|c| c.peer)
}

/// The router's one middleware layer (one layer, not three: each costs a boxed
/// future and a clone of the service per request — issue 27): the request-target
/// limit, the loopback checks of a keyless proxy ([`keyless`]), client keys on every
/// `/v1/` path ([`authenticate`]); then on the way out an `x-request-id` on every
/// answer and an OpenAI body on every error answer that has none.
pub async fn front(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    let mut resp = if target > st.cfg.max_uri_bytes {
        st.counters.refused("uri_too_long");
        error_for_path(
            req.uri().path(),
            &ApiError::new(
                StatusCode::URI_TOO_LONG,
                "invalid_request_error",
                "uri_too_long",
                format!(
                    "the request target is {target} bytes; polygw serve accepts at most {}",
                    st.cfg.max_uri_bytes
                ),
            ),
        )
    } else if let Some(refused) = keyless(&st, &req) {
        refused
    } else if req.uri().path().starts_with("/v1/") {
        match authenticate(&st, req) {
            Ok(req) => next.run(req).await,
            Err(refused) => *refused,
        }
    } else {
        next.run(req).await
    };
    let status = resp.status();
    if (status.is_client_error() || status.is_server_error())
        && resp.body().size_hint().exact() == Some(0)
    {
        let e = status_error(status, 0);
        let (mut parts, _) = resp.into_parts();
        let body = e.body().to_string();
        parts.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        parts.headers.remove(header::CONTENT_LENGTH);
        resp = Response::from_parts(parts, Body::from(body));
    }
    if !resp.headers().contains_key(names::X_REQUEST_ID) {
        ensure_request_id(
            resp.headers_mut(),
            &polygw::CallOptions::new_logical_call_id(),
        );
    }
    resp
}

/// Whether a host name (no port) is loopback: `localhost`, `*.localhost`, 127/8, ::1.
fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if h.eq_ignore_ascii_case("localhost") || h.to_ascii_lowercase().ends_with(".localhost") {
        return true;
    }
    h.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// The host part of `host[:port]` (IPv6 in brackets).
fn host_part(hostport: &str) -> &str {
    if let Some(rest) = hostport.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    hostport.rsplit_once(':').map_or(hostport, |(h, p)| {
        if p.chars().all(|c| c.is_ascii_digit()) {
            h
        } else {
            hostport
        }
    })
}

fn forbidden(
    st: &AppState,
    path: &str,
    reason: &'static str,
    code: &str,
    message: String,
) -> Response {
    st.counters.refused(reason);
    error_for_path(
        path,
        &ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            code,
            message,
        ),
    )
}

/// Without client keys, a request must look like it comes from this machine: `Host`
/// a loopback name (or allowed), `Origin` absent or loopback (or allowed), and a POST
/// must carry a JSON `Content-Type` (a cross-site form cannot). This stops a web page
/// from calling a local proxy, also through DNS rebinding. The refusal, or `None`.
fn keyless(st: &AppState, req: &Request) -> Option<Response> {
    if st.asks_keys() {
        return None;
    }
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()));
    let Some(host) = host else {
        return Some(forbidden(
            st,
            req.uri().path(),
            "host",
            "forbidden_host",
            "a Host header is required".into(),
        ));
    };
    let host_ok = is_loopback_host(host_part(&host))
        || st
            .cfg
            .allowed_hosts
            .iter()
            .any(|a| a.eq_ignore_ascii_case(&host) || a.eq_ignore_ascii_case(host_part(&host)));
    if !host_ok {
        return Some(forbidden(
            st,
            req.uri().path(),
            "host",
            "forbidden_host",
            format!(
                "Host `{host}` is not served: without client keys (POLYGW_PROXY_KEYS) polygw \
                 serve answers loopback names only (add it with --allowed-host)"
            ),
        ));
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let o = origin.to_str().unwrap_or("");
        let authority = o.split_once("://").map(|(_, a)| a).unwrap_or("");
        let ok = (!authority.is_empty() && is_loopback_host(host_part(authority)))
            || st
                .cfg
                .allowed_origins
                .iter()
                .any(|a| a.eq_ignore_ascii_case(o));
        if !ok {
            return Some(forbidden(
                st,
                req.uri().path(),
                "origin",
                "forbidden_origin",
                format!(
                    "Origin `{o}` is not allowed: without client keys polygw serve answers \
                     pages of loopback origins only (add it with --allowed-origin)"
                ),
            ));
        }
    }
    if req.method() == Method::POST {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|ct| ct.split(';').next())
            .is_some_and(|m| {
                let m = m.trim();
                m.eq_ignore_ascii_case("application/json")
                    || (m.len() > 5 && m[m.len() - 5..].eq_ignore_ascii_case("+json"))
            });
        if !json {
            st.counters.refused("content_type");
            return Some(error_for_path(
                req.uri().path(),
                &ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "invalid_request_error",
                    "unsupported_media_type",
                    "without client keys polygw serve requires Content-Type: application/json",
                ),
            ));
        }
    }
    None
}

/// Which header carried the proxy's own key (the other one, when present, is the
/// client's own credential: [`client_credential`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProxyCredential {
    /// `Authorization: Bearer` (true) or `x-api-key`.
    pub bearer: bool,
}

/// The client's own credential for sources with `AUTH=client` (SPEC §23.1): the
/// `Authorization: Bearer` token or the `x-api-key` the client sent that is not the
/// proxy's key (`proxy`: which header was; `None` on a proxy without keys, where either
/// is the client's, the bearer first).
pub(crate) fn client_credential(
    headers: &axum::http::HeaderMap,
    proxy: Option<ProxyCredential>,
) -> Option<polygw::core::request::ClientCredential> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|v| !v.is_empty());
    let x_api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    let (is_bearer, value) = match proxy {
        None => bearer
            .map(|b| (true, b))
            .or(x_api_key.map(|x| (false, x)))?,
        Some(p) if p.bearer => (false, x_api_key?),
        Some(_) => (true, bearer?),
    };
    // The proxy's key sent in both headers is still the proxy's key.
    if proxy.is_some() && bearer == x_api_key {
        return None;
    }
    Some(polygw::core::request::ClientCredential {
        bearer: is_bearer,
        secret: polygw::core::secret::Secret::new(value),
    })
}

/// Client authentication of `/v1/*`: a bearer key of `client_keys`, compared in
/// constant time. Failures are counted and logged at a bounded rate. The request (with
/// its key-store key as an extension), or the refusal.
fn authenticate(st: &AppState, mut req: Request) -> Result<Request, Box<Response>> {
    if !st.asks_keys() {
        return Ok(req);
    }
    // `Authorization: Bearer <key>` (OpenAI's SDKs), or `x-api-key: <key>`
    // (Anthropic's: SPEC §18.2); either names the same client key. Both may come: the
    // one that is not the proxy's key is the client's own credential, for sources with
    // `AUTH=client` (SPEC §23.1).
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let x_api_key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    let has_header = bearer.or(x_api_key).is_some();
    let bearer_token = bearer.map(|v| {
        v.strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
            .unwrap_or("")
    });
    let candidates: Vec<(bool, Vec<u8>)> = [(true, bearer_token), (false, x_api_key)]
        .into_iter()
        .filter_map(|(b, v)| Some((b, v?.trim().as_bytes().to_vec())))
        .filter(|(_, v)| !v.is_empty())
        .collect();
    let mut revoked = None;
    let mut unavailable = false;
    for (is_bearer, given) in &candidates {
        let mut ok = subtle::Choice::from(0u8);
        for k in &st.keys {
            ok |= k.as_slice().ct_eq(given);
        }
        if bool::from(ok) {
            req.extensions_mut()
                .insert(ProxyCredential { bearer: *is_bearer });
            return Ok(req);
        }
        // A key of the key store (SPEC §21.1): looked up by its hash.
        if let Some(ring) = &st.cfg.key_ring {
            match ring.lookup(std::str::from_utf8(given).unwrap_or("")) {
                Lookup::Valid(k) => {
                    req.extensions_mut().insert(k);
                    req.extensions_mut()
                        .insert(ProxyCredential { bearer: *is_bearer });
                    return Ok(req);
                }
                Lookup::Revoked(id) => revoked = revoked.or(Some(id)),
                Lookup::Unavailable => unavailable = true,
                Lookup::Unknown => {}
            }
        }
    }
    let given = candidates
        .first()
        .map(|(_, g)| g.as_slice())
        .unwrap_or_default();
    let why = if !has_header {
        "no Authorization header"
    } else if revoked.is_some() {
        "revoked key"
    } else {
        "wrong key"
    };
    st.counters.auth_failed(peer(&req), why);
    if unavailable && revoked.is_none() && !given.is_empty() {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "key_store_unavailable",
            "the client keys could not be loaded yet: retry shortly",
        );
        e.retry_after = Some(2);
        return Err(Box::new(error_for_path(req.uri().path(), &e)));
    }
    let message = match revoked {
        Some(id) => format!("The API key {id} was revoked"),
        None => "Missing or invalid API key: send Authorization: Bearer <key> or x-api-key: <key> \
                 (a key of POLYGW_PROXY_KEYS or of polygw keys)"
            .to_string(),
    };
    Err(Box::new(error_for_path(
        req.uri().path(),
        &ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            message,
        ),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DECISIONS 174: only the credential that is not the proxy's key is the client's.
    #[test]
    fn the_client_credential_is_never_the_proxy_key() {
        let headers = |b: Option<&str>, x: Option<&str>| {
            let mut h = axum::http::HeaderMap::new();
            if let Some(b) = b {
                h.insert(
                    header::AUTHORIZATION,
                    format!("Bearer {b}").parse().unwrap(),
                );
            }
            if let Some(x) = x {
                h.insert("x-api-key", x.parse().unwrap());
            }
            h
        };
        let got = |h: &axum::http::HeaderMap, p: Option<ProxyCredential>| {
            client_credential(h, p).map(|c| (c.bearer, c.secret.expose().to_string()))
        };
        let by_bearer = Some(ProxyCredential { bearer: true });
        let by_x = Some(ProxyCredential { bearer: false });
        let both = headers(Some("proxy"), Some("mine"));
        assert_eq!(got(&both, by_bearer), Some((false, "mine".into())));
        assert_eq!(
            got(&headers(Some("mine"), Some("proxy")), by_x),
            Some((true, "mine".into()))
        );
        assert_eq!(got(&headers(Some("proxy"), None), by_bearer), None);
        assert_eq!(got(&headers(None, Some("proxy")), by_x), None);
        assert_eq!(got(&headers(Some("proxy"), Some("proxy")), by_bearer), None);
        // A proxy without keys: either header is the client's, the bearer first.
        assert_eq!(got(&both, None), Some((true, "proxy".into())));
        assert_eq!(
            got(&headers(None, Some("mine")), None),
            Some((false, "mine".into()))
        );
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "LOCALHOST",
            "app.localhost",
            "127.0.0.1",
            "127.5.6.7",
            "[::1]",
            "::1",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.example",
            "localhost.evil.example",
            "10.0.0.1",
            "0.0.0.0",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
        assert_eq!(host_part("localhost:8080"), "localhost");
        assert_eq!(host_part("[::1]:8080"), "::1");
        assert_eq!(host_part("example.com"), "example.com");
    }
}
