//! The live latency (SPEC §19.1, §25.1), carried out: core's [`ScopeLatency`] for
//! streamed legs (first token, gaps) and one for plain legs (their whole answer), keyed
//! by upstream (base URL and model) in a book the process's scopes share
//! ([`UpstreamEvidence`]); each scope's thresholds in force per source from it,
//! recomputed at most every [`THRESHOLDS_TTL`] (a computation walks the sketches' bins)
//! and held steady (SPEC §25.2).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use polygw_core::hedge::{ThresholdSetting, Thresholds};
use polygw_core::latency::{GapTally, LatencySnapshot, LegTimes, ScopeLatency};
use polygw_core::ports::SourceSketch;
use polygw_core::threshold::{self, Steady};
use polygw_core::HedgeSettings;

/// How long computed thresholds are used before they are computed again.
pub(crate) const THRESHOLDS_TTL: Duration = Duration::from_secs(1);

/// A process's latency evidence per upstream (SPEC §25.1): streamed and plain legs'
/// distributions, keyed by upstream (base URL and model, [`upstream_id`]), shared by
/// every scope of the process that reaches that upstream — a quiet scope learns from a
/// busy one's legs to the same model. One book per window and governance backend (the
/// book's deltas go to that backend's shared store, SPEC §19.2).
#[derive(Debug)]
pub struct UpstreamEvidence {
    books: Mutex<[ScopeLatency; 2]>,
    window: Duration,
}

impl UpstreamEvidence {
    /// A book of its own, shared with no other client (what another process would
    /// have: tests that play several replicas in one process use it).
    pub fn isolated(window: Duration) -> Arc<UpstreamEvidence> {
        Arc::new(UpstreamEvidence {
            books: Mutex::new([ScopeLatency::new(window), ScopeLatency::new(window)]),
            window,
        })
    }

    /// The process's book for this window and governance backend (`backend`: a hash of
    /// its URL, 0 for in-memory governance), made on first use.
    pub(crate) fn shared(window: Duration, backend: u64) -> Arc<UpstreamEvidence> {
        type Registry = Mutex<HashMap<(Duration, u64), Weak<UpstreamEvidence>>>;
        static REGISTRY: OnceLock<Registry> = OnceLock::new();
        let mut map = REGISTRY
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(b) = map.get(&(window, backend)).and_then(Weak::upgrade) {
            return b;
        }
        map.retain(|_, w| w.strong_count() > 0);
        let b = UpstreamEvidence::isolated(window);
        map.insert((window, backend), Arc::downgrade(&b));
        b
    }

    fn books(&self) -> std::sync::MutexGuard<'_, [ScopeLatency; 2]> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An upstream's key in the evidence books and the shared store: base URL (without a
/// trailing `/`) and model, hashed (FNV-1a, 64 bits) so that a URL's characters never
/// reach a Redis key and a credential in it never leaves the process.
pub(crate) fn upstream_id(source: &polygw_core::SourceConfig) -> String {
    let base = source.base_url.trim_end_matches('/');
    let h = fnv1a(base.bytes().chain([b'\n']).chain(source.model.bytes()));
    format!("u{h:016x}")
}

/// The governance backend a scope's evidence is exchanged through, as a book key (a
/// hash of the Redis URL; 0 for in-memory governance).
pub(crate) fn backend_key(redis_url: Option<&polygw_core::Secret>) -> u64 {
    redis_url.map_or(0, |url| fnv1a(url.expose().bytes()) | 1)
}

/// FNV-1a, 64 bits.
fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What one scope keeps of its own: the thresholds last computed and where each stood.
#[derive(Debug)]
struct Local {
    /// (computed at, per source).
    cached: Option<(Instant, Vec<Thresholds>)>,
    /// Per source, the `auto` thresholds in force as they last were (first token,
    /// stall): each moves at most ×1.5 per `HEDGE__WINDOW_S` (SPEC §25.2).
    steady: Vec<[Option<Steady>; 2]>,
}

impl Local {
    fn new(sources: usize) -> Local {
        Local {
            cached: None,
            steady: vec![[None, None]; sources],
        }
    }
}

/// An `auto` threshold's learned value moved at most as fast as SPEC §25.2 allows from
/// where it last was (before the prior is blended in: the passage from the prior to
/// the learned value follows the evidence, DECISIONS 169); configured and off ones as
/// they are.
fn steadied(
    t: &mut polygw_core::hedge::ThresholdInForce,
    state: &mut Option<Steady>,
    now: Instant,
    window: Duration,
) {
    use polygw_core::hedge::ThresholdOrigin as O;
    if !matches!(t.origin, O::Source | O::Pooled) {
        return;
    }
    if let Some(target) = t.value {
        let next = Steady::next(*state, target, now, window);
        t.value = Some(next.value);
        *state = Some(next);
    }
}

/// A scope's view of the evidence: its sources' upstreams in the process's book, and
/// its own thresholds from them.
#[derive(Debug)]
pub(crate) struct EngineLatency {
    /// The settings in force (`auto` already off where it cannot fire).
    settings: HedgeSettings,
    /// Each source's upstream ([`upstream_id`]), indexed like the scope's sources.
    upstreams: Vec<String>,
    /// The distinct upstreams of the scope (its pool; what it exchanges).
    members: Vec<String>,
    evidence: Arc<UpstreamEvidence>,
    /// Streamed and plain (indexed by [`idx`]).
    local: Mutex<[Local; 2]>,
}

fn idx(stream: bool) -> usize {
    usize::from(stream)
}

impl EngineLatency {
    pub(crate) fn new(
        settings: HedgeSettings,
        sources: &[polygw_core::SourceConfig],
        evidence: Arc<UpstreamEvidence>,
    ) -> EngineLatency {
        let upstreams: Vec<String> = sources.iter().map(upstream_id).collect();
        let mut members = upstreams.clone();
        members.sort();
        members.dedup();
        let n = sources.len();
        EngineLatency {
            settings,
            upstreams,
            members,
            evidence,
            local: Mutex::new([Local::new(n), Local::new(n)]),
        }
    }

    fn local(&self) -> std::sync::MutexGuard<'_, [Local; 2]> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether distributions are kept (a trigger is `auto`).
    pub(crate) fn keeps(&self) -> bool {
        self.settings.uses_auto()
    }

    /// The floor of the gaps a leg's tally keeps one by one.
    pub(crate) fn gap_floor(&self) -> Duration {
        self.settings.stall_bounds.min
    }

    /// A leg on source `source` (its index in the scope) ended: its samples into its
    /// upstream's distributions.
    pub(crate) fn leg_ended(
        &self,
        stream: bool,
        source: usize,
        now: Instant,
        times: LegTimes,
        gaps: &GapTally,
    ) {
        if !self.keeps() {
            return;
        }
        let Some(up) = self.upstreams.get(source) else {
            return;
        };
        self.evidence.books()[idx(stream)].leg_ended(up, now, times, gaps);
    }

    /// The thresholds in force per source (indexed like the scope's sources) for a
    /// request streamed or not, and the round's triggers from them; `fill` is how full
    /// the scope's hedge budget is (the share they aim at: `hedge::aim_bp`).
    pub(crate) fn thresholds(&self, stream: bool, now: Instant, fill: f64) -> Vec<Thresholds> {
        let mut local = self.local();
        let local = &mut local[idx(stream)];
        if let Some((at, t)) = &local.cached {
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
        let mut t: Vec<Thresholds> = {
            let mut books = self.evidence.books();
            let book = &mut books[idx(stream)];
            self.upstreams
                .iter()
                .map(|u| book.learned_among(u, Some(&self.members), now, &settings, aim))
                .collect()
        };
        // The learned values held steady (SPEC §25.2), then blended with the priors by
        // the evidence (DECISIONS 169).
        for (t, state) in t.iter_mut().zip(local.steady.iter_mut()) {
            steadied(&mut t.after, &mut state[0], now, settings.window);
            steadied(&mut t.stall_after, &mut state[1], now, settings.window);
            threshold::blend_priors(t, &settings);
        }
        local.cached = Some((now, t.clone()));
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

    /// What this process recorded since the last call, per (streamed, upstream), for
    /// the shared store (SPEC §19.2): every upstream of the book, this scope's or not
    /// (each delta is taken once, by whichever scope exchanges first).
    pub(crate) fn take_deltas(&self) -> Vec<SourceSketch> {
        let mut books = self.evidence.books();
        let mut out = Vec::new();
        for streamed in [false, true] {
            for (source, snapshot) in books[idx(streamed)].take_deltas() {
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
        {
            let mut books = self.evidence.books();
            for v in views {
                books[idx(v.streamed)].set_remote(&v.source, v.snapshot);
            }
        }
        for l in self.local().iter_mut() {
            l.cached = None;
        }
    }

    /// The scope's distinct upstreams (what it exchanges).
    pub(crate) fn sources(&self) -> &[String] {
        &self.members
    }

    /// Each source's distributions at `now` (indexed like the scope's sources), for
    /// streamed or plain legs.
    pub(crate) fn views(&self, stream: bool, now: Instant) -> Vec<LatencySnapshot> {
        let mut books = self.evidence.books();
        let book = &mut books[idx(stream)];
        self.upstreams.iter().map(|u| book.view(u, now)).collect()
    }

    /// `HEDGE__WINDOW_S`.
    pub(crate) fn window(&self) -> Duration {
        self.evidence.window
    }

    /// Back to this process's own windows (the shared store is unreachable).
    pub(crate) fn clear_remote(&self) {
        for b in self.evidence.books().iter_mut() {
            b.clear_remote();
        }
        for l in self.local().iter_mut() {
            l.cached = None;
        }
    }
}

/// The round's per-source (first-token, stall) triggers.
pub(crate) fn triggers(t: &[Thresholds]) -> Vec<(Option<Duration>, Option<Duration>)> {
    t.iter()
        .map(|t| (t.after.value, t.stall_after.value))
        .collect()
}

/// The namespace of the shared store's latency keys: evidence is per upstream, not per
/// scope (SPEC §25.1), so every scope and replica reaching an upstream shares one.
pub(crate) const UPSTREAMS: &str = "upstreams";

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
            UPSTREAMS,
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
