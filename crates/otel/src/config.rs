//! The standard `OTEL_*` variables polygw reads (SPEC §26.1), checked: a value polygw
//! cannot honour is an error that names it, never a silent fallback.

use std::time::Duration;

use polygw_core::otel::Sampler;

/// The only OTLP protocol polygw speaks.
pub const PROTOCOL: &str = "http/protobuf";

/// What `OTEL_*` says.
#[derive(Debug, Clone, PartialEq)]
pub struct OtelConfig {
    /// Export spans (`OTEL_TRACES_EXPORTER` is not `none`).
    pub traces: bool,
    /// Export metrics (`OTEL_METRICS_EXPORTER` is not `none`).
    pub metrics: bool,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` +
    /// `/v1/traces`.
    pub traces_endpoint: String,
    /// The same for metrics (`/v1/metrics`).
    pub metrics_endpoint: String,
    /// `OTEL_EXPORTER_OTLP_HEADERS` (per-signal variables win), as pairs.
    pub traces_headers: Vec<(String, String)>,
    /// The same for metrics.
    pub metrics_headers: Vec<(String, String)>,
    /// `OTEL_EXPORTER_OTLP_TIMEOUT` (default 10 s).
    pub timeout: Duration,
    /// `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`.
    pub sampler: Sampler,
    /// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
    pub capture_content: bool,
    /// `OTEL_BSP_MAX_QUEUE_SIZE`: finished calls waiting for export (default 2048);
    /// beyond it a call is dropped, counted.
    pub queue: usize,
    /// `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`: spans per export request (default 512).
    pub batch: usize,
    /// `OTEL_BSP_SCHEDULE_DELAY`: the longest a span waits for its batch (default 5 s).
    pub delay: Duration,
    /// `OTEL_METRIC_EXPORT_INTERVAL` (default 60 s).
    pub metric_interval: Duration,
    /// `OTEL_SERVICE_NAME`, else `service.name` of `OTEL_RESOURCE_ATTRIBUTES`, else
    /// `polygw`.
    pub service_name: String,
    /// `OTEL_RESOURCE_ATTRIBUTES` (without `service.name`).
    pub resource: Vec<(String, String)>,
}

fn get(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    env(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn number<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    name: &str,
    default: T,
    ok: impl Fn(&T) -> bool,
) -> Result<T, String> {
    match get(env, name) {
        None => Ok(default),
        Some(v) => match v.parse::<T>() {
            Ok(n) if ok(&n) => Ok(n),
            _ => Err(format!("{name}={v:?} is not a valid value")),
        },
    }
}

/// `k=v,k2=v2` with percent-encoded values, as the OTLP exporter specification says.
fn pairs(name: &str, raw: Option<String>) -> Result<Vec<(String, String)>, String> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| format!("{name}: entry {:?} is not key=value", p.trim()))?;
            let k = k.trim();
            if k.is_empty() {
                return Err(format!("{name}: an entry has an empty key"));
            }
            Ok((k.to_string(), percent_decode(v.trim())))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
            if let Ok(x) = u8::from_str_radix(hex, 16) {
                out.push(x);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn endpoint(env: &dyn Fn(&str) -> Option<String>, signal_var: &str, path: &str) -> Option<String> {
    if let Some(e) = get(env, signal_var) {
        return Some(e);
    }
    let base = get(env, "OTEL_EXPORTER_OTLP_ENDPOINT")?;
    Some(format!("{}/{path}", base.trim_end_matches('/')))
}

fn exporter_on(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<bool, String> {
    match get(env, var).as_deref() {
        None | Some("otlp") => Ok(true),
        Some("none") => Ok(false),
        Some(other) => Err(format!(
            "{var}={other:?}: polygw exports over OTLP only (otlp or none)"
        )),
    }
}

fn protocol(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<(), String> {
    match get(env, var).as_deref() {
        None | Some(PROTOCOL) => Ok(()),
        Some(other) => Err(format!(
            "{var}={other:?}: polygw exports OTLP over {PROTOCOL} only; unset it or set {PROTOCOL}"
        )),
    }
}

impl OtelConfig {
    /// Reads the variables through `env`. `Ok(None)`: OpenTelemetry is off (no OTLP
    /// endpoint is set, `OTEL_SDK_DISABLED=true`, or both exporters are `none`).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<OtelConfig>, String> {
        if get(env, "OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let traces_endpoint = endpoint(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "v1/traces");
        let metrics_endpoint = endpoint(env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "v1/metrics");
        let traces = exporter_on(env, "OTEL_TRACES_EXPORTER")? && traces_endpoint.is_some();
        let metrics = exporter_on(env, "OTEL_METRICS_EXPORTER")? && metrics_endpoint.is_some();
        if !traces && !metrics {
            return Ok(None);
        }
        protocol(env, "OTEL_EXPORTER_OTLP_PROTOCOL")?;
        protocol(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")?;
        protocol(env, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")?;
        for e in [&traces_endpoint, &metrics_endpoint].into_iter().flatten() {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!(
                    "the OTLP endpoint {e:?} is not an http:// or https:// URL"
                ));
            }
        }
        let headers = get(env, "OTEL_EXPORTER_OTLP_HEADERS");
        let traces_headers = pairs(
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            get(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS").or_else(|| headers.clone()),
        )?;
        let metrics_headers = pairs(
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
            get(env, "OTEL_EXPORTER_OTLP_METRICS_HEADERS").or(headers),
        )?;
        let timeout = number(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10_000u64, |n| *n > 0)?;
        let sampler = Sampler::from_env(
            get(env, "OTEL_TRACES_SAMPLER").as_deref(),
            get(env, "OTEL_TRACES_SAMPLER_ARG").as_deref(),
        )?;
        let capture_content = match get(env, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT") {
            None => false,
            Some(v) if v.eq_ignore_ascii_case("true") => true,
            Some(v) if v.eq_ignore_ascii_case("false") => false,
            Some(v) => {
                return Err(format!(
                    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT={v:?} is not true or false"
                ))
            }
        };
        let mut resource = pairs(
            "OTEL_RESOURCE_ATTRIBUTES",
            get(env, "OTEL_RESOURCE_ATTRIBUTES"),
        )?;
        let from_resource = resource
            .iter()
            .position(|(k, _)| k == "service.name")
            .map(|i| resource.remove(i).1);
        let service_name = get(env, "OTEL_SERVICE_NAME")
            .or(from_resource)
            .unwrap_or_else(|| "polygw".to_string());
        Ok(Some(OtelConfig {
            traces,
            metrics,
            traces_endpoint: traces_endpoint.unwrap_or_default(),
            metrics_endpoint: metrics_endpoint.unwrap_or_default(),
            traces_headers,
            metrics_headers,
            timeout: Duration::from_millis(timeout),
            sampler,
            capture_content,
            queue: number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048usize, |n| *n > 0)?,
            batch: number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512usize, |n| *n > 0)?,
            delay: Duration::from_millis(number(env, "OTEL_BSP_SCHEDULE_DELAY", 5_000u64, |_| {
                true
            })?),
            metric_interval: Duration::from_millis(number(
                env,
                "OTEL_METRIC_EXPORT_INTERVAL",
                60_000u64,
                |n| *n > 0,
            )?),
            service_name,
            resource,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<Option<OtelConfig>, String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        OtelConfig::from_env(&move |k| m.get(k).cloned())
    }

    #[test]
    fn off_unless_an_endpoint_is_set() {
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&[("OTEL_SERVICE_NAME", "x")]), Ok(None));
        assert_eq!(
            read(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            Ok(None)
        );
        assert_eq!(
            read(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_TRACES_EXPORTER", "none"),
                ("OTEL_METRICS_EXPORTER", "none")
            ]),
            Ok(None)
        );
    }

    #[test]
    fn the_standard_variables_are_read() {
        let c = read(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            (
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                "http://m:9/v1/metrics",
            ),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%20b,x=1"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "service.name=gw,deployment.environment=prod",
            ),
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.traces_endpoint, "http://collector:4318/v1/traces");
        assert_eq!(c.metrics_endpoint, "http://m:9/v1/metrics");
        assert_eq!(
            c.traces_headers,
            [
                ("api-key".to_string(), "a b".to_string()),
                ("x".into(), "1".into())
            ]
        );
        assert_eq!(c.service_name, "gw");
        assert_eq!(
            c.resource,
            [("deployment.environment".to_string(), "prod".to_string())]
        );
        assert_eq!(c.sampler, Sampler::Ratio(0.5));
        assert_eq!(c.delay, Duration::from_millis(100));
        assert!(c.traces && c.metrics && !c.capture_content);
        let d = read(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t/v1/traces")])
            .unwrap()
            .unwrap();
        assert!(d.traces && !d.metrics);
        assert_eq!(d.service_name, "polygw");
    }

    #[test]
    fn what_polygw_cannot_honour_is_refused_by_name() {
        let base = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        for (bad, named) in [
            (
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
            (("OTEL_TRACES_EXPORTER", "zipkin"), "OTEL_TRACES_EXPORTER"),
            (("OTEL_TRACES_SAMPLER", "nope"), "OTEL_TRACES_SAMPLER"),
            (("OTEL_BSP_MAX_QUEUE_SIZE", "0"), "OTEL_BSP_MAX_QUEUE_SIZE"),
            (
                ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "yes"),
                "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
            ),
            (
                ("OTEL_EXPORTER_OTLP_HEADERS", "novalue"),
                "OTEL_EXPORTER_OTLP_",
            ),
        ] {
            let e = read(&[base, bad]).unwrap_err();
            assert!(e.contains(named), "{e}");
        }
        let e = read(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]).unwrap_err();
        assert!(e.contains("collector:4318"), "{e}");
    }
}
