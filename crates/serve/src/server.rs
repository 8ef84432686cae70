//! [`serve`]: the proxy's router on a listener, as a hardened HTTP/1.1 server.
//!
//! - HTTP/1.1 only (hyper's server), keep-alive, `TCP_NODELAY`. HTTP/2 is not served:
//!   an HTTP/2 client gets an error instead of a connection that half works.
//! - Connection caps: beyond `max_connections` in total a new connection gets a 503,
//!   beyond `max_connections_per_client` from one address a 429, both in OpenAI's
//!   error format, then closed (never a silent accept queue that starves `/healthz`).
//! - Per connection: the header, idle and blocked-write limits of [`crate::conn`].
//! - Shutdown (a drain, SPEC §21.2): `/readyz` answers 503 `draining` from the first
//!   moment ([`Proxy::start_draining`]), the listener closes (new connections are
//!   refused: a load balancer's check fails and it sends elsewhere), every in-flight
//!   call and stream may finish for `grace` (kept-alive idle connections close at once,
//!   a busy one after its answer), then [`Proxy::cut`] — open streams get an error
//!   event, plain calls a 503 — and after a short flush whatever is left is dropped
//!   (every remaining call is cancelled).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, Request, StatusCode};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::Service;

use crate::config::ServerLimits;
use crate::conn::{raw_error_response, ConnIo, InFlight, IoLimits};
use crate::errors::ApiError;
use crate::metrics::ProxyCounters;
use crate::proxy::Proxy;

/// After the grace period, how long the last answers (error events, 503s) get to go
/// out before the connections are dropped.
const CUT_FLUSH: Duration = Duration::from_secs(2);

/// Connections being refused at a cap at once (each writes a short answer); beyond it
/// a refused connection is closed without one.
const MAX_REFUSING: usize = 256;

/// What a [`serve`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServeReport {
    /// Connections accepted (refused ones not counted).
    pub connections: u64,
    /// The grace period ended with calls still running (they were cut).
    pub cut: bool,
    /// Connections still open when the grace period ended (each with a call running:
    /// idle ones close at once): what was cut.
    pub cut_connections: usize,
    /// Connections still open after the final flush, dropped.
    pub dropped: usize,
}

/// The response body of a request, holding its in-flight mark until it is done.
struct GuardBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for GuardBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Open connections per client address.
#[derive(Default)]
struct PerClient(Mutex<HashMap<IpAddr, usize>>);

impl PerClient {
    fn enter(&self, ip: IpAddr, max: usize) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_default();
        if *n >= max {
            return false;
        }
        *n += 1;
        true
    }

    fn leave(&self, ip: IpAddr) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&ip);
            }
        }
    }
}

/// Resolves when every connection task has ended.
async fn all_done(conns: &mut JoinSet<()>) {
    while conns.join_next().await.is_some() {}
}

/// Undoes a connection's counts when its task ends.
struct ConnGuard {
    ip: IpAddr,
    per_client: Arc<PerClient>,
    counters: Arc<ProxyCounters>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.per_client.leave(self.ip);
        self.counters.gone();
    }
}

/// Answers a refused connection and closes it (lingering briefly so the client can
/// read the answer).
async fn refuse(mut tcp: TcpStream, e: ApiError) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = tcp.write_all(&raw_error_response(&e)).await;
        let _ = tcp.shutdown().await;
        let mut scratch = [0u8; 4096];
        let mut n = 0;
        while n < 64 * 1024 {
            match tcp.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k,
            }
        }
    })
    .await;
}

/// Serves `proxy` on `listener` until `shutdown` resolves, then shuts down within
/// `limits.grace` (see the module documentation).
pub async fn serve(
    listener: TcpListener,
    proxy: Proxy,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<ServeReport> {
    let router = proxy.router();
    let counters = proxy.counters().clone();
    let io_limits = IoLimits {
        header_timeout: limits.header_timeout,
        idle_timeout: limits.idle_timeout,
        max_header_bytes: limits.max_header_bytes,
    };
    let per_client = Arc::new(PerClient::default());
    let (drain_tx, drain_rx) = watch::channel(false);
    let mut conns: JoinSet<()> = JoinSet::new();
    let mut refusing: JoinSet<()> = JoinSet::new();
    let mut report = ServeReport::default();
    let mut accept_errors = 0u64;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            Some(_) = refusing.join_next(), if !refusing.is_empty() => {}
            r = listener.accept() => {
                let (tcp, peer) = match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: say so (rarely), and do
                        // not spin on the listener.
                        accept_errors += 1;
                        if accept_errors.is_power_of_two() {
                            tracing::warn!(error = %e, count = accept_errors, "accepting a connection failed");
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm
                // holds chunks back until the client's delayed ACK (~40 ms on Linux).
                let _ = tcp.set_nodelay(true);
                let refusal = if counters.open() >= limits.max_connections as u64 {
                    counters.connection("refused_total");
                    Some(ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "too_many_connections",
                        format!(
                            "polygw serve has {} connections open, the most it keeps \
                             (--max-connections); retry shortly",
                            limits.max_connections
                        ),
                    )
                    .with_retry_after(1))
                } else if !per_client.enter(peer.ip(), limits.max_connections_per_client) {
                    counters.connection("refused_per_client");
                    Some(ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "requests",
                        "too_many_connections",
                        format!(
                            "this client address has {} connections open, the most polygw \
                             serve keeps per client (--max-connections-per-client)",
                            limits.max_connections_per_client
                        ),
                    )
                    .with_retry_after(1))
                } else {
                    None
                };
                if let Some(e) = refusal {
                    if refusing.len() < MAX_REFUSING {
                        refusing.spawn(refuse(tcp, e));
                    }
                    continue;
                }
                counters.connection("accepted");
                counters.opened();
                report.connections += 1;
                let guard = ConnGuard {
                    ip: peer.ip(),
                    per_client: per_client.clone(),
                    counters: counters.clone(),
                };
                let (io, ctx) = ConnIo::new(tcp, peer, io_limits.clone(), counters.clone());
                let router = router.clone();
                let mut drain = drain_rx.clone();
                let max_buf = (limits.max_header_bytes + 16 * 1024).max(8 * 1024);
                conns.spawn(async move {
                    let _guard = guard;
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let ctx = ctx.clone();
                        let mut router = router.clone();
                        async move {
                            let in_flight = ctx.request_started(req.body().is_end_stream());
                            let mut req = req.map(Body::new);
                            req.extensions_mut().insert(ctx.clone());
                            let Ok(mut resp) = router.call(req).await;
                            if !ctx.body_is_done() {
                                // What follows on the wire is the rest of a body nobody
                                // read, not a request: this answer is the last.
                                ctx.close_after_answer();
                                resp.headers_mut()
                                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                            }
                            Ok::<_, Infallible>(resp.map(|inner| GuardBody {
                                inner,
                                _in_flight: in_flight,
                            }))
                        }
                    });
                    let mut b = hyper::server::conn::http1::Builder::new();
                    b.half_close(true).keep_alive(true).max_buf_size(max_buf);
                    let conn = b.serve_connection(TokioIo::new(io), svc);
                    tokio::pin!(conn);
                    tokio::select! {
                        r = conn.as_mut() => {
                            if let Err(e) = r {
                                tracing::debug!(error = %e, "connection ended with an error");
                            }
                        }
                        () = async { let _ = drain.wait_for(|d| *d).await; } => {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.await;
                        }
                    }
                });
            }
        }
    }
    proxy.start_draining();
    drop(listener);
    drain_tx.send_replace(true);
    refusing.abort_all();
    if tokio::time::timeout(limits.grace, all_done(&mut conns))
        .await
        .is_err()
    {
        report.cut = true;
        report.cut_connections = conns.len();
        // The report says it to the caller (`polygw serve` prints one line of it).
        tracing::info!(
            connections = conns.len(),
            "grace period over: ending the calls still running"
        );
        proxy.cut();
        if tokio::time::timeout(CUT_FLUSH, all_done(&mut conns))
            .await
            .is_err()
        {
            report.dropped = conns.len();
            conns.abort_all();
            while conns.join_next().await.is_some() {}
        }
    }
    Ok(report)
}
