//! The OTLP exporters' HTTP client: the workspace's reqwest (one TLS stack, one copy in
//! the tree), its requests run on the exporter's own runtime so that any thread — the
//! exporter's, or the SDK's periodic metric reader's — can wait for them.

use std::time::Duration;

use async_trait::async_trait;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};

/// Largest OTLP response body read (a partial-success answer is small).
const MAX_RESPONSE: usize = 1 << 20;

#[derive(Debug, Clone)]
pub(crate) struct Client {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

impl Client {
    pub(crate) fn new(runtime: tokio::runtime::Handle, timeout: Duration) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| format!("OpenTelemetry: cannot build its HTTP client: {e}"))?;
        Ok(Client { client, runtime })
    }
}

async fn send(
    client: reqwest::Client,
    request: Request<Bytes>,
) -> Result<Response<Bytes>, HttpError> {
    let (parts, body) = request.into_parts();
    let mut resp = client
        .request(parts.method, parts.uri.to_string())
        .headers(parts.headers)
        .body(body)
        .send()
        .await?;
    let status = resp.status();
    let headers = std::mem::take(resp.headers_mut());
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > MAX_RESPONSE {
            return Err(
                format!("the OTLP receiver answered more than {MAX_RESPONSE} bytes").into(),
            );
        }
        body.extend_from_slice(&chunk);
    }
    let mut out = Response::new(Bytes::from(body));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}

#[async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        self.runtime
            .spawn(send(self.client.clone(), request))
            .await
            .map_err(|e| -> HttpError { format!("the OTLP request was lost: {e}").into() })?
    }
}
