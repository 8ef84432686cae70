//! In-process metrics of a client (calls, attempts, hedges, errors by label, latency
//! and TTFT histograms), rendered in Prometheus text format by `polygw serve`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, Weak};

use polygw_core::ports::RateLimiter;

/// Histogram bucket bounds in milliseconds.
pub const BUCKETS_MS: [u64; 14] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 20_000, 40_000, 80_000, 160_000,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS_MS.len()],
    count: u64,
    sum_ms: u64,
}

impl Histogram {
    fn observe(&mut self, ms: u64) {
        for (i, b) in BUCKETS_MS.iter().enumerate() {
            if ms <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum_ms += ms;
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// (scope, outcome) → count; outcome is `ok` or a terminal reason.
    calls: BTreeMap<(String, String), u64>,
    /// (scope, source, outcome) → count; outcome is `ok` or an error label.
    attempts: BTreeMap<(String, String, String), u64>,
    /// scope → extra legs launched.
    hedges: BTreeMap<String, u64>,
    /// scope → calls won by an extra leg.
    hedge_wins: BTreeMap<String, u64>,
    /// scope → call latency.
    latency: BTreeMap<String, Histogram>,
    /// (scope, source) → TTFT of successful streamed attempts.
    ttft: BTreeMap<(String, String), Histogram>,
    /// scope → cache hits.
    cache_hits: BTreeMap<String, u64>,
    /// (scope, mode, outcome) → resume legs; outcome is `ok` or the leg's label.
    resumes: BTreeMap<(String, String, String), u64>,
    /// The limiters of the clients sharing these metrics (their drop counters).
    limiters: Vec<(String, Weak<dyn RateLimiter>)>,
}

/// Counters and histograms of one or more clients.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    /// Empty metrics.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn call(&self, scope: &str, outcome: &str, latency_ms: u64) {
        let mut g = self.lock();
        *g.calls.entry((scope.into(), outcome.into())).or_default() += 1;
        g.latency
            .entry(scope.into())
            .or_default()
            .observe(latency_ms);
    }

    pub(crate) fn attempt(&self, scope: &str, source: &str, outcome: &str, ttft_ms: Option<u64>) {
        let mut g = self.lock();
        *g.attempts
            .entry((scope.into(), source.into(), outcome.into()))
            .or_default() += 1;
        if let Some(t) = ttft_ms {
            g.ttft
                .entry((scope.into(), source.into()))
                .or_default()
                .observe(t);
        }
    }

    pub(crate) fn hedge(&self, scope: &str) {
        *self.lock().hedges.entry(scope.into()).or_default() += 1;
    }

    pub(crate) fn hedge_win(&self, scope: &str) {
        *self.lock().hedge_wins.entry(scope.into()).or_default() += 1;
    }

    pub(crate) fn resume(&self, scope: &str, mode: &str, outcome: &str) {
        *self
            .lock()
            .resumes
            .entry((scope.into(), mode.into(), outcome.into()))
            .or_default() += 1;
    }

    /// Resume legs that ended with this outcome (`ok` or a label), any scope and mode.
    pub fn resumes_with(&self, outcome: &str) -> u64 {
        self.lock()
            .resumes
            .iter()
            .filter(|((_, _, o), _)| o == outcome)
            .map(|(_, n)| n)
            .sum()
    }

    /// Reports `limiter`'s dropped settlements under `scope` (once per limiter).
    pub(crate) fn watch_limiter(&self, scope: &str, limiter: &Arc<dyn RateLimiter>) {
        let mut g = self.lock();
        g.limiters.retain(|(_, w)| w.strong_count() > 0);
        let known = g
            .limiters
            .iter()
            .any(|(_, w)| w.upgrade().is_some_and(|l| Arc::ptr_eq(&l, limiter)));
        if !known {
            g.limiters
                .push((scope.to_string(), Arc::downgrade(limiter)));
        }
    }

    pub(crate) fn cache_hit(&self, scope: &str) {
        *self.lock().cache_hits.entry(scope.into()).or_default() += 1;
    }

    /// Total attempts recorded with this outcome label (tests, health).
    pub fn attempts_with(&self, outcome: &str) -> u64 {
        self.lock()
            .attempts
            .iter()
            .filter(|((_, _, o), _)| o == outcome)
            .map(|(_, n)| n)
            .sum()
    }

    /// Prometheus text exposition. `telemetry_dropped` is the recorder's drop counter.
    pub fn render_prometheus(&self, telemetry_dropped: u64) -> String {
        let g = self.lock();
        let mut s = String::new();
        let esc = |v: &str| {
            v.replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n")
        };
        let _ = writeln!(
            s,
            "# HELP polygw_calls_total Logical calls by outcome (ok or terminal reason)."
        );
        let _ = writeln!(s, "# TYPE polygw_calls_total counter");
        for ((scope, outcome), n) in &g.calls {
            let _ = writeln!(
                s,
                "polygw_calls_total{{scope=\"{}\",outcome=\"{}\"}} {n}",
                esc(scope),
                esc(outcome)
            );
        }
        let _ = writeln!(
            s,
            "# HELP polygw_attempts_total Attempts by source and outcome (ok or error label)."
        );
        let _ = writeln!(s, "# TYPE polygw_attempts_total counter");
        for ((scope, source, outcome), n) in &g.attempts {
            let _ = writeln!(
                s,
                "polygw_attempts_total{{scope=\"{}\",source=\"{}\",outcome=\"{}\"}} {n}",
                esc(scope),
                esc(source),
                esc(outcome)
            );
        }
        let _ = writeln!(
            s,
            "# HELP polygw_errors_total Failed attempts by error label."
        );
        let _ = writeln!(s, "# TYPE polygw_errors_total counter");
        let mut by_label: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for ((scope, _, outcome), n) in &g.attempts {
            if outcome != "ok" {
                *by_label.entry((scope, outcome)).or_default() += n;
            }
        }
        for ((scope, label), n) in by_label {
            let _ = writeln!(
                s,
                "polygw_errors_total{{scope=\"{}\",label=\"{}\"}} {n}",
                esc(scope),
                esc(label)
            );
        }
        let _ = writeln!(
            s,
            "# HELP polygw_resumes_total Resume legs of streams, by mode and outcome (ok or label)."
        );
        let _ = writeln!(s, "# TYPE polygw_resumes_total counter");
        for ((scope, mode, outcome), n) in &g.resumes {
            let _ = writeln!(
                s,
                "polygw_resumes_total{{scope=\"{}\",mode=\"{}\",outcome=\"{}\"}} {n}",
                esc(scope),
                esc(mode),
                esc(outcome)
            );
        }
        let _ = writeln!(s, "# HELP polygw_hedges_total Extra hedge legs launched.");
        let _ = writeln!(s, "# TYPE polygw_hedges_total counter");
        for (scope, n) in &g.hedges {
            let _ = writeln!(s, "polygw_hedges_total{{scope=\"{}\"}} {n}", esc(scope));
        }
        let _ = writeln!(
            s,
            "# HELP polygw_hedge_wins_total Calls won by an extra hedge leg."
        );
        let _ = writeln!(s, "# TYPE polygw_hedge_wins_total counter");
        for (scope, n) in &g.hedge_wins {
            let _ = writeln!(s, "polygw_hedge_wins_total{{scope=\"{}\"}} {n}", esc(scope));
        }
        let _ = writeln!(
            s,
            "# HELP polygw_cache_hits_total Calls answered from the response cache."
        );
        let _ = writeln!(s, "# TYPE polygw_cache_hits_total counter");
        for (scope, n) in &g.cache_hits {
            let _ = writeln!(s, "polygw_cache_hits_total{{scope=\"{}\"}} {n}", esc(scope));
        }
        let hist = |s: &mut String, name: &str, labels: String, h: &Histogram| {
            for (i, b) in BUCKETS_MS.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "{name}_bucket{{{labels},le=\"{}\"}} {}",
                    *b as f64 / 1000.0,
                    h.counts[i]
                );
            }
            let _ = writeln!(s, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(s, "{name}_sum{{{labels}}} {}", h.sum_ms as f64 / 1000.0);
            let _ = writeln!(s, "{name}_count{{{labels}}} {}", h.count);
        };
        let _ = writeln!(
            s,
            "# HELP polygw_call_latency_seconds Wall time of logical calls."
        );
        let _ = writeln!(s, "# TYPE polygw_call_latency_seconds histogram");
        for (scope, h) in &g.latency {
            hist(
                &mut s,
                "polygw_call_latency_seconds",
                format!("scope=\"{}\"", esc(scope)),
                h,
            );
        }
        let _ = writeln!(s, "# HELP polygw_ttft_seconds Time to first incremental chunk of successful streamed attempts.");
        let _ = writeln!(s, "# TYPE polygw_ttft_seconds histogram");
        for ((scope, source), h) in &g.ttft {
            hist(
                &mut s,
                "polygw_ttft_seconds",
                format!("scope=\"{}\",source=\"{}\"", esc(scope), esc(source)),
                h,
            );
        }
        let mut dropped: BTreeMap<&str, u64> = BTreeMap::new();
        for (scope, w) in &g.limiters {
            if let Some(l) = w.upgrade() {
                *dropped.entry(scope).or_default() += l.settlements_dropped();
            }
        }
        let _ = writeln!(s, "# HELP polygw_governance_settlements_dropped_total Settlements and releases the governance backend could not queue (queue full); their slots end with their leases.");
        let _ = writeln!(
            s,
            "# TYPE polygw_governance_settlements_dropped_total counter"
        );
        for (scope, n) in dropped {
            let _ = writeln!(
                s,
                "polygw_governance_settlements_dropped_total{{scope=\"{}\"}} {n}",
                esc(scope)
            );
        }
        let _ = writeln!(s, "# HELP polygw_telemetry_rows_dropped_total Telemetry rows dropped because the queue overflowed.");
        let _ = writeln!(s, "# TYPE polygw_telemetry_rows_dropped_total counter");
        let _ = writeln!(s, "polygw_telemetry_rows_dropped_total {telemetry_dropped}");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::new();
        m.call("LLM", "ok", 120);
        m.attempt("LLM", "a-0", "ok", Some(30));
        m.attempt("LLM", "b-0", "server_error", None);
        m.hedge("LLM");
        let text = m.render_prometheus(3);
        assert!(
            text.contains("polygw_calls_total{scope=\"LLM\",outcome=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("polygw_errors_total{scope=\"LLM\",label=\"server_error\"} 1"));
        assert!(text.contains("polygw_hedges_total{scope=\"LLM\"} 1"));
        assert!(text.contains("polygw_call_latency_seconds_bucket{scope=\"LLM\",le=\"0.25\"} 1"));
        assert!(text.contains("polygw_call_latency_seconds_bucket{scope=\"LLM\",le=\"0.1\"} 0"));
        assert!(text.contains("polygw_ttft_seconds_count{scope=\"LLM\",source=\"a-0\"} 1"));
        assert!(text.contains("polygw_telemetry_rows_dropped_total 3"));
        assert_eq!(m.attempts_with("server_error"), 1);
    }

    #[derive(Debug)]
    struct Dropping(u64);

    #[async_trait::async_trait]
    impl RateLimiter for Dropping {
        async fn acquire<'r>(
            &self,
            _req: &polygw_core::ports::AcquireRequest<'r>,
        ) -> Result<polygw_core::ports::Admission, polygw_core::GovernanceError> {
            unreachable!("not called")
        }
        async fn in_flight(
            &self,
            _scope: &str,
            _source: &str,
        ) -> Result<u32, polygw_core::GovernanceError> {
            Ok(0)
        }
        fn settlements_dropped(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn renders_dropped_settlements_per_scope() {
        let m = Metrics::new();
        let a: Arc<dyn RateLimiter> = Arc::new(Dropping(4));
        let b: Arc<dyn RateLimiter> = Arc::new(Dropping(0));
        m.watch_limiter("LLM", &a);
        m.watch_limiter("LLM", &a);
        m.watch_limiter("EMBED", &b);
        let text = m.render_prometheus(0);
        assert!(
            text.contains("polygw_governance_settlements_dropped_total{scope=\"LLM\"} 4"),
            "{text}"
        );
        assert!(text.contains("polygw_governance_settlements_dropped_total{scope=\"EMBED\"} 0"));
        drop(a);
        assert!(!m.render_prometheus(0).contains("scope=\"LLM\"} 4"));
    }
}
