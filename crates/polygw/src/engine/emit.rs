//! Telemetry rows a call emits besides its attempts: the `terminal_failure` row of a
//! failed logical call and the `cache_hit` row (SPEC §8).

use polygw_core::stall::ms;
use polygw_core::telemetry::{RowKind, TelemetryRow};
use polygw_core::{GatewayError, Usage, UsageSource};

use super::call::CallShared;
use super::Engine;
use crate::clock::new_id;

impl Engine {
    /// Traces `call` (SPEC §26.1) when the process exports OpenTelemetry: its place in
    /// the caller's trace, and what `facts` records of its request.
    pub(crate) fn trace_call(
        &self,
        call: &CallShared,
        parent: Option<polygw_core::otel::TraceParent>,
        facts: impl FnOnce(&crate::otel::OtelCall),
    ) {
        if !self.ports.otel.enabled() {
            return;
        }
        let o = crate::otel::OtelCall::new(
            self.ports.otel.clone(),
            &self.scope.name,
            self.kind.operation(),
            &call.logical_call_id,
            parent,
            call.started,
            self.ports.clock.unix_ms(),
        );
        facts(&o);
        call.set_otel(o);
    }

    /// Ends a logical call: the call metric, the span's `error.type`, and on failure
    /// the `terminal_failure` row.
    pub(crate) fn conclude(
        &self,
        call: &CallShared,
        span: &tracing::Span,
        error: Option<&GatewayError>,
    ) {
        let latency = ms(self
            .ports
            .clock
            .now()
            .saturating_duration_since(call.started));
        match error {
            None => self.scope_metrics.call("ok", latency),
            Some(e) => {
                let reason = e
                    .terminal_reason()
                    .map(|r| r.as_str())
                    .unwrap_or("invalid_request");
                span.record("error.type", reason);
                span.record("polygw.attempts", call.progress().attempts);
                self.scope_metrics.call(reason, latency);
                self.emit_terminal(call, e);
            }
        }
    }

    /// One info line for a call that succeeded only thanks to a failover, a hedge or a
    /// resume (issue 22, item 16), saying what happened; nothing for a call whose first
    /// attempt answered.
    pub(crate) fn log_rescue(&self, call: &CallShared, r: &polygw_core::LlmResponse) {
        let s = &r.call_stats;
        if s.attempts <= 1 && s.hedges == 0 && s.resumes == 0 {
            return;
        }
        let p = call.progress();
        let failed: Vec<String> = p
            .reasons
            .iter()
            .filter_map(|(src, why)| match why {
                polygw_core::SourceReason::Failed(l) => Some(format!("{src}: {l}")),
                polygw_core::SourceReason::Refused(_) => None,
            })
            .collect();
        let mut what = Vec::new();
        if !failed.is_empty() && s.resumes == 0 {
            what.push(format!("a failover (failed: {})", failed.join(", ")));
        }
        if s.hedge_won {
            what.push(format!("a hedge ({} extra leg(s), one won)", s.hedges));
        } else if s.hedges > 0 {
            what.push(format!("{} hedge leg(s) that lost", s.hedges));
        }
        if s.resumes > 0 {
            what.push(format!("{} resume(s) of its stream", s.resumes));
        }
        if what.is_empty() {
            what.push(format!("{} attempts", s.attempts));
        }
        tracing::info!(
            scope = %self.scope.name,
            logical_call_id = %call.logical_call_id,
            source = %r.source,
            attempts = s.attempts,
            hedges = s.hedges,
            resumes = s.resumes,
            "call succeeded thanks to {}",
            what.join(" and ")
        );
    }

    fn call_row(&self, kind: RowKind, call: &CallShared) -> TelemetryRow {
        let mut r = TelemetryRow::new(
            kind,
            new_id(),
            call.logical_call_id.clone(),
            self.row_names.scope.clone(),
            self.row_names.operation.clone(),
            self.ports.clock.unix_ms(),
        );
        r.stream = call.stream;
        r.api = call.api().map(str::to_string);
        call.label_row(&mut r);
        r.latency_ms = Some(ms(self
            .ports
            .clock
            .now()
            .saturating_duration_since(call.started)));
        r
    }

    /// One `terminal_failure` row for a failed logical call; `error` is the reason.
    pub(crate) fn emit_terminal(&self, call: &CallShared, err: &GatewayError) {
        let Some(reason) = err.terminal_reason() else {
            return;
        };
        let mut r = self.call_row(RowKind::TerminalFailure, call);
        r.error = Some(reason.as_str().to_string());
        r.error_detail = err
            .last_error()
            .map(|e| e.short_detail())
            .or_else(|| err.context().and_then(|c| c.detail.clone()));
        r.http_status = err.last_error().and_then(|e| e.http_status);
        call.trace_now(polygw_core::trace::TraceEvent::End {
            why: reason.as_str().to_string(),
        });
        if self.ports.telemetry.keeps_rows() {
            r.trace = Some(call.trace_json());
        }
        self.ports.telemetry.record(r);
    }

    /// One `cache_hit` row: nothing was spent (0 tokens measured, cost 0.0).
    pub(crate) fn emit_cache_hit(&self, call: &CallShared, model: &str) {
        let mut r = self
            .call_row(RowKind::CacheHit, call)
            .with_usage(&Usage::default(), UsageSource::Measured);
        r.ok = true;
        r.cache_hit = true;
        r.cost = Some(0.0);
        r.model = Some(model.into());
        self.ports.telemetry.record(r);
    }
}
