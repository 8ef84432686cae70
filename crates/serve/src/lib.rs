//! polygw-serve: polygw's OpenAI-compatible proxy as a library (SPEC §11, §15).
//!
//! - [`router`] (or [`Proxy::router`]) builds an axum [`Router`](axum::Router) over
//!   [`Scope`]s: `POST /v1/chat/completions` (plain and streamed passthrough),
//!   `POST /v1/responses` (OpenAI's Responses API, with `GET`/`DELETE
//!   /v1/responses/{id}`), `POST /v1/messages` and `/v1/messages/count_tokens`
//!   (Anthropic's Messages API), `POST /v1/embeddings` (float and base64),
//!   `GET /v1/models`, `GET /v1/models/{id}`, `GET /healthz` (liveness), `GET /readyz`
//!   (readiness: not draining, governance reachable, telemetry writable), `GET
//!   /metrics`. Mount it in any axum or hyper server.
//! - [`serve`] runs it on a listener as a hardened HTTP/1.1 server: header, idle and
//!   write timeouts, a header-size limit, total and per-client connection caps,
//!   OpenAI-format bodies on every error (the server's own included), and a shutdown
//!   whose grace period ends open streams with an error event.
//!
//! ```no_run
//! use polygw::GatewayClient;
//! use polygw_serve::{ProxyConfig, Scope, ServerLimits};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let chat = GatewayClient::from_env("LLM").await?;
//! let proxy = polygw_serve::Proxy::new(ProxyConfig::default(), vec![Scope::chat(chat)]);
//! // Mounted under a service's own router…
//! let app = axum::Router::new()
//!     .route("/status", axum::routing::get(|| async { "ok" }))
//!     .merge(proxy.router());
//! # let _ = app;
//! // …or served on its own, hardened.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! polygw_serve::serve(listener, proxy, ServerLimits::default(), async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(()) }
//! ```
//!
//! Every header, limit and status the proxy uses is listed in `docs/SERVE.md`.

mod affinity;
mod attribution;
mod config;
mod conn;
mod errors;
mod guard;
mod http;
pub mod keys;
mod metrics;
mod names;
mod openai;
mod proxy;
mod ready;
mod route;
mod scope;
mod server;
mod state;
mod stream;

pub use config::{default_max_connections, ProxyConfig, ServerLimits};
pub use errors::{error_response, from_gateway, is_rate_limited, retry_after_secs, ApiError};
pub use metrics::ProxyCounters;
pub use openai::{
    base64_vector, completion_json, count_json_values, json_value_budget, parse_chat,
    parse_embeddings, Encoding, ParsedChat, ParsedEmbeddings,
};
pub use proxy::Proxy;
pub use ready::{CHECK_TIMEOUT as READY_CHECK_TIMEOUT, REUSE as READY_REUSE};
pub use scope::{glob_matches, Scope, ScopeClient};
pub use server::{serve, ServeReport};

/// The proxy's router over these scopes (same as `Proxy::new(config, scopes).router()`).
pub fn router(config: ProxyConfig, scopes: Vec<Scope>) -> axum::Router {
    Proxy::new(config, scopes).router()
}
