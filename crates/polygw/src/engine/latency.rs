//! The scope's live latency (SPEC §19.1), carried out: core's [`ScopeLatency`] for
//! streamed legs (first token, gaps) and one for plain legs (their whole answer), behind
//! one mutex; the thresholds in force per source, recomputed at most every
//! [`THRESHOLDS_TTL`] (a computation walks the sketches' bins).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use polygw_core::hedge::{ThresholdSetting, Thresholds};
use polygw_core::latency::{GapTally, LatencySnapshot, LegTimes, ScopeLatency};
use polygw_core::ports::SourceSketch;
use polygw_core::threshold::{self, Steady};
use polygw_core::HedgeSettings;

/// How long computed thresholds are used before they are computed again.
pub(crate) const THRESHOLDS_TTL: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Book {
    latency: ScopeLatency,
    /// (computed at, per source) for the thresholds of `latency`.
    cached: Option<(Instant, Vec<Thresholds>)>,
    /// Per source, the `auto` thresholds in force as they last were (first token,
    /// stall): each moves at most ×1.5 per `HEDGE__WINDOW_S` (SPEC §25.2).
    steady: Vec<[Option<Steady>; 2]>,
}

impl Book {
    fn new(window: Duration, sources: usize) -> Book {
        Book {
            latency: ScopeLatency::new(window),
            cached: None,
            steady: vec![[None, None]; sources],
        }
    }
}

/// An `auto` threshold moved at most as fast as SPEC §25.2 allows from where it last
/// was; configured and off ones as they are.
fn steadied(
    t: &mut polygw_core::hedge::ThresholdInForce,
    state: &mut Option<Steady>,
    now: Instant,
    window: Duration,
) {
    use polygw_core::hedge::ThresholdOrigin as O;
    if !matches!(t.origin, O::Source | O::Pooled | O::Prior) {
        return;
    }
    if let Some(target) = t.value {
        let next = Steady::next(*state, target, now, window);
        t.value = Some(next.value);
        *state = Some(next);
    }
}

/// Streamed and plain legs' distributions of one scope.
#[derive(Debug)]
pub(crate) struct EngineLatency {
    /// The settings in force (`auto` already off where it cannot fire).
    settings: HedgeSettings,
    sources: Vec<String>,
    books: Mutex<[Book; 2]>,
}

fn idx(stream: bool) -> usize {
    usize::from(stream)
}

impl EngineLatency {
    pub(crate) fn new(settings: HedgeSettings, sources: Vec<String>) -> EngineLatency {
        let n = sources.len();
        EngineLatency {
            settings,
            sources,
            books: Mutex::new([Book::new(settings.window, n), Book::new(settings.window, n)]),
        }
    }

    fn books(&self) -> std::sync::MutexGuard<'_, [Book; 2]> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether distributions are kept (a trigger is `auto`).
    pub(crate) fn keeps(&self) -> bool {
        self.settings.uses_auto()
    }

    /// The floor of the gaps a leg's tally keeps one by one.
    pub(crate) fn gap_floor(&self) -> Duration {
        self.settings.stall_bounds.min
    }

    /// A leg ended: its samples into its source's distributions.
    pub(crate) fn leg_ended(
        &self,
        stream: bool,
        source: &str,
        now: Instant,
        times: LegTimes,
        gaps: &GapTally,
    ) {
        if !self.keeps() {
            return;
        }
        self.books()[idx(stream)]
            .latency
            .leg_ended(source, now, times, gaps);
    }

    /// The thresholds in force per source (indexed like the scope's sources) for a
    /// request streamed or not, and the round's triggers from them; `fill` is how full
    /// the scope's hedge budget is (the share they aim at: `hedge::aim_bp`).
    pub(crate) fn thresholds(&self, stream: bool, now: Instant, fill: f64) -> Vec<Thresholds> {
        let mut books = self.books();
        let book = &mut books[idx(stream)];
        if let Some((at, t)) = &book.cached {
            if now.saturating_duration_since(*at) < THRESHOLDS_TTL {
                return t.clone();
            }
        }
        let mut settings = self.settings;
        if !stream {
            settings.stall_after = ThresholdSetting::Off;
            // A plain answer's "first token" is the whole answer, as long as its output:
            // no fixed prior fits it, so plain calls hedge once there is evidence, as
            // before (DECISIONS 169).
            settings.priors.after = None;
        }
        let aim = polygw_core::hedge::aim_bp(settings.budget_pct.saturating_mul(100), fill);
        let mut t: Vec<Thresholds> = self
            .sources
            .iter()
            .map(|s| book.latency.thresholds(s, now, &settings, aim))
            .collect();
        for (t, state) in t.iter_mut().zip(book.steady.iter_mut()) {
            steadied(&mut t.after, &mut state[0], now, settings.window);
            steadied(&mut t.stall_after, &mut state[1], now, settings.window);
        }
        book.cached = Some((now, t.clone()));
        t
    }

    /// The thresholds of [`EngineLatency::thresholds`] for one request: the prior's
    /// part of each first-token threshold scaled by the request's prompt and reasoning
    /// effort (SPEC §25.1, `threshold::request_prior_factor`), within the bounds.
    pub(crate) fn for_request(
        &self,
        mut t: Vec<Thresholds>,
        stream: bool,
        prompt_tokens: u64,
        effort: Option<&str>,
    ) -> Vec<Thresholds> {
        let Some(prior) = self.settings.priors.after.filter(|_| stream) else {
            return t;
        };
        let factor = threshold::request_prior_factor(prior, prompt_tokens, effort);
        if factor <= 1.0 {
            return t;
        }
        for t in &mut t {
            if t.after.prior_bp > 0 {
                t.after.value = t.after.value.map(|v| {
                    let w = f64::from(t.after.prior_bp) / 10_000.0;
                    let scaled = threshold::for_request(v, w, factor);
                    scaled.min(self.settings.after_bounds.max.max(v))
                });
            }
        }
        t
    }

    /// What this process recorded since the last call, per (streamed, source), for the
    /// shared store (SPEC §19.2).
    pub(crate) fn take_deltas(&self) -> Vec<SourceSketch> {
        let mut books = self.books();
        let mut out = Vec::new();
        for streamed in [false, true] {
            for (source, snapshot) in books[idx(streamed)].latency.take_deltas() {
                out.push(SourceSketch {
                    streamed,
                    source,
                    snapshot,
                });
            }
        }
        out
    }

    /// Installs the merged views read back from the shared store.
    pub(crate) fn set_remote(&self, views: Vec<SourceSketch>) {
        let mut books = self.books();
        for v in views {
            let b = &mut books[idx(v.streamed)];
            b.latency.set_remote(&v.source, v.snapshot);
            b.cached = None;
        }
    }

    /// The sources' names.
    pub(crate) fn sources(&self) -> &[String] {
        &self.sources
    }

    /// Each source's distributions at `now` (indexed like the scope's sources), for
    /// streamed or plain legs.
    pub(crate) fn views(&self, stream: bool, now: Instant) -> Vec<LatencySnapshot> {
        let mut books = self.books();
        let book = &mut books[idx(stream)];
        self.sources
            .iter()
            .map(|s| book.latency.view(s, now))
            .collect()
    }

    /// `HEDGE__WINDOW_S`.
    pub(crate) fn window(&self) -> Duration {
        self.settings.window
    }

    /// Back to this process's own windows (the shared store is unreachable).
    pub(crate) fn clear_remote(&self) {
        let mut books = self.books();
        for b in books.iter_mut() {
            b.latency.clear_remote();
            b.cached = None;
        }
    }
}

/// The round's per-source (first-token, stall) triggers.
pub(crate) fn triggers(t: &[Thresholds]) -> Vec<(Option<Duration>, Option<Duration>)> {
    t.iter()
        .map(|t| (t.after.value, t.stall_after.value))
        .collect()
}

/// How often a process exchanges its latency deltas with the shared store.
pub(crate) const EXCHANGE_EVERY: Duration = Duration::from_secs(5);

/// Exchanges the engine's latency with the shared store (SPEC §19.2) at once and then
/// every [`EXCHANGE_EVERY`], while the engine lives. A failed exchange falls back to this
/// process's own windows (warned once a minute at most) until one succeeds again.
pub(crate) async fn exchange_loop(engine: std::sync::Weak<super::Engine>) {
    let mut warned: Option<Instant> = None;
    loop {
        let Some(e) = engine.upgrade() else { return };
        if let Err(err) = exchange_once(&e).await {
            let now = e.ports.clock.now();
            if warned.is_none_or(|w| now.saturating_duration_since(w) >= Duration::from_secs(60)) {
                warned = Some(now);
                tracing::warn!(scope = %e.scope.name, error = %err, "sharing latency distributions failed: hedging on this process's own until it works again");
            }
        }
        drop(e);
        tokio::time::sleep(EXCHANGE_EVERY).await;
    }
}

/// One exchange with the shared store: this process's deltas out, the merged views in
/// (on failure, back to the process's own windows). Without a shared store: nothing.
pub(crate) async fn exchange_once(e: &super::Engine) -> Result<(), polygw_core::GovernanceError> {
    let Some(store) = e.ports.latency.clone() else {
        return Ok(());
    };
    let deltas = e.latency.take_deltas();
    let r = store
        .exchange(
            &e.scope.name,
            e.ports.clock.unix_ms(),
            e.latency.window(),
            deltas,
            e.latency.sources().to_vec(),
        )
        .await;
    match r {
        Ok(views) => {
            e.latency.set_remote(views);
            Ok(())
        }
        Err(err) => {
            e.latency.clear_remote();
            Err(err)
        }
    }
}
