//! Admin routes (SPEC §26.3), behind `POLYGW_ADMIN_KEY` ([`crate::ProxyConfig::admin_key`]):
//! the live state of every source as JSON (`GET /admin/status`) and as one status page
//! that a browser renders and refreshes by itself (`GET /admin`: no build step, no
//! external asset), a breaker reset and the drain of a source
//! (`POST /admin/scopes/{scope}/sources/{source}/reset|drain|undrain`).
//!
//! Without an admin key every admin route answers 404, as an unknown route does; a
//! missing or wrong key gets 401 with `WWW-Authenticate: Basic` (a browser asks for it:
//! any user name, the key as the password) — the key also passes as
//! `Authorization: Bearer`. Compared in constant time; never logged.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use crate::errors::{error_response, ApiError};
use crate::scope::ScopeClient;
use crate::state::State as AppState;

/// The admin key a request carries (`Authorization: Bearer KEY` or `Basic` with the key
/// as the password).
fn presented(headers: &HeaderMap) -> Option<Vec<u8>> {
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = auth.split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.trim().as_bytes().to_vec());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()?;
        let colon = raw.iter().position(|b| *b == b':')?;
        return Some(raw[colon + 1..].to_vec());
    }
    None
}

/// `None` when the request may go on; else the 404 (no admin key configured) or 401.
fn refused(st: &AppState, headers: &HeaderMap) -> Option<Response> {
    let Some(key) = &st.cfg.admin_key else {
        return Some(not_found());
    };
    let want = key.expose().trim().as_bytes();
    let ok = presented(headers).is_some_and(|got| !want.is_empty() && bool::from(got.ct_eq(want)));
    if ok {
        return None;
    }
    st.counters.refused("admin_key");
    let mut resp = error_response(&ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_admin_key",
        "The admin routes need POLYGW_ADMIN_KEY: `Authorization: Bearer <key>`, or Basic \
         with the key as the password",
    ));
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"polygw admin\", charset=\"UTF-8\""),
    );
    Some(resp)
}

fn not_found() -> Response {
    error_response(&ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "Unknown route",
    ))
}

/// Every served chat scope's status, and the proxy's own flags.
async fn status_json(st: &AppState) -> Result<Value, ApiError> {
    let mut scopes = Vec::new();
    for s in st.scopes().iter() {
        if let ScopeClient::Chat(c) = &s.scope.client {
            let status = c.status().await.map_err(|e| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "governance_backend",
                    format!(
                        "the governance backend of scope {} failed: {e}",
                        s.scope.name
                    ),
                )
            })?;
            scopes.push(status);
        }
    }
    Ok(json!({
        "draining": st.ready.is_draining(),
        "scopes": scopes,
    }))
}

/// `GET /admin/status`.
pub async fn status(State(st): State<Arc<AppState>>, req: Request) -> Response {
    if let Some(r) = refused(&st, req.headers()) {
        return r;
    }
    match status_json(&st).await {
        Ok(v) => no_store(Json(v).into_response()),
        Err(e) => error_response(&e),
    }
}

/// `GET /admin`: the status page, with the state at this moment inside it (it renders
/// without a request of its own) and a script that refreshes it every two seconds.
pub async fn page(State(st): State<Arc<AppState>>, req: Request) -> Response {
    if let Some(r) = refused(&st, req.headers()) {
        return r;
    }
    let data = match status_json(&st).await {
        Ok(v) => v,
        Err(e) => json!({"error": e.message}),
    };
    // Inside a <script> element: no `</` may end it early.
    let embedded = data.to_string().replace("</", "<\\/");
    let html = PAGE.replace("__POLYGW_STATUS__", &embedded);
    let mut resp = ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response();
    resp.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
        ),
    );
    no_store(resp)
}

fn no_store(mut r: Response) -> Response {
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `POST /admin/scopes/{scope}/sources/{source}/{action}`: `reset`, `drain`, `undrain`.
pub async fn act(
    State(st): State<Arc<AppState>>,
    Path((scope, source, action)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    if let Some(r) = refused(&st, req.headers()) {
        return r;
    }
    let bad = |status, code: &str, message: String| {
        error_response(&ApiError::new(
            status,
            "invalid_request_error",
            code,
            message,
        ))
    };
    let all = st.scopes();
    let Some(served) = all
        .iter()
        .find(|s| s.scope.name.eq_ignore_ascii_case(&scope))
    else {
        return bad(
            StatusCode::NOT_FOUND,
            "scope_not_found",
            format!(
                "no scope `{}` (scopes: {})",
                scope.chars().take(64).collect::<String>(),
                all.iter()
                    .map(|s| s.scope.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    };
    let ScopeClient::Chat(client) = &served.scope.client else {
        return bad(
            StatusCode::NOT_FOUND,
            "scope_not_found",
            format!("scope `{}` is not a chat scope", served.scope.name),
        );
    };
    let done = match action.as_str() {
        "reset" => client.reset_breaker(&source).await,
        "drain" => client.set_drained(&source, true).await,
        "undrain" => client.set_drained(&source, false).await,
        other => {
            return bad(
                StatusCode::NOT_FOUND,
                "unknown_action",
                format!(
                    "no action `{}`: reset, drain or undrain",
                    other.chars().take(32).collect::<String>()
                ),
            )
        }
    };
    match done {
        Ok(()) => no_store(
            Json(
                json!({"ok": true, "scope": served.scope.name, "source": source, "action": action}),
            )
            .into_response(),
        ),
        Err(e @ polygw::admin::AdminError::UnknownSource { .. }) => {
            bad(StatusCode::NOT_FOUND, "source_not_found", e.to_string())
        }
        Err(e) => error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "governance_backend",
            e.to_string(),
        )),
    }
}

/// The status page: one table per scope, a row per source, its state coloured, the
/// thresholds in force and their evidence, and the actions. Plain HTML, CSS and
/// JavaScript, nothing loaded from elsewhere.
const PAGE: &str = r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>polygw — sources</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table { border-collapse: collapse; } th, td { padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: left; }
.state { font-weight: 600; padding: 2px 6px; border-radius: 4px; }
.closed { background: #d8f5d8; } .open, .dead { background: #f8d0d0; } .half_open, .cooling_down { background: #fbeec6; } .drained { background: #ddd; }
.meta { color: #666; } button { margin-right: 4px; }
</style>
</head>
<body>
<h1>polygw — sources <span id="updated" class="meta"></span></h1>
<div id="draining"></div>
<div id="scopes"></div>
<script>
let data = __POLYGW_STATUS__;
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function thr(t) {
  if (t.ms === null || t.ms === undefined) return t.origin;
  const prior = t.prior_bp ? `, prior ${Math.round(t.prior_bp / 100)} %` : "";
  return `${(t.ms / 1000).toFixed(2)} s (${t.origin}${prior})`;
}
function act(scope, source, action) {
  fetch(`/admin/scopes/${encodeURIComponent(scope)}/sources/${encodeURIComponent(source)}/${action}`,
        {method: "POST", headers: {"content-type": "application/json"}, body: "{}", credentials: "same-origin"})
    .then(refresh);
}
function render() {
  const root = document.getElementById("scopes");
  root.replaceChildren();
  document.getElementById("updated").textContent = "· " + new Date().toLocaleTimeString();
  document.getElementById("draining").textContent = data.draining ? "This replica is draining." : "";
  if (data.error) { root.append(el("p", {}, "error: " + data.error)); return; }
  for (const s of data.scopes) {
    root.append(el("h2", {}, s.scope));
    root.append(el("p", {class: "meta"}, s.hedging));
    root.append(el("p", {class: "meta"},
      `retry throttle ${s.retry_throttle[0].toFixed(1)} of ${s.retry_throttle[1]} tokens · affinity ${s.affinity.mode}: ${s.affinity.hits} hits, ${s.affinity.misses} misses, ${s.affinity.moved} moved`));
    const head = el("tr", {}, ...["source", "model", "state", "failures", "in flight", "limits (rpm/tpm/conc.)",
      "first token (streams)", "stall", "evidence (streamed legs)", ""].map(h => el("th", {}, h)));
    const table = el("table", {}, head);
    for (const src of s.sources) {
      const state = el("span", {class: "state " + src.state, "data-source": src.name}, src.state.replace("_", " "));
      const until = src.for_s !== null ? ` ${src.for_s.toFixed(1)} s` : "";
      const actions = el("td", {});
      actions.append(el("button", {"data-action": "reset"}, "reset breaker"));
      actions.append(el("button", {"data-action": src.state === "drained" ? "undrain" : "drain"},
        src.state === "drained" ? "bring back" : "drain"));
      for (const b of actions.querySelectorAll("button")) b.onclick = () => act(s.scope, src.name, b.dataset.action);
      table.append(el("tr", {id: `${s.scope}/${src.name}`},
        el("td", {}, src.name), el("td", {}, src.model),
        el("td", {}, state, until), el("td", {}, src.consecutive_failures), el("td", {}, src.in_flight),
        el("td", {}, src.limits.join(" / ")), el("td", {}, thr(src.first_token)), el("td", {}, thr(src.stall)),
        el("td", {}, `${src.evidence.first_tokens} first tokens, ${src.evidence.cut_before_first_token} cut, ${src.evidence.gaps} gaps`),
        actions));
    }
    root.append(table);
  }
  console.log("polygw-admin rendered " + data.scopes.map(s => s.sources.map(x => s.scope + "/" + x.name + "=" + x.state).join(" ")).join(" "));
}
function refresh() {
  return fetch("/admin/status", {credentials: "same-origin"})
    .then(r => r.ok ? r.json() : Promise.reject(r.status))
    .then(d => { data = d; render(); })
    .catch(e => { document.getElementById("updated").textContent = "· refresh failed: " + e; });
}
render();
setInterval(refresh, 2000);
</script>
</body>
</html>
"##;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_passes_as_bearer_or_as_a_basic_password() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            m
        };
        assert_eq!(presented(&h("Bearer k1")), Some(b"k1".to_vec()));
        let basic = base64::engine::general_purpose::STANDARD.encode("admin:k:2");
        assert_eq!(
            presented(&h(&format!("Basic {basic}"))),
            Some(b"k:2".to_vec())
        );
        assert_eq!(presented(&h("Basic !!!")), None);
        assert_eq!(presented(&h("Digest x")), None);
        assert_eq!(presented(&HeaderMap::new()), None);
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for needle in ["http://", "https://", "src=", "<link", "import "] {
            assert!(!PAGE.contains(needle), "{needle}");
        }
        assert!(PAGE.contains("__POLYGW_STATUS__"));
    }
}
