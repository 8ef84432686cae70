//! The state of one logical call that outlives its inner future: the deadline flag the
//! attempt guards read, and the progress (attempts, reasons, last error) a terminal
//! error reports even when the deadline dropped everything else.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use polygw_core::ports::{Clock, Refusal};
use polygw_core::trace::{CallTrace, TraceEvent};

use crate::client_keys::KeyCharge;
use polygw_core::{
    AttemptError, FailureContext, GatewayError, RetrySettings, SourceReason, SourceReasons,
    TerminalReason,
};

/// What the call has done so far.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Attempts launched (legs included).
    pub attempts: u32,
    /// Extra hedge legs launched.
    pub hedges: u32,
    /// Resume legs launched.
    pub resumes: u32,
    /// Every source's latest reason.
    pub reasons: SourceReasons,
    /// The last attempt error.
    pub last_error: Option<AttemptError>,
    /// The source of the last attempt error.
    pub last_source: Option<String>,
    /// Sources that failed in this call (retry rounds prefer the others).
    pub failed: BTreeSet<String>,
    /// Sources an attempt of this call was sent to.
    pub tried: BTreeSet<String>,
    /// Sources this call never sends its request to again (one redirected, or answered
    /// over the size cap: SPEC §17.4), or never sends it to at all (a context window
    /// known to be too small: §17.9).
    pub excluded: BTreeSet<String>,
    /// When each source's latest refusal or failure passes, by its hint: the earliest
    /// still ahead is the answer's Retry-After. Per source, the latest hint replaces
    /// the one before (a 429 waited out and answered again with a longer hint says the
    /// longer one; a hint that has run out says nothing).
    pub hints: std::collections::BTreeMap<String, Instant>,
    /// Rounds started.
    pub rounds: u32,
}

/// Shared by the call's future, its legs' guards and the deadline wrapper.
#[derive(Debug)]
pub(crate) struct CallShared {
    pub logical_call_id: String,
    pub started: Instant,
    pub stream: bool,
    /// The API route the call came by (telemetry `api`).
    api: Mutex<Option<&'static str>>,
    deadline_hit: AtomicBool,
    budget_counted: AtomicBool,
    max_wait: Mutex<Option<(Duration, Option<String>)>>,
    progress: Mutex<Progress>,
    clock: Arc<dyn Clock>,
    /// What the call did and why (SPEC §19.4): its last row carries it.
    trace: Mutex<CallTrace>,
    /// The client key charged (SPEC §21.1): released when the call and its attempts are.
    key: Mutex<Option<Arc<KeyCharge>>>,
    /// Who the call is for (SPEC §24.6): on every row.
    attribution: Mutex<polygw_core::telemetry::Attribution>,
    /// The call's prompt-cache affinity key (SPEC §20.2), when the scope keeps affinity.
    affinity: Mutex<Option<polygw_core::affinity::AffinityKey>>,
    /// What the call collects for OpenTelemetry (SPEC §26.1), when it is exported;
    /// handed over when the call's last reference goes.
    otel: std::sync::OnceLock<Box<crate::otel::OtelCall>>,
    /// The signature family of the conversation (SPEC §23.5): hedge and resume legs
    /// prefer its sources.
    family: std::sync::OnceLock<Arc<str>>,
}

impl Drop for CallShared {
    fn drop(&mut self) {
        if let Some(o) = self.otel.get() {
            o.finish(self, self.clock.now());
        }
    }
}

impl CallShared {
    pub(crate) fn new(
        logical_call_id: String,
        started: Instant,
        stream: bool,
        clock: Arc<dyn Clock>,
    ) -> Self {
        CallShared {
            clock,
            trace: Mutex::new(CallTrace::default()),
            key: Mutex::new(None),
            attribution: Mutex::new(Default::default()),
            affinity: Mutex::new(None),
            otel: std::sync::OnceLock::new(),
            family: std::sync::OnceLock::new(),
            logical_call_id,
            started,
            stream,
            api: Mutex::new(None),
            deadline_hit: AtomicBool::new(false),
            budget_counted: AtomicBool::new(false),
            max_wait: Mutex::new(None),
            progress: Mutex::new(Progress::default()),
        }
    }

    /// Charges the call to a client key.
    pub(crate) fn set_key(&self, key: Option<Arc<KeyCharge>>) {
        *self.key.lock().unwrap_or_else(|e| e.into_inner()) = key;
    }

    /// Sets who the call is for.
    pub(crate) fn set_attribution(&self, a: polygw_core::telemetry::Attribution) {
        *self.attribution.lock().unwrap_or_else(|e| e.into_inner()) = a;
    }

    /// Traces the call (SPEC §26.1).
    pub(crate) fn set_otel(&self, o: crate::otel::OtelCall) {
        let _ = self.otel.set(Box::new(o));
    }

    /// What the call collects for OpenTelemetry, when it is traced.
    pub(crate) fn otel(&self) -> Option<&crate::otel::OtelCall> {
        self.otel.get().map(|b| &**b)
    }

    /// Who the call is for.
    pub(crate) fn attribution(&self) -> polygw_core::telemetry::Attribution {
        self.attribution
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The trace so far (events in time order).
    pub(crate) fn trace_snapshot(&self) -> CallTrace {
        let mut t = self.trace.lock().unwrap_or_else(|e| e.into_inner()).clone();
        t.events.sort_by_key(|e| e.t);
        t
    }

    /// Writes the call's client key and attribution into a row of it.
    pub(crate) fn label_row(&self, row: &mut polygw_core::telemetry::TelemetryRow) {
        row.client_key_id = self.client_key_id();
        self.attribution
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .apply(row);
    }

    /// The client key's id, for the rows.
    pub(crate) fn client_key_id(&self) -> Option<String> {
        self.key
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|k| k.key_id().to_string())
    }

    /// An attempt's spend, charged to the call's key (if any), with the reservation its
    /// leg held.
    pub(crate) fn charge(
        &self,
        tokens: u64,
        cost: Option<f64>,
        leg: Option<crate::client_keys::LegHold>,
    ) {
        if let Some(k) = self.key.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            k.add_leg(tokens, cost, leg);
        }
    }

    /// The call's key charge, if any.
    pub(crate) fn key(&self) -> Option<Arc<KeyCharge>> {
        self.key.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets the call's affinity key.
    pub(crate) fn set_affinity(&self, key: Option<polygw_core::affinity::AffinityKey>) {
        *self.affinity.lock().unwrap_or_else(|e| e.into_inner()) = key;
    }

    /// The call's affinity key, when it has one.
    /// Sets the conversation's signature family (once).
    pub(crate) fn set_family(&self, family: Arc<str>) {
        let _ = self.family.set(family);
    }

    /// The conversation's signature family, when known.
    pub(crate) fn family(&self) -> Option<Arc<str>> {
        self.family.get().cloned()
    }

    pub(crate) fn affinity(&self) -> Option<polygw_core::affinity::AffinityKey> {
        self.affinity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Starts the next round: its number (1-based).
    pub(crate) fn next_round(&self) -> u32 {
        let mut p = self.progress();
        p.rounds += 1;
        p.rounds
    }

    /// The current round's number.
    pub(crate) fn round_no(&self) -> u32 {
        self.progress().rounds
    }

    /// Records a trace event at `at`.
    pub(crate) fn trace(&self, at: Instant, event: TraceEvent) {
        self.trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.started, at, event);
    }

    /// Records a trace event now.
    pub(crate) fn trace_now(&self, event: TraceEvent) {
        self.trace(self.clock.now(), event);
    }

    /// The trace so far, as the `trace` column holds it (events in time order).
    pub(crate) fn trace_json(&self) -> String {
        // Written under the lock, without a copy, when the events are in time order
        // (they are pushed as they happen; legs' threads may interleave).
        {
            let t = self.trace.lock().unwrap_or_else(|e| e.into_inner());
            if t.events.is_sorted_by_key(|e| e.t) {
                return t.to_json();
            }
        }
        self.trace_snapshot().to_json()
    }

    pub(crate) fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_api(&self, api: Option<&'static str>) {
        *self.api.lock().unwrap_or_else(|e| e.into_inner()) = api;
    }

    /// The API route the call came by (`None`: a library call).
    pub(crate) fn api(&self) -> Option<&'static str> {
        *self.api.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn mark_deadline(&self) {
        self.deadline_hit.store(true, Ordering::SeqCst);
    }

    pub(crate) fn deadline_hit(&self) -> bool {
        self.deadline_hit.load(Ordering::SeqCst)
    }

    /// Sets the call's own bound on waiting without progress ([`crate::CallOptions`]),
    /// and the name errors give it.
    pub(crate) fn set_max_wait(&self, d: Option<Duration>, name: Option<String>) {
        *self.max_wait.lock().unwrap_or_else(|e| e.into_inner()) = d.map(|d| (d, name));
    }

    /// The name of the bound on this call's waits: the call's max wait when it is the
    /// lower one, else `RETRY__STALL_WINDOW_S` (SPEC §17.2: messages name the bound).
    pub(crate) fn wait_bound_name(&self, scope: &RetrySettings) -> String {
        match &*self.max_wait.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((d, name)) if *d < scope.stall_window => format!(
                "{} of {} s",
                name.as_deref()
                    .unwrap_or("the call's max wait (CallOptions::max_wait)"),
                d.as_secs_f64()
            ),
            _ => format!(
                "RETRY__STALL_WINDOW_S of {} s",
                scope.stall_window.as_secs_f64()
            ),
        }
    }

    /// The retry settings of this call: the scope's, with the stall window lowered to
    /// the call's `max_wait`.
    pub(crate) fn retry_settings(&self, scope: &RetrySettings) -> RetrySettings {
        let mut s = scope.clone();
        if let Some((w, _)) = *self.max_wait.lock().unwrap_or_else(|e| e.into_inner()) {
            s.stall_window = s.stall_window.min(w);
        }
        s
    }

    /// True the first time only: the logical call counts once in the scope's hedge
    /// budget, however many rounds or structured re-asks it runs.
    pub(crate) fn count_in_budget(&self) -> bool {
        !self.budget_counted.swap(true, Ordering::SeqCst)
    }

    /// Reserves the next attempt index (and counts a hedge leg, a resume leg).
    pub(crate) fn next_attempt(&self, is_hedge: bool, is_resume: bool) -> u32 {
        let mut p = self.progress();
        let i = p.attempts;
        p.attempts += 1;
        if is_hedge {
            p.hedges += 1;
        }
        if is_resume {
            p.resumes += 1;
        }
        i
    }

    pub(crate) fn note_refusals(&self, refusals: &[(String, Refusal)]) {
        let mut p = self.progress();
        for (name, r) in refusals {
            p.reasons
                .insert(name.clone(), SourceReason::Refused(r.reason));
            if r.reason.passes_with_time() {
                if let Some(ra) = r.retry_after {
                    p.hints.insert(name.clone(), self.clock.now() + ra);
                }
            }
        }
    }

    pub(crate) fn note_failure(&self, source: &str, error: &AttemptError) {
        let mut p = self.progress();
        p.reasons
            .insert(source.to_string(), SourceReason::Failed(error.label));
        p.failed.insert(source.to_string());
        if error.excludes_source {
            p.excluded.insert(source.to_string());
        }
        p.last_error = Some(error.clone());
        p.last_source = Some(source.to_string());
        match error.retry_after {
            Some(ra) => {
                p.hints.insert(source.to_string(), self.clock.now() + ra);
            }
            None => {
                p.hints.remove(source);
            }
        }
    }

    pub(crate) fn failed_sources(&self) -> BTreeSet<String> {
        self.progress().failed.clone()
    }

    /// Sources the call must not pick (see [`Progress::excluded`]).
    pub(crate) fn excluded_sources(&self) -> BTreeSet<String> {
        self.progress().excluded.clone()
    }

    /// Keeps these sources out of the call.
    pub(crate) fn exclude(&self, sources: impl IntoIterator<Item = String>) {
        self.progress().excluded.extend(sources);
    }

    pub(crate) fn note_tried(&self, source: &str) {
        let mut p = self.progress();
        if !p.tried.contains(source) {
            p.tried.insert(source.to_string());
        }
    }

    /// Indices of the sources an attempt of this call was sent to.
    pub(crate) fn tried_sources(&self, sources: &[polygw_core::SourceConfig]) -> BTreeSet<usize> {
        let p = self.progress();
        sources
            .iter()
            .enumerate()
            .filter(|(_, s)| p.tried.contains(&s.name))
            .map(|(i, _)| i)
            .collect()
    }

    /// The terminal error of this call, from what it has done so far.
    pub(crate) fn terminal(&self, reason: TerminalReason, detail: Option<String>) -> GatewayError {
        let p = self.progress();
        GatewayError::terminal(
            reason,
            FailureContext {
                logical_call_id: self.logical_call_id.clone(),
                last_error: p.last_error.clone().map(Box::new),
                last_source: p.last_source.clone(),
                reasons: p.reasons.clone(),
                attempts: p.attempts,
                retry_after: {
                    let now = self.clock.now();
                    p.hints
                        .values()
                        .filter(|at| **at > now)
                        .min()
                        .map(|at| *at - now)
                },
                detail,
            },
        )
    }
}
