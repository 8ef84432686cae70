//! A small OTLP/HTTP receiver for the tests (SPEC §26.1): it decodes what polygw sends
//! with the official protobuf definitions (`opentelemetry-proto`) and keeps it. It can
//! answer slowly, to stand for a receiver that is overloaded.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// What the receiver got.
#[derive(Default)]
pub struct Received {
    pub spans: Vec<Span>,
    /// Metric names, once per data point set received.
    pub metrics: Vec<(String, Vec<KeyValue>)>,
    /// The resource's `service.name` of the last request.
    pub service: Option<String>,
    pub requests: usize,
}

pub struct Sink {
    pub endpoint: String,
    pub got: Arc<Mutex<Received>>,
}

/// A string attribute's value.
pub fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

pub fn str_attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    match attr(attrs, key) {
        Some(any_value::Value::StringValue(s)) => Some(s),
        _ => None,
    }
}

pub fn int_attr(attrs: &[KeyValue], key: &str) -> Option<i64> {
    match attr(attrs, key) {
        Some(any_value::Value::IntValue(i)) => Some(*i),
        _ => None,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn trace_id(s: &Span) -> String {
    hex(&s.trace_id)
}
pub fn span_id(s: &Span) -> String {
    hex(&s.span_id)
}
pub fn parent_id(s: &Span) -> String {
    hex(&s.parent_span_id)
}

impl Sink {
    /// A receiver on a free loopback port; each answer waits `delay`.
    pub async fn start(delay: Duration) -> Sink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let got: Arc<Mutex<Received>> = Arc::default();
        let g = got.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let g = g.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let g = g.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let body = req.into_body().collect().await.map(|b| b.to_bytes());
                            if let Ok(body) = body {
                                take(&g, &path, &body);
                            }
                            tokio::time::sleep(delay).await;
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Sink { endpoint, got }
    }

    /// Waits until `done` holds for what was received (at most 20 s).
    pub async fn wait(&self, what: &str, done: impl Fn(&Received) -> bool) {
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if done(&self.got.lock().unwrap()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "the OTLP receiver never got {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn take(g: &Mutex<Received>, path: &str, body: &[u8]) {
    let mut g = g.lock().unwrap();
    g.requests += 1;
    match path {
        "/v1/traces" => {
            let req = ExportTraceServiceRequest::decode(body).expect("OTLP traces protobuf");
            for rs in req.resource_spans {
                if let Some(r) = rs.resource {
                    g.service = str_attr(&r.attributes, "service.name").map(str::to_string);
                }
                for ss in rs.scope_spans {
                    g.spans.extend(ss.spans);
                }
            }
        }
        "/v1/metrics" => {
            use opentelemetry_proto::tonic::metrics::v1::metric::Data;
            let req = ExportMetricsServiceRequest::decode(body).expect("OTLP metrics protobuf");
            for rm in req.resource_metrics {
                for sm in rm.scope_metrics {
                    for m in sm.metrics {
                        let attrs = match &m.data {
                            Some(Data::Histogram(h)) => h
                                .data_points
                                .iter()
                                .flat_map(|p| p.attributes.clone())
                                .collect(),
                            Some(Data::Sum(s)) => s
                                .data_points
                                .iter()
                                .flat_map(|p| p.attributes.clone())
                                .collect(),
                            _ => Vec::new(),
                        };
                        g.metrics.push((m.name, attrs));
                    }
                }
            }
        }
        other => panic!("unexpected OTLP path {other}"),
    }
}
