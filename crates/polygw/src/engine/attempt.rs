//! One attempt: an HTTP request to one source, and what follows it — settlement of the
//! permit (SPEC §4.3), the breaker outcome (§4.4), the telemetry row (§8).
//!
//! An [`AttemptGuard`] is armed for the whole attempt. Dropped before the attempt was
//! finalized (caller drop, deadline, hedge loser), it settles the permit's reservation
//! through the non-blocking path, frees a half-open probe (the breaker store's
//! non-blocking release), and queues the row with `cancelled`, `deadline` or
//! `hedge_cancelled` — all without awaiting, and nothing is spawned.
//!
//! Every end of an attempt (finalized or dropped) wakes one call waiting for a runnable
//! source (SPEC §14.6): a freed slot or settled reservation serves one waiter, not all.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use polygw_core::breaker::BreakerOutcome;
use polygw_core::ports::{ChunkObserver, Permit};
use polygw_core::settlement::{settle, AttemptOutcome};
use polygw_core::stall::{ms, StreamFigures};
use polygw_core::telemetry::{cost, CostBasis, RowKind, TelemetryRow};
use polygw_core::{AttemptError, ErrorLabel, SourceConfig, Usage, UsageSource};

use super::admission::BreakerTicket;
use super::call::CallShared;
use super::Engine;

/// What a successful attempt tells settlement and telemetry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SuccessFacts {
    pub usage: Usage,
    pub usage_source: UsageSource,
    pub figures: Option<StreamFigures>,
    pub http_status: u16,
    pub model: Option<String>,
    /// Priced per call (OCR) instead of per token.
    pub per_call_cost: bool,
    /// Settle this instead of the usage rule (OCR settles 0).
    pub settle_override: Option<u64>,
}

/// One kind of attempt (chat, embedding batch, OCR image).
pub(crate) trait Leg: Send + Sync {
    /// What a successful attempt returns.
    type Output: Send;
    /// Whether the upstream is read as a stream.
    fn stream(&self) -> bool;
    /// Sends the request to `source`.
    fn call<'a>(
        &'a self,
        engine: &'a Engine,
        source: &'a SourceConfig,
        call_id: &'a str,
        observer: &'a dyn ChunkObserver,
    ) -> BoxFuture<'a, Result<Self::Output, AttemptError>>;
    /// The facts of a success.
    fn facts(&self, out: &Self::Output) -> SuccessFacts;
}

/// Why a leg is being cancelled by its round (read by its guard on drop): not at all.
pub(crate) const CANCEL_NONE: u8 = 0;
/// The leg lost a hedged round.
pub(crate) const CANCEL_HEDGE_LOSER: u8 = 1;

/// Identity of one leg.
#[derive(Debug, Clone)]
pub(crate) struct LegInfo {
    /// Position in the round (0 = primary).
    pub index: usize,
    /// Position in the logical call.
    pub attempt_index: u32,
    pub is_hedge: bool,
    pub source_idx: usize,
    pub call_id: String,
    pub launched_at: Instant,
    /// The breaker ticket the attempt was admitted with.
    pub probe: BreakerTicket,
}

/// Armed for the whole attempt; see the module doc.
pub(crate) struct AttemptGuard {
    engine: Arc<Engine>,
    call: Arc<CallShared>,
    cancel: Arc<AtomicU8>,
    permit: Option<Permit>,
    probe: BreakerTicket,
    source_idx: usize,
    started: Instant,
    base: TelemetryRow,
    /// Set once the attempt's outcome is known: (tokens to settle, its row).
    pending: Option<(u64, TelemetryRow)>,
    armed: bool,
}

impl std::fmt::Debug for AttemptGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttemptGuard")
            .field("call_id", &self.base.call_id)
            .field("armed", &self.armed)
            .finish()
    }
}

impl AttemptGuard {
    pub(crate) fn new(
        engine: Arc<Engine>,
        call: Arc<CallShared>,
        cancel: Arc<AtomicU8>,
        permit: Permit,
        info: &LegInfo,
        stream: bool,
    ) -> Self {
        let src = &engine.scope.sources[info.source_idx];
        let mut base = TelemetryRow::new(
            RowKind::Attempt,
            info.call_id.clone(),
            call.logical_call_id.clone(),
            engine.scope.name.clone(),
            engine.kind.operation(),
            0,
        );
        base.source = Some(src.name.clone());
        base.provider = Some(src.provider.clone());
        base.model = Some(src.model.clone());
        base.attempt_index = Some(info.attempt_index);
        base.is_hedge = info.is_hedge;
        base.stream = stream;
        AttemptGuard {
            source_idx: info.source_idx,
            started: info.launched_at,
            engine,
            call,
            cancel,
            permit: Some(permit),
            probe: info.probe,
            base,
            pending: None,
            armed: true,
        }
    }

    fn source(&self) -> &SourceConfig {
        &self.engine.scope.sources[self.source_idx]
    }

    /// The label a cancellation gets now.
    fn cancel_label(&self) -> ErrorLabel {
        if self.cancel.load(Ordering::SeqCst) == CANCEL_HEDGE_LOSER {
            ErrorLabel::HedgeCancelled
        } else if self.call.deadline_hit() {
            ErrorLabel::Deadline
        } else {
            ErrorLabel::Cancelled
        }
    }

    fn row(&self, wall: Duration) -> TelemetryRow {
        let mut r = self.base.clone();
        r.created_at_ms = self.engine.ports.clock.unix_ms();
        r.latency_ms = Some(ms(wall));
        r
    }

    /// Finalizes a success: settle, breaker, row.
    pub(crate) async fn succeed(self, facts: &SuccessFacts, wall: Duration) {
        let src = self.source().clone();
        let est = self.engine.scope.est_tokens(&src);
        let tokens = facts.settle_override.unwrap_or_else(|| {
            settle(
                AttemptOutcome::Success {
                    usage: &facts.usage,
                    source: facts.usage_source,
                },
                est,
            )
            .tokens()
        });
        let mut row = self.row(wall).with_usage(&facts.usage, facts.usage_source);
        row.ok = true;
        row.http_status = Some(facts.http_status);
        if let Some(m) = &facts.model {
            row.model = Some(m.clone());
        }
        row.cost = cost(
            if facts.per_call_cost {
                CostBasis::PerCall
            } else {
                CostBasis::Tokens {
                    usage: &facts.usage,
                    source: facts.usage_source,
                }
            },
            &src,
        );
        if let Some(f) = facts.figures {
            row.ttft_ms = f.ttft_ms;
            row.max_inter_token_ms = f.max_inter_token_ms;
            row.stall_ms = f.stall_ms;
            row.stall_count = f.stall_count;
        }
        let ttft = facts.figures.and_then(|f| f.ttft_ms);
        self.finish(tokens, row, BreakerOutcome::Success, ttft)
            .await;
    }

    /// Finalizes a failure: settle per class, breaker outcome, row with the label.
    /// `fallback_cooldown` is the cooldown of a 429 without Retry-After.
    pub(crate) async fn fail(
        self,
        error: &AttemptError,
        wall: Duration,
        fallback_cooldown: Duration,
    ) {
        let est = self.engine.scope.est_tokens(self.source());
        let tokens = settle(AttemptOutcome::Failed(error), est).tokens();
        let mut row = self.row(wall);
        row.error = Some(error.label.as_str().to_string());
        row.error_detail = Some(error.short_detail());
        row.http_status = error.http_status;
        row.cost = None;
        let outcome =
            BreakerOutcome::of_class(error.class, error.retry_after.unwrap_or(fallback_cooldown));
        self.finish(tokens, row, outcome, None).await;
    }

    /// Settles, records the breaker outcome and queues the row. If this future is
    /// dropped half-way, the guard's drop completes it without awaiting.
    async fn finish(
        mut self,
        tokens: u64,
        row: TelemetryRow,
        outcome: BreakerOutcome,
        ttft: Option<u64>,
    ) {
        let label = row.error.clone().unwrap_or_else(|| "ok".into());
        self.pending = Some((tokens, row));
        let engine = self.engine.clone();
        let scope = engine.scope.name.as_str();
        let src_name = engine.scope.sources[self.source_idx].name.clone();
        if let Some(permit) = self.permit.as_mut() {
            if let Err(e) = permit.finish(tokens).await {
                tracing::warn!(source = %src_name, error = %e, "settlement failed; handed to the background path");
                if let Some(p) = self.permit.take() {
                    p.finish_in_background(tokens);
                }
            }
        }
        self.permit = None;
        if let Err(e) = engine
            .ports
            .breakers
            .record(
                scope,
                &src_name,
                outcome,
                self.probe.epoch,
                self.probe.probe,
                &engine.scope.breaker,
            )
            .await
        {
            tracing::warn!(source = %src_name, error = %e, "breaker update failed");
        }
        self.probe.probe = false;
        if let Some((_, row)) = self.pending.take() {
            engine.ports.telemetry.record(row);
        }
        engine.metrics.attempt(scope, &src_name, &label, ttft);
        self.armed = false;
        engine.freed.notify_one();
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let scope = self.engine.scope.name.clone();
        let src_name = self.source().name.clone();
        let (tokens, row, label) = match self.pending.take() {
            // Dropped while finalizing: the outcome is known, keep it.
            Some((tokens, row)) => {
                let label = row.error.clone().unwrap_or_else(|| "ok".into());
                (Some(tokens), row, label)
            }
            None => {
                let label = self.cancel_label();
                let wall = self
                    .engine
                    .ports
                    .clock
                    .now()
                    .saturating_duration_since(self.started);
                let mut row = self.row(wall);
                row.error = Some(label.as_str().to_string());
                row.error_detail = Some(match label {
                    ErrorLabel::HedgeCancelled => "another leg of the hedged round won".to_string(),
                    ErrorLabel::Deadline => "the call deadline passed".to_string(),
                    _ => "the caller dropped the call".to_string(),
                });
                (None, row, label.as_str().to_string())
            }
        };
        self.engine.ports.telemetry.record(row);
        self.engine.metrics.attempt(&scope, &src_name, &label, None);
        if let Some(permit) = self.permit.take() {
            match tokens {
                Some(t) => permit.finish_in_background(t),
                // Cancelled: the reservation (est) settles through the permit's drop.
                None => drop(permit),
            }
        }
        if self.probe.probe {
            // Free the half-open probe; never a breaker failure (a slow leg is not dead).
            self.engine
                .ports
                .breakers
                .release_probe(&scope, &src_name, self.probe.epoch);
        }
        self.engine.freed.notify_one();
    }
}
