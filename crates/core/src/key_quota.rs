//! Client-key quotas (SPEC §21.1, issue 26 item 1) as pure rules and a pure model on Unix
//! millisecond timestamps: what a call reserves against its key, what it settles, the UTC
//! budget periods, and [`KeyQuotas`], the reference every backend mirrors (the memory
//! backend runs it as is; the Redis scripts `key_*.lua` mirror it; the contract suite and
//! the proptests compare against it).
//!
//! A key is admitted **once per client call** (the request the client made to polygw),
//! not per upstream attempt: its RPM counts the client's requests, its concurrency the
//! client's calls in flight, its TPM and spend the tokens and cost of all the call's
//! attempts, settled when the call ends.
//!
//! - **Requests** (key RPM) and **tokens** (key TPM): the rolling 60 s windows of the
//!   sources ([`crate::window`]): a request counts for 60 s from admission; a token
//!   reservation until it is settled (or its lease ended + 60 s), then the settled amount
//!   for 60 s from the settlement.
//! - **Slots** (key concurrency): a lease from admission until the permit is finished or
//!   its lease ends; renewed by the heartbeat; never revived once ended.
//! - **Money** (budgets), integer nanos: the reservation (`reserve_nanos`) is held while
//!   the call is in flight. When the call finishes, its actual cost is *settled* in the
//!   UTC day and month of the settlement, and the reservation is gone. A call whose lease
//!   ends unfinished (a crashed holder) is settled at its reservation at its lease end.
//!   Admission refuses when `settled in the current period + every reservation in
//!   flight + this reservation > budget` — month first, then day, so the reason named is
//!   the one that clears last — with a hint that says which case it is (SPEC §24.2):
//!   none for a reservation above the budget itself (it never passes), a short one
//!   ([`IN_FLIGHT_RETRY_MS`]) when the settled spend alone leaves room (calls in flight
//!   hold the rest), else the period's end. An unsettled reservation counts in the current period whatever
//!   period it was made in: it can only settle now or later, so wherever it settles it
//!   may land in this period; counting it here is what keeps spend within the budget
//!   (see the invariant in the tests) across a period's end.
//!
//! The invariant: when every call's actual cost is at most its reservation, the spend
//! settled in any period never exceeds that period's budget.
//!
//! Time never goes back inside the model (every operation first raises its clock to the
//! latest `now` it has seen), as in [`crate::window`].

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::client_key::{BudgetPeriod, NANOS_PER_UNIT};
use crate::error::RefusalReason;
use crate::ports::keys::{KeyAcquire, KeyUsage};
use crate::ports::limiter::Refusal;
use crate::source::{effective_est_tokens, SourceConfig};
use crate::window::{lease_ms, IdMap, Requests, Tokens};

/// One UTC day, in ms.
pub const DAY_MS: u64 = 86_400_000;

/// The hint of a budget refusal whose budget is held only by calls in flight (SPEC §24.2:
/// a short `Retry-After`; the calls settle, usually below their reservations). The Redis
/// script `key_acquire.lua` uses the same figure.
pub const IN_FLIGHT_RETRY_MS: u64 = 1_000;

// === impl periods ===

/// Days since 1970-01-01 → (year, month 1–12, day 1–31), proleptic Gregorian (H. Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// (year, month 1–12, day) → days since 1970-01-01 (`days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The id of the UTC period holding `unix_ms`: days since the epoch for a day, months
/// since January 1970 for a month. Ids only grow with time.
pub fn period_id(period: BudgetPeriod, unix_ms: u64) -> u64 {
    let day = unix_ms / DAY_MS;
    match period {
        BudgetPeriod::Day => day,
        BudgetPeriod::Month => {
            let (y, m, _) = civil_from_days(day as i64);
            ((y - 1970) * 12 + i64::from(m) - 1) as u64
        }
    }
}

/// When period `id` starts, ms since the epoch.
pub fn period_start_ms(period: BudgetPeriod, id: u64) -> u64 {
    match period {
        BudgetPeriod::Day => id.saturating_mul(DAY_MS),
        BudgetPeriod::Month => {
            let y = 1970 + (id / 12) as i64;
            let m = (id % 12) as u32 + 1;
            (days_from_civil(y, m, 1) as u64).saturating_mul(DAY_MS)
        }
    }
}

/// When the period holding `unix_ms` ends (the next one's start), ms since the epoch:
/// when a budget refusal of that period clears.
pub fn period_end_ms(period: BudgetPeriod, unix_ms: u64) -> u64 {
    period_start_ms(period, period_id(period, unix_ms) + 1)
}

/// `unix_ms` as `YYYY-MM-DDTHH:MM:SSZ` (a reset time in an error body).
pub fn format_utc(unix_ms: u64) -> String {
    let (y, mo, d) = civil_from_days((unix_ms / DAY_MS) as i64);
    let s = (unix_ms % DAY_MS) / 1000;
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// The refusal reason of a period's budget.
pub fn budget_reason(period: BudgetPeriod) -> RefusalReason {
    match period {
        BudgetPeriod::Day => RefusalReason::KeyBudgetDay,
        BudgetPeriod::Month => RefusalReason::KeyBudgetMonth,
    }
}

// === impl pricing ===

/// A price (currency units per 1M tokens, or per call) in nanos, rounded to the nearest;
/// `None` for a price that is not a finite number ≥ 0.
pub fn price_nanos(price: f64) -> Option<u64> {
    if !price.is_finite() || price < 0.0 {
        return None;
    }
    // `as` saturates for values beyond u64.
    Some((price * NANOS_PER_UNIT as f64).round() as u64)
}

/// A recorded cost (currency units, a telemetry row's `cost`) in nanos, rounded to the
/// nearest; 0 for a value that is not a finite number ≥ 0.
pub fn cost_nanos(cost: f64) -> u64 {
    price_nanos(cost).unwrap_or(0)
}

/// The highest prices of a scope's sources, in nanos (per 1M tokens; per call): a call may
/// go to any of them, so its reservation takes the dearest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScopePrices {
    /// Highest input-side price (`INPUT_PRICE`, `CACHE_WRITE_PRICE`,
    /// `CACHE_WRITE_1H_PRICE`), nanos per 1M tokens.
    pub input: Option<u64>,
    /// Highest `OUTPUT_PRICE`, nanos per 1M tokens.
    pub output: Option<u64>,
    /// Highest `PRICE_PER_CALL`, nanos.
    pub per_call: Option<u64>,
}

impl ScopePrices {
    /// The highest of each price over `sources` (a source without a price adds nothing).
    pub fn highest<'a>(sources: impl IntoIterator<Item = &'a SourceConfig>) -> Self {
        let max = |a: Option<u64>, b: Option<f64>| match (a, b.and_then(price_nanos)) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        sources
            .into_iter()
            .fold(ScopePrices::default(), |p, s| ScopePrices {
                // The dearest input-side price: a prompt may be written to the cache.
                input: max(
                    max(max(p.input, s.input_price), s.cache_write_price),
                    s.cache_write_1h_price,
                ),
                output: max(p.output, s.output_price),
                per_call: max(p.per_call, s.price_per_call),
            })
    }

    /// What a call of `prompt_tokens` in and up to `output_tokens` out may cost at these
    /// prices, in nanos rounded up: `prompt × input + output × output` (a side with no
    /// tokens needs no price), or the per-call price if higher. `None` when no price is
    /// known at all, or the tokens have a side without a price and there is no per-call
    /// price: the cost cannot be known.
    pub fn reserve_nanos(&self, prompt_tokens: u64, output_tokens: u64) -> Option<u64> {
        if self.input.is_none() && self.output.is_none() && self.per_call.is_none() {
            return None;
        }
        let part = |tokens: u64, price: Option<u64>| -> Option<u128> {
            match (tokens, price) {
                (0, _) => Some(0),
                (t, Some(p)) => Some(u128::from(t) * u128::from(p)),
                (_, None) => None,
            }
        };
        let tokens = part(prompt_tokens, self.input)
            .zip(part(output_tokens, self.output))
            .map(|(a, b)| {
                // Prices are per 1M tokens: nanos = ⌈Σ tokens × price / 10⁶⌉.
                u64::try_from((a + b).div_ceil(1_000_000)).unwrap_or(u64::MAX)
            });
        match (tokens, self.per_call) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The output a call may produce: the request's cap ([`crate::ChatRequest::output_cap`]:
/// any of its cap fields, times `n`), else the highest reservation of the scope's
/// sources (`effective_est_tokens()`: `EST_TOKENS`, or one second of the tightest TPM),
/// else 0.
pub fn output_estimate(max_tokens: Option<u64>, sources: &[SourceConfig], scope_tpm: u64) -> u64 {
    match max_tokens {
        Some(m) => m,
        None => sources
            .iter()
            .map(|s| effective_est_tokens(s.est_tokens, s.tpm, scope_tpm))
            .max()
            .unwrap_or(0),
    }
}

/// What a call reserves against its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyReservation {
    /// Tokens for the key's TPM: the estimated prompt plus the output estimate.
    pub tokens: u64,
    /// Money for the budgets, nanos; `None` when the scope has no prices.
    pub nanos: Option<u64>,
}

impl KeyReservation {
    /// The money to reserve (`KeyAcquire::reserve_nanos`) for a key that has a budget
    /// (`budgeted`) or not. A budgeted key on a scope without prices is refused
    /// (`key_budget_unpriced`, no hint: it never passes with time) — what the call costs
    /// cannot be known, so no budget could hold it. A key without budget reserves 0 there.
    pub fn reserve_nanos(&self, budgeted: bool) -> Result<u64, Refusal> {
        match (self.nanos, budgeted) {
            (Some(n), _) => Ok(n),
            (None, false) => Ok(0),
            (None, true) => Err(Refusal {
                reason: RefusalReason::KeyBudgetUnpriced,
                retry_after: None,
            }),
        }
    }
}

/// A call's reservation against its key (SPEC §21.1, §24.1): `prompt_tokens` (the
/// request's estimated prompt, [`crate::resume::estimate_prompt_tokens`]) plus the
/// [`output_estimate`]; its money prices the prompt with `margin_pct` percent more
/// ([`crate::key_funds::with_margin`]) and the output at the highest prices of the
/// scope's `sources`, so that it covers the call's first leg on any of them.
pub fn key_reservation(
    prompt_tokens: u64,
    max_tokens: Option<u64>,
    margin_pct: u64,
    sources: &[SourceConfig],
    scope_tpm: u64,
) -> KeyReservation {
    let output = output_estimate(max_tokens, sources, scope_tpm);
    KeyReservation {
        tokens: prompt_tokens.saturating_add(output),
        nanos: ScopePrices::highest(sources).reserve_nanos(
            crate::key_funds::with_margin(prompt_tokens, margin_pct),
            output,
        ),
    }
}

/// What a finished call settles against its budgets, nanos (`KeyPermit::finish`'s
/// `cost_nanos`): the sum of its rows' costs (one per attempt), each rounded to the
/// nearest nano. A cost that is unknown (`None`, a NULL cost: no usage, no price, a
/// failed attempt that may have been billed) makes the settlement conservative: at least
/// the reservation (and never less than the costs that are known). Pass `Some(0.0)` for
/// an attempt that is known to cost nothing (a cache hit; a rejected request, a dead
/// source: SPEC §4.3 settles them at 0 tokens). No rows (no attempt made): 0.
pub fn settlement_nanos(reserve_nanos: u64, costs: impl IntoIterator<Item = Option<f64>>) -> u64 {
    let mut known = 0u64;
    let mut unknown = false;
    for c in costs {
        match c {
            Some(c) => known = known.saturating_add(cost_nanos(c)),
            None => unknown = true,
        }
    }
    if unknown {
        known.max(reserve_nanos)
    } else {
        known
    }
}

/// A key's spend in the current UTC day and month, as its telemetry rows settle it
/// ([`restored_spend`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoredSpend {
    /// Settled in the current day, nanos.
    pub day_nanos: u64,
    /// Settled in the current month, nanos.
    pub month_nanos: u64,
    /// Rows whose cost is unknown and unbounded (counted as 0).
    pub unbounded_rows: u64,
}

/// What each client key spent in the current UTC day and month at `now_ms`, from its
/// calls' rows (SPEC §24.2: restoring a memory backend's spend after a restart): each
/// attempt row at [`crate::telemetry::key_cost`] — an attempt no provider billed at 0 —
/// and one of unknown cost at `bound(row)`, the upper bound of what it may have cost
/// (SPEC §20.4), counted in `unbounded_rows` (and as 0) when there is none. Rows of no
/// key, of another period, and terminal rows count nothing.
pub fn restored_spend<'r>(
    rows: impl IntoIterator<Item = &'r crate::telemetry::TelemetryRow>,
    now_ms: u64,
    bound: impl Fn(&crate::telemetry::TelemetryRow) -> Option<f64>,
) -> HashMap<String, RestoredSpend> {
    use crate::telemetry::{key_cost, RowKind};
    let day = period_id(BudgetPeriod::Day, now_ms);
    let month = period_id(BudgetPeriod::Month, now_ms);
    let mut out: HashMap<String, RestoredSpend> = HashMap::new();
    for r in rows {
        let (Some(key), RowKind::Attempt | RowKind::CacheHit) = (&r.client_key_id, r.kind) else {
            continue;
        };
        let Ok(at) = u64::try_from(r.created_at_ms) else {
            continue;
        };
        if period_id(BudgetPeriod::Month, at) != month {
            continue;
        }
        let e = out.entry(key.clone()).or_default();
        let nanos = match key_cost(r).or_else(|| bound(r)) {
            Some(c) => cost_nanos(c),
            None => {
                e.unbounded_rows += 1;
                0
            }
        };
        e.month_nanos = e.month_nanos.saturating_add(nanos);
        if period_id(BudgetPeriod::Day, at) == day {
            e.day_nanos = e.day_nanos.saturating_add(nanos);
        }
    }
    out
}

/// Whether `key_id` can name a key's state in every backend (not empty; no braces, which
/// would break the Redis hash tag and so the atomicity of its script on a cluster).
pub fn valid_key_id(key_id: &str) -> bool {
    !key_id.is_empty() && !key_id.contains(['{', '}'])
}

// === impl KeyQuotas ===

/// A live lease: its end and the money it reserves.
#[derive(Debug, Clone, Copy)]
struct Lease {
    end: u64,
    nanos: u64,
    /// A top-up's lease: money only, no concurrency slot.
    top_up: bool,
}

/// The settled spend of one period.
#[derive(Debug, Clone, Copy, Default)]
struct Spend {
    id: u64,
    settled: u64,
}

#[derive(Debug, Default, Clone)]
struct KeyState {
    requests: Requests,
    tokens: Tokens,
    /// Live leases (slots with their money reservation): id → lease.
    leases: IdMap<Lease>,
    /// (lease end, id), for expiry in end order.
    by_end: BTreeSet<(u64, u64)>,
    /// Σ nanos of the live leases.
    reserved: u64,
    /// Live leases that are top-ups (not calls in flight).
    top_ups: u64,
    day: Spend,
    month: Spend,
}

impl KeyState {
    /// Moves the periods on to those of `at` (a new period starts with nothing settled).
    fn roll(&mut self, at: u64) {
        for (p, s) in [
            (BudgetPeriod::Day, &mut self.day),
            (BudgetPeriod::Month, &mut self.month),
        ] {
            let id = period_id(p, at);
            if id > s.id {
                *s = Spend { id, settled: 0 };
            }
        }
    }

    /// Settles `nanos` at time `at` (in its day and month).
    fn charge(&mut self, at: u64, nanos: u64) {
        self.roll(at);
        for (p, s) in [
            (BudgetPeriod::Day, &mut self.day),
            (BudgetPeriod::Month, &mut self.month),
        ] {
            // Only an earlier period than the one already seen could differ (a clock that
            // went back): that period is over, nothing of it is kept.
            if period_id(p, at) == s.id {
                s.settled = s.settled.saturating_add(nanos);
            }
        }
    }

    /// Brings the state to `now`: leases that ended are settled at their reservation at
    /// their end, in end order; windows pruned; periods rolled.
    fn advance(&mut self, now: u64) {
        while let Some(&(end, id)) = self.by_end.first() {
            if end > now {
                break;
            }
            self.by_end.pop_first();
            if let Some(l) = self.leases.remove(&id) {
                self.reserved -= l.nanos;
                self.top_ups -= u64::from(l.top_up);
                self.charge(end, l.nanos);
            }
        }
        self.roll(now);
        self.requests.prune(now);
        self.tokens.prune(now);
    }

    /// Calls in flight (live leases that are not top-ups).
    fn in_flight(&self) -> u64 {
        self.leases.len() as u64 - self.top_ups
    }

    fn spent(&self, period: BudgetPeriod) -> u64 {
        let s = match period {
            BudgetPeriod::Day => self.day,
            BudgetPeriod::Month => self.month,
        };
        s.settled.saturating_add(self.reserved)
    }

    fn holds(&self, id: u64) -> bool {
        self.leases.contains_key(&id) || self.tokens.holds(id)
    }

    /// Whether nothing is remembered that still counts at `now` (after `advance(now)`).
    fn is_empty(&self) -> bool {
        self.leases.is_empty()
            && self.requests.is_empty()
            && self.tokens.is_empty()
            && self.day.settled == 0
            && self.month.settled == 0
    }
}

/// The reference model of client-key governance. Not thread-safe by itself: wrap it in a
/// mutex. Times are Unix ms (budgets are calendar periods).
#[derive(Debug, Default, Clone)]
pub struct KeyQuotas {
    keys: HashMap<Arc<str>, KeyState>,
    /// permit id → its key.
    permits: IdMap<Arc<str>>,
    next_id: u64,
    clock: u64,
}

impl KeyQuotas {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    fn tick(&mut self, now: u64) -> u64 {
        self.clock = self.clock.max(now);
        self.clock
    }

    /// The model's current time (the latest `now` it has seen).
    pub fn now(&self) -> u64 {
        self.clock
    }

    /// Admits or refuses one client call at `now`; on admission returns the permit id.
    /// Checks, in order: concurrency, RPM, TPM, the month's budget, the day's. A refusal
    /// records nothing.
    pub fn acquire(&mut self, now: u64, req: &KeyAcquire<'_>) -> Result<u64, Refusal> {
        let now = self.tick(now);
        let name: Arc<str> = match self.keys.get_key_value(req.key_id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(req.key_id),
        };
        let st = self.keys.entry(name.clone()).or_default();
        st.advance(now);
        let refuse = |reason, hint: Option<u64>| Refusal {
            reason,
            retry_after: hint.map(Duration::from_millis),
        };
        let call = !req.top_up;
        if call && req.max_concurrency > 0 && st.in_flight() >= u64::from(req.max_concurrency) {
            let hint = st.by_end.first().map(|&(end, _)| end - now);
            return Err(refuse(RefusalReason::KeyConcurrency, hint));
        }
        if call && req.rpm > 0 && st.requests.count() >= u64::from(req.rpm) {
            let hint = st.requests.hint(now, u64::from(req.rpm));
            return Err(refuse(RefusalReason::KeyRpm, hint));
        }
        if call && req.tpm > 0 && st.tokens.total.saturating_add(req.est_tokens) > req.tpm {
            let hint = st.tokens.hint(now, req.tpm, req.est_tokens);
            return Err(refuse(RefusalReason::KeyTpm, hint));
        }
        for (period, budget) in [
            (BudgetPeriod::Month, req.budget_month_nanos),
            (BudgetPeriod::Day, req.budget_day_nanos),
        ] {
            let Some(limit) = budget else { continue };
            if st.spent(period).saturating_add(req.reserve_nanos) > limit {
                let settled = st.spent(period) - st.reserved;
                let hint = if req.reserve_nanos > limit {
                    // Above the budget itself: it never passes.
                    None
                } else if settled.saturating_add(req.reserve_nanos) <= limit {
                    // Held only by calls in flight: it passes when they settle.
                    Some(IN_FLIGHT_RETRY_MS)
                } else {
                    // Spent for the period: it passes when the period ends.
                    Some((period_end_ms(period, now) - now).max(1))
                };
                return Err(refuse(budget_reason(period), hint));
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        let end = now.saturating_add(lease_ms(req.lease));
        if call {
            st.requests.push(now);
            st.tokens.reserve(id, end, req.est_tokens);
        }
        st.leases.insert(
            id,
            Lease {
                end,
                nanos: req.reserve_nanos,
                top_up: req.top_up,
            },
        );
        st.by_end.insert((end, id));
        st.reserved += req.reserve_nanos;
        st.top_ups += u64::from(req.top_up);
        self.permits.insert(id, name);
        Ok(id)
    }

    /// Finishes permit `id` at `now`: its slot is freed; its money reservation is replaced
    /// by `cost_nanos`, settled now; its token reservation by `tokens`, counted for one
    /// window from now. Only the first finish counts. A permit whose lease has ended was
    /// settled at its reservation then: its money is not settled again (its tokens are,
    /// while their reservation is still in the window, as for a source permit).
    pub fn finish(&mut self, now: u64, id: u64, tokens: u64, cost_nanos: u64) {
        let now = self.tick(now);
        let Some(name) = self.permits.get(&id) else {
            return;
        };
        let Some(st) = self.keys.get_mut(name) else {
            self.permits.remove(&id);
            return;
        };
        st.advance(now);
        if let Some(l) = st.leases.remove(&id) {
            st.by_end.remove(&(l.end, id));
            st.reserved -= l.nanos;
            st.top_ups -= u64::from(l.top_up);
            st.charge(now, cost_nanos);
        }
        st.tokens.settle(now, id, tokens);
        if !st.holds(id) {
            self.permits.remove(&id);
        }
    }

    /// Restores a key's spend settled earlier in the current day and month (SPEC §24.2:
    /// a memory backend's spend survives a restart, seeded from telemetry): the periods'
    /// settled spend becomes at least `day_nanos` and `month_nanos` (never less than what
    /// this process settled already: restoring twice changes nothing).
    pub fn restore(&mut self, now: u64, key_id: &str, day_nanos: u64, month_nanos: u64) {
        let now = self.tick(now);
        let st = self.keys.entry(Arc::from(key_id)).or_default();
        st.advance(now);
        st.day.settled = st.day.settled.max(day_nanos);
        st.month.settled = st.month.settled.max(month_nanos.max(day_nanos));
    }

    /// The heartbeat: extends permit `id`'s lease (slot, money and token reservations) to
    /// `now + lease`, only if it has not ended (never shortens one, never revives one).
    pub fn renew(&mut self, now: u64, id: u64, lease: Duration) {
        let now = self.tick(now);
        let until = now.saturating_add(lease_ms(lease));
        let Some(st) = self.permits.get(&id).and_then(|k| self.keys.get_mut(k)) else {
            return;
        };
        st.advance(now);
        if let Some(l) = st.leases.get_mut(&id) {
            if until > l.end {
                st.by_end.remove(&(l.end, id));
                l.end = until;
                st.by_end.insert((until, id));
            }
        }
        st.tokens.renew(now, id, until);
    }

    /// A key's figures at `now`.
    pub fn usage(&mut self, now: u64, key_id: &str) -> KeyUsage {
        let now = self.tick(now);
        let Some(st) = self.keys.get_mut(key_id) else {
            return KeyUsage {
                now_unix_ms: now,
                ..KeyUsage::default()
            };
        };
        st.advance(now);
        KeyUsage {
            now_unix_ms: now,
            in_flight: u32::try_from(st.in_flight()).unwrap_or(u32::MAX),
            requests: st.requests.count(),
            tokens: st.tokens.total,
            reserved_nanos: st.reserved,
            day_nanos: st.spent(BudgetPeriod::Day),
            month_nanos: st.spent(BudgetPeriod::Month),
        }
    }

    /// Whether permit `id` still holds anything (a lease, or tokens in the window) at `now`.
    pub fn holds(&mut self, now: u64, id: u64) -> bool {
        let now = self.tick(now);
        let Some(st) = self.permits.get(&id).and_then(|k| self.keys.get_mut(k)) else {
            return false;
        };
        st.advance(now);
        st.holds(id)
    }

    /// Forgets the keys that hold nothing that counts any more (no lease, empty windows,
    /// nothing settled in the current day and month) and the permits that hold nothing.
    pub fn compact(&mut self, now: u64) {
        let now = self.tick(now);
        self.keys.retain(|_, st| {
            st.advance(now);
            !st.is_empty()
        });
        let keys = &self.keys;
        self.permits
            .retain(|id, k| keys.get(k).is_some_and(|st| st.holds(*id)));
    }

    /// Keys remembered (tests: bounded memory).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::WINDOW_MS;
    use proptest::prelude::*;

    const NANO: u64 = NANOS_PER_UNIT;

    /// 2024-01-31T23:59:00Z: a minute before a day's and a month's end.
    const JAN31_2359: u64 = 1_706_745_540_000;

    fn key<'a>(id: &'a str) -> KeyAcquire<'a> {
        KeyAcquire {
            key_id: id,
            rpm: 0,
            tpm: 0,
            max_concurrency: 0,
            budget_day_nanos: None,
            budget_month_nanos: None,
            est_tokens: 0,
            reserve_nanos: 0,
            lease: Duration::from_secs(30),
            top_up: false,
        }
    }

    #[test]
    fn periods_are_utc_calendar_days_and_months() {
        assert_eq!(format_utc(JAN31_2359), "2024-01-31T23:59:00Z");
        assert_eq!(period_id(BudgetPeriod::Month, 0), 0);
        assert_eq!(period_id(BudgetPeriod::Month, JAN31_2359), 54 * 12);
        let feb1 = JAN31_2359 + 60_000;
        assert_eq!(format_utc(feb1), "2024-02-01T00:00:00Z");
        assert_eq!(period_end_ms(BudgetPeriod::Day, JAN31_2359), feb1);
        assert_eq!(period_end_ms(BudgetPeriod::Month, JAN31_2359), feb1);
        assert_eq!(period_id(BudgetPeriod::Month, feb1), 54 * 12 + 1);
        assert_eq!(period_id(BudgetPeriod::Month, feb1 - 1), 54 * 12);
        // 2024 is a leap year: February has 29 days.
        let mar1 = period_end_ms(BudgetPeriod::Month, feb1);
        assert_eq!(format_utc(mar1), "2024-03-01T00:00:00Z");
        assert_eq!(mar1 - feb1, 29 * DAY_MS);
        assert_eq!(
            format_utc(period_end_ms(BudgetPeriod::Month, 1_735_689_599_999)),
            "2025-01-01T00:00:00Z"
        );
        assert_eq!(
            format_utc(period_start_ms(BudgetPeriod::Month, 0)),
            "1970-01-01T00:00:00Z"
        );
    }

    proptest! {
        /// A period's id only grows with time, its start is at or before the time and its
        /// end after it, and the next period starts at the end; round trip with the civil
        /// calendar.
        #[test]
        fn period_ids_are_consistent(ms in 0u64..8_000_000_000_000, dt in 0u64..100 * DAY_MS) {
            for p in [BudgetPeriod::Day, BudgetPeriod::Month] {
                let id = period_id(p, ms);
                prop_assert!(period_start_ms(p, id) <= ms);
                prop_assert!(period_end_ms(p, ms) > ms);
                prop_assert_eq!(period_id(p, period_end_ms(p, ms)), id + 1);
                prop_assert_eq!(period_id(p, period_end_ms(p, ms) - 1), id);
                prop_assert!(period_id(p, ms + dt) >= id);
            }
            let d = (ms / DAY_MS) as i64;
            let (y, m, dd) = civil_from_days(d);
            prop_assert_eq!(days_from_civil(y, m, dd), d);
        }
    }

    #[test]
    fn reservation_takes_the_dearest_prices_rounded_up() {
        let a = SourceConfig::new("a", 0, "http://a", "", "m").with_prices(0.27, 1.10);
        let b = SourceConfig::new("b", 0, "http://b", "", "m").with_prices(0.14, 2.19);
        let free = SourceConfig::new("c", 0, "http://c", "", "m").with_est_tokens(4000);
        let p = ScopePrices::highest([&a, &b, &free]);
        assert_eq!(p.input, Some(270_000_000));
        assert_eq!(p.output, Some(2_190_000_000));
        // 1000 × 0.27 / 1M + 500 × 2.19 / 1M = 0.00027 + 0.001095
        assert_eq!(p.reserve_nanos(1000, 500), Some(270_000 + 1_095_000));
        // one token: 0.27 / 1M = 270 nanos exactly; 2.19 / 1M = 2190
        assert_eq!(p.reserve_nanos(1, 1), Some(2_460));
        // rounding up: 1 token at 0.0000001 per 1M = 0.0001 nanos → 1
        let tiny = ScopePrices {
            input: Some(100),
            output: Some(0),
            per_call: None,
        };
        assert_eq!(tiny.reserve_nanos(1, 0), Some(1));
        assert_eq!(tiny.reserve_nanos(0, 0), Some(0));
        // The request's max_tokens, else the dearest sources' estimate.
        let srcs = [a.clone(), b.clone(), free.clone()];
        // The prompt's money with the 25 % margin: 1250 × 0.27 / 1M.
        let r = key_reservation(1000, Some(500), 25, &srcs, 0);
        assert_eq!(
            r,
            KeyReservation {
                tokens: 1500,
                nanos: Some(337_500 + 1_095_000)
            }
        );
        let r = key_reservation(1000, None, 25, &srcs, 0);
        assert_eq!(r.tokens, 5000);
        assert_eq!(r.nanos, Some(337_500 + 4000 * 2_190));
        // A cache write is an input-side price: the dearest one prices the prompt.
        let w = a.clone().with_cache_write_price(0.3375);
        assert_eq!(ScopePrices::highest([&w, &b]).input, Some(337_500_000));
        // scope TPM alone derives an estimate (one second of it)
        assert_eq!(output_estimate(None, std::slice::from_ref(&a), 6000), 100);
        assert_eq!(output_estimate(None, std::slice::from_ref(&a), 0), 0);
    }

    #[test]
    fn unpriced_scopes_refuse_budgeted_keys_only() {
        let free = SourceConfig::new("c", 0, "http://c", "", "m");
        let r = key_reservation(100, Some(10), 25, std::slice::from_ref(&free), 0);
        assert_eq!(r.nanos, None);
        assert_eq!(r.reserve_nanos(false), Ok(0));
        let e = r.reserve_nanos(true).unwrap_err();
        assert_eq!(
            (e.reason, e.retry_after),
            (RefusalReason::KeyBudgetUnpriced, None)
        );
        // an input price without output price: the output side cannot be priced
        let half = SourceConfig {
            input_price: Some(1.0),
            ..free.clone()
        };
        assert_eq!(
            key_reservation(100, Some(10), 25, std::slice::from_ref(&half), 0).nanos,
            None
        );
        assert_eq!(
            key_reservation(100, Some(0), 25, &[half], 0).nanos,
            Some(125_000)
        );
        // per-call prices (OCR) price a call without tokens
        let ocr = free.with_price_per_call(0.002);
        assert_eq!(
            key_reservation(0, Some(0), 25, &[ocr], 0).nanos,
            Some(2_000_000)
        );
        assert_eq!(price_nanos(-1.0), None);
        assert_eq!(price_nanos(f64::NAN), None);
    }

    #[test]
    fn settlement_is_the_rows_costs_or_at_least_the_reservation_when_one_is_unknown() {
        assert_eq!(settlement_nanos(5_000, []), 0);
        assert_eq!(settlement_nanos(5_000, [Some(0.000_001_2)]), 1_200);
        // each row rounded to the nearest nano
        assert_eq!(settlement_nanos(5_000, [Some(1.4e-9), Some(1.6e-9)]), 3);
        assert_eq!(settlement_nanos(5_000, [Some(0.000_001), None]), 5_000);
        assert_eq!(settlement_nanos(500, [Some(0.000_001), None]), 1_000);
        assert_eq!(settlement_nanos(500, [Some(0.0), Some(-3.0)]), 0);
        assert_eq!(cost_nanos(0.27), 270_000_000);
    }

    #[test]
    fn budget_refusal_names_the_period_that_clears_last_with_its_end() {
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            budget_day_nanos: Some(10 * NANO),
            budget_month_nanos: Some(100 * NANO),
            reserve_nanos: 4 * NANO,
            ..key("k")
        };
        let t = JAN31_2359 - DAY_MS; // Jan 30, 23:59
        let a = q.acquire(t, &r).unwrap();
        let b = q.acquire(t, &r).unwrap();
        // Held only by the calls in flight: a short hint (SPEC §24.2).
        let e = q.acquire(t, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyBudgetDay);
        assert_eq!(
            e.retry_after,
            Some(Duration::from_millis(IN_FLIGHT_RETRY_MS))
        );
        // settling below the reservation makes room at once
        q.finish(t + 1, a, 10, NANO);
        q.finish(t + 1, b, 10, 6 * NANO);
        assert_eq!(q.usage(t + 1, "k").day_nanos, 7 * NANO);
        // Spent for the day (7 settled + 4 > 10): the day's end.
        let e = q.acquire(t + 1, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyBudgetDay);
        assert_eq!(e.retry_after, Some(Duration::from_millis(60_000 - 1)));
        let small = KeyAcquire {
            reserve_nanos: 3 * NANO,
            ..r
        };
        q.acquire(t + 2, &small).unwrap();
        // a reservation above the budget itself never passes
        let big = KeyAcquire {
            reserve_nanos: 11 * NANO,
            ..r
        };
        let e = q.acquire(t + 3, &big).unwrap_err();
        assert_eq!(
            (e.reason, e.retry_after),
            (RefusalReason::KeyBudgetDay, None)
        );
        // the month budget, when it is the one exhausted, is the reason (its end)
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            budget_day_nanos: Some(10 * NANO),
            budget_month_nanos: Some(10 * NANO),
            reserve_nanos: 6 * NANO,
            ..key("k")
        };
        let a = q.acquire(t, &r).unwrap();
        q.finish(t, a, 0, 6 * NANO);
        let e = q.acquire(t, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyBudgetMonth);
        assert_eq!(e.retry_after, Some(Duration::from_millis(DAY_MS + 60_000)));
        // the next day the day budget is free, the month's is not
        let e = q.acquire(JAN31_2359 + 1, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyBudgetMonth);
        // the next month both are
        q.acquire(JAN31_2359 + 60_000, &r).unwrap();
    }

    #[test]
    fn spend_restored_from_rows_counts_this_day_and_month_and_bounds_the_unknown() {
        use crate::error::ErrorLabel;
        use crate::telemetry::{RowKind, TelemetryRow};
        let now = JAN31_2359 + 60_000 + 3_600_000; // Feb 1, 01:00
        let row = |key: Option<&str>, at: u64, cost: Option<f64>, err: Option<ErrorLabel>| {
            let mut r = TelemetryRow::new(RowKind::Attempt, "c", "l", "LLM", "chat", at as i64);
            r.client_key_id = key.map(str::to_string);
            r.cost = cost;
            r.ok = err.is_none();
            r.error = err.map(|e| e.as_str().to_string());
            r
        };
        let rows = [
            row(Some("k"), now - 1_000, Some(0.000_002), None), // today
            row(Some("k"), now - 2 * 3_600_000, Some(0.000_003), None), // Jan 31: last month
            row(Some("k"), now - 500, None, Some(ErrorLabel::Connect)), // unbilled: 0
            row(Some("k"), now - 400, None, Some(ErrorLabel::Timeout)), // bounded
            row(Some("k"), now - 300, None, Some(ErrorLabel::Cancelled)), // unbounded
            row(None, now - 200, Some(1.0), None),
        ];
        let got = restored_spend(rows.iter(), now, |r| {
            (r.error.as_deref() == Some("timeout")).then_some(0.000_004)
        });
        assert_eq!(got.len(), 1);
        assert_eq!(
            got["k"],
            RestoredSpend {
                day_nanos: 6_000,
                month_nanos: 6_000,
                unbounded_rows: 1
            }
        );
        // Restored into the model: admission sees it; restoring again changes nothing.
        let mut q = KeyQuotas::new();
        q.restore(now, "k", 6_000, 6_000);
        q.restore(now, "k", 6_000, 6_000);
        let u = q.usage(now, "k");
        assert_eq!((u.day_nanos, u.month_nanos), (6_000, 6_000));
        let r = KeyAcquire {
            budget_day_nanos: Some(10_000),
            reserve_nanos: 5_000,
            ..key("k")
        };
        assert_eq!(
            q.acquire(now, &r).unwrap_err().reason,
            RefusalReason::KeyBudgetDay
        );
    }

    #[test]
    fn spend_counts_in_the_period_of_its_settlement() {
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            budget_day_nanos: Some(10 * NANO),
            reserve_nanos: 8 * NANO,
            lease: Duration::from_secs(600),
            ..key("k")
        };
        let a = q.acquire(JAN31_2359, &r).unwrap();
        // After midnight the reservation made yesterday still counts (it will settle
        // today): a second call of 8 would put today over 10 once both settle.
        let feb1 = JAN31_2359 + 60_000;
        let e = q.acquire(feb1, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyBudgetDay);
        q.finish(feb1 + 1, a, 0, 7 * NANO);
        let u = q.usage(feb1 + 1, "k");
        assert_eq!(
            (u.day_nanos, u.month_nanos, u.reserved_nanos),
            (7 * NANO, 7 * NANO, 0)
        );
        // yesterday's month knows nothing of it; the next day starts empty
        assert_eq!(q.usage(feb1 + DAY_MS, "k").day_nanos, 0);
        assert_eq!(q.usage(feb1 + DAY_MS, "k").month_nanos, 7 * NANO);
    }

    #[test]
    fn a_crashed_holders_reservation_settles_at_its_lease_end() {
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            budget_day_nanos: Some(10 * NANO),
            max_concurrency: 1,
            est_tokens: 100,
            tpm: 150,
            reserve_nanos: 3 * NANO,
            lease: Duration::from_secs(30),
            ..key("k")
        };
        let t = JAN31_2359 - 120_000;
        let a = q.acquire(t, &r).unwrap();
        let e = q.acquire(t + 1, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyConcurrency);
        assert_eq!(e.retry_after, Some(Duration::from_millis(29_999)));
        // renewed by its heartbeat, it keeps its slot past its first lease
        q.renew(t + 20_000, a, r.lease);
        assert_eq!(q.usage(t + 40_000, "k").in_flight, 1);
        // then the holder dies: at its lease end (t + 50 s) the reservation is spent
        let u = q.usage(t + 50_000, "k");
        assert_eq!(
            (u.in_flight, u.reserved_nanos, u.day_nanos),
            (0, 0, 3 * NANO)
        );
        // the tokens stay one more window; a late renewal or finish changes no money
        q.renew(t + 50_001, a, r.lease);
        q.finish(t + 50_002, a, 10, 0);
        let u = q.usage(t + 50_003, "k");
        assert_eq!((u.in_flight, u.day_nanos, u.tokens), (0, 3 * NANO, 10));
        q.acquire(t + 50_004, &r).unwrap();
    }

    #[test]
    fn rpm_tpm_and_concurrency_are_the_windows_of_sources() {
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            rpm: 2,
            tpm: 1000,
            est_tokens: 400,
            ..key("k")
        };
        let a = q.acquire(0, &r).unwrap();
        q.acquire(10_000, &r).unwrap();
        let e = q.acquire(20_000, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyRpm);
        assert_eq!(e.retry_after, Some(Duration::from_millis(40_000)));
        q.finish(20_000, a, 900, 0); // 900 + 400 > 1000
        let e = q.acquire(60_000, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::KeyTpm);
        // the settled 900 leaves a window after its settlement
        assert_eq!(e.retry_after, Some(Duration::from_millis(20_000)));
        q.acquire(80_000, &r).unwrap();
        // other keys are independent
        q.acquire(
            80_000,
            &KeyAcquire {
                key_id: "other",
                ..r
            },
        )
        .unwrap();
        assert_eq!(q.usage(80_000, "other").requests, 1);
        assert_eq!(
            q.usage(80_000, "nobody"),
            KeyUsage {
                now_unix_ms: 80_000,
                ..KeyUsage::default()
            }
        );
    }

    #[test]
    fn compaction_forgets_keys_only_once_nothing_counts() {
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            reserve_nanos: 5,
            est_tokens: 10,
            ..key("k")
        };
        let a = q.acquire(JAN31_2359 - DAY_MS, &r).unwrap();
        q.finish(JAN31_2359 - DAY_MS, a, 10, 5);
        q.compact(JAN31_2359 - DAY_MS + WINDOW_MS);
        assert_eq!(q.len(), 1, "the day's and the month's spend still count");
        q.compact(JAN31_2359);
        assert_eq!(q.len(), 1, "the month's spend still counts");
        assert_eq!(q.usage(JAN31_2359, "k").month_nanos, 5);
        q.compact(JAN31_2359 + 60_000);
        assert!(q.is_empty() && q.permits.is_empty());
        q.finish(JAN31_2359 + 60_001, a, 1, 1); // a forgotten permit changes nothing
        assert!(q.is_empty());
        // Tokens settled late in a call outlive its request in the window: a key without
        // budget is kept while they count, so its TPM is not forgotten by a compaction.
        let mut q = KeyQuotas::new();
        let r = KeyAcquire {
            tpm: 100,
            est_tokens: 10,
            ..key("t")
        };
        let b = q.acquire(0, &r).unwrap();
        q.finish(30_000, b, 100, 0);
        q.compact(WINDOW_MS + 1);
        assert_eq!(q.len(), 1, "the tokens settled at 30 s count until 90 s");
        assert_eq!(
            q.acquire(WINDOW_MS + 1, &r).unwrap_err().reason,
            RefusalReason::KeyTpm
        );
        q.compact(30_000 + WINDOW_MS);
        assert!(q.is_empty());
    }

    // --- property test: the model against a plain reference ---

    #[derive(Debug, Clone)]
    enum Op {
        Acquire {
            key: usize,
            est: u64,
            nanos: u64,
        },
        /// Finish with tokens and a cost of `eighths`/8 of the reservation.
        Finish {
            pick: usize,
            tokens: u64,
            eighths: u64,
        },
        /// Drop: settles at the reservation.
        Drop {
            pick: usize,
        },
        Renew {
            pick: usize,
        },
        Advance {
            ms: u64,
        },
        Compact,
    }

    fn op(overspend: bool) -> impl Strategy<Value = Op> {
        let top = if overspend { 24u64 } else { 8 };
        prop_oneof![
            5 => (0usize..2, 0u64..400, 0u64..4_000).prop_map(|(key, est, nanos)| Op::Acquire { key, est, nanos }),
            3 => (0usize..16, 0u64..800, 0..=top).prop_map(|(pick, tokens, eighths)| Op::Finish { pick, tokens, eighths }),
            1 => (0usize..16).prop_map(|pick| Op::Drop { pick }),
            1 => (0usize..16).prop_map(|pick| Op::Renew { pick }),
            3 => prop_oneof![6 => 0u64..20_000, 1 => 0u64..2 * DAY_MS].prop_map(|ms| Op::Advance { ms }),
            1 => Just(Op::Compact),
        ]
    }

    /// One call as the reference sees it.
    #[derive(Debug, Clone, Copy)]
    struct Call {
        key: usize,
        at: u64,
        est: u64,
        nanos: u64,
        lease_end: u64,
        finished: bool,
        /// (settled at, tokens): the token settlement, if any.
        tokens: Option<(u64, u64)>,
        /// (settled at, nanos): the money settlement, if made by a finish.
        money: Option<(u64, u64)>,
    }

    impl Call {
        fn live(&self, now: u64) -> bool {
            !self.finished && self.lease_end > now
        }
        fn tokens_at(&self, now: u64) -> u64 {
            match self.tokens {
                Some((at, t)) if at + WINDOW_MS > now => t,
                Some(_) => 0,
                None if self.lease_end + WINDOW_MS > now => self.est,
                None => 0,
            }
        }
        /// The money settled by `now`, and when: a finish, or the lease end.
        fn settled(&self, now: u64) -> Option<(u64, u64)> {
            self.money
                .or((self.lease_end <= now).then_some((self.lease_end, self.nanos)))
        }
    }

    #[derive(Debug, Clone, Copy)]
    struct Limits {
        rpm: u32,
        tpm: u64,
        conc: u32,
        day: Option<u64>,
        month: Option<u64>,
        lease_ms: u64,
    }

    fn limits() -> impl Strategy<Value = Limits> {
        let opt = |lo: u64, hi: u64| prop_oneof![1 => Just(None), 3 => (lo..hi).prop_map(Some)];
        (
            prop_oneof![Just(0u32), 1u32..8],
            prop_oneof![Just(0u64), 300u64..2_000],
            prop_oneof![Just(0u32), 1u32..5],
            opt(2_000, 12_000),
            opt(4_000, 30_000),
            1_000u64..90_000,
        )
            .prop_map(|(rpm, tpm, conc, day, month, lease_ms)| Limits {
                rpm,
                tpm,
                conc,
                day,
                month,
                lease_ms,
            })
    }

    struct Reference {
        calls: Vec<Call>,
    }

    impl Reference {
        fn of(&self, key: usize) -> impl Iterator<Item = &Call> {
            self.calls.iter().filter(move |c| c.key == key)
        }
        fn in_flight(&self, key: usize, now: u64) -> usize {
            self.of(key).filter(|c| c.live(now)).count()
        }
        fn requests(&self, key: usize, now: u64) -> usize {
            self.of(key).filter(|c| c.at + WINDOW_MS > now).count()
        }
        fn tokens(&self, key: usize, now: u64) -> u64 {
            self.of(key).map(|c| c.tokens_at(now)).sum()
        }
        fn reserved(&self, key: usize, now: u64) -> u64 {
            self.of(key).filter(|c| c.live(now)).map(|c| c.nanos).sum()
        }
        fn settled_in(&self, key: usize, now: u64, p: BudgetPeriod) -> u64 {
            let id = period_id(p, now);
            self.of(key)
                .filter_map(|c| c.settled(now))
                .filter(|&(at, _)| period_id(p, at) == id)
                .map(|(_, n)| n)
                .sum()
        }
        /// The admission rule, stated plainly.
        fn admits(
            &self,
            key: usize,
            now: u64,
            l: &Limits,
            est: u64,
            nanos: u64,
        ) -> Result<(), RefusalReason> {
            if l.conc > 0 && self.in_flight(key, now) >= l.conc as usize {
                return Err(RefusalReason::KeyConcurrency);
            }
            if l.rpm > 0 && self.requests(key, now) >= l.rpm as usize {
                return Err(RefusalReason::KeyRpm);
            }
            if l.tpm > 0 && self.tokens(key, now) + est > l.tpm {
                return Err(RefusalReason::KeyTpm);
            }
            let reserved = self.reserved(key, now);
            for (p, b) in [(BudgetPeriod::Month, l.month), (BudgetPeriod::Day, l.day)] {
                if let Some(b) = b {
                    if self.settled_in(key, now, p) + reserved + nanos > b {
                        return Err(budget_reason(p));
                    }
                }
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The model against a plain reference, under random interleavings of acquire /
        /// finish / drop / renew / time advance (across days and months) / compaction.
        /// After every step: every admission and refusal reason agree; the key's in flight,
        /// window and spend equal the reference's (a finish replaces the reservation
        /// exactly; a drop settles at the reservation; a dead lease at its reservation at
        /// its end). Invariants: in flight ≤ the cap; admissions in any 60 s window ≤ RPM;
        /// and, when no call costs more than it reserved, the spend of the current day and
        /// month (settled + reserved) never exceeds its budget.
        #[test]
        fn model_matches_the_reference(
            l in limits(),
            overspend in proptest::bool::weighted(0.25),
            ops in proptest::collection::vec(op(false), 1..150),
            extra in proptest::collection::vec(op(true), 0..20),
            start in 0u64..2 * DAY_MS,
        ) {
            let ops: Vec<Op> = if overspend { ops.into_iter().chain(extra).collect() } else { ops };
            let mut q = KeyQuotas::new();
            let mut reference = Reference { calls: vec![] };
            let mut now = JAN31_2359 - DAY_MS + start;
            let names = ["k0", "k1"];
            let mut held: Vec<(u64, usize)> = vec![]; // (permit id, index in calls)
            let mut ids: HashMap<u64, usize> = HashMap::new();
            let mut over = false;
            for o in ops {
                match o {
                    Op::Acquire { key, est, nanos } => {
                        let req = KeyAcquire {
                            key_id: names[key],
                            rpm: l.rpm,
                            tpm: l.tpm,
                            max_concurrency: l.conc,
                            budget_day_nanos: l.day,
                            budget_month_nanos: l.month,
                            est_tokens: est,
                            reserve_nanos: nanos,
                            lease: Duration::from_millis(l.lease_ms),
                            top_up: false,
                        };
                        let want = reference.admits(key, now, &l, est, nanos);
                        match q.acquire(now, &req) {
                            Ok(id) => {
                                prop_assert_eq!(want, Ok(()), "model admitted");
                                reference.calls.push(Call { key, at: now, est, nanos, lease_end: now + l.lease_ms, finished: false, tokens: None, money: None });
                                ids.insert(id, reference.calls.len() - 1);
                                held.push((id, reference.calls.len() - 1));
                            }
                            Err(r) => prop_assert_eq!(want, Err(r.reason), "model refused"),
                        }
                    }
                    Op::Finish { pick, tokens, eighths } if !held.is_empty() => {
                        let (id, i) = held.remove(pick % held.len());
                        let c = &mut reference.calls[i];
                        let cost = c.nanos * eighths / 8;
                        over |= cost > c.nanos;
                        q.finish(now, id, tokens, cost);
                        finish_ref(c, now, tokens, cost);
                    }
                    Op::Drop { pick } if !held.is_empty() => {
                        // What a dropped KeyPermit does: finish at its reservation.
                        let (id, i) = held.remove(pick % held.len());
                        let c = &mut reference.calls[i];
                        q.finish(now, id, c.est, c.nanos);
                        let (est, nanos) = (c.est, c.nanos);
                        finish_ref(c, now, est, nanos);
                    }
                    Op::Renew { pick } if !held.is_empty() => {
                        let (id, i) = held[pick % held.len()];
                        q.renew(now, id, Duration::from_millis(l.lease_ms));
                        let c = &mut reference.calls[i];
                        if c.lease_end > now && !c.finished {
                            c.lease_end = c.lease_end.max(now + l.lease_ms);
                        }
                    }
                    Op::Advance { ms } => now += ms,
                    Op::Compact => q.compact(now),
                    _ => continue,
                }
                for (key, name) in names.iter().enumerate() {
                    let u = q.usage(now, name);
                    let reserved = reference.reserved(key, now);
                    let day = reference.settled_in(key, now, BudgetPeriod::Day) + reserved;
                    let month = reference.settled_in(key, now, BudgetPeriod::Month) + reserved;
                    prop_assert_eq!(u.in_flight as usize, reference.in_flight(key, now), "in flight of {}", name);
                    prop_assert_eq!(u.requests as usize, reference.requests(key, now), "requests of {}", name);
                    prop_assert_eq!(u.tokens, reference.tokens(key, now), "tokens of {}", name);
                    prop_assert_eq!(u.reserved_nanos, reserved, "reserved of {}", name);
                    prop_assert_eq!(u.day_nanos, day, "day spend of {}", name);
                    prop_assert_eq!(u.month_nanos, month, "month spend of {}", name);
                    if l.conc > 0 {
                        prop_assert!(u.in_flight <= l.conc, "in flight over the cap");
                    }
                    if !over {
                        if let Some(b) = l.day { prop_assert!(day <= b, "day spend {} over its budget {}", day, b); }
                        if let Some(b) = l.month { prop_assert!(month <= b, "month spend {} over its budget {}", month, b); }
                    }
                }
                // RPM: admissions in every 60 s window ending at an admission ≤ RPM.
                if l.rpm > 0 {
                    for key in 0..names.len() {
                        let times: Vec<u64> = reference.of(key).map(|c| c.at).collect();
                        for &t in &times {
                            let n = times.iter().filter(|&&s| s <= t && s + WINDOW_MS > t).count();
                            prop_assert!(n <= l.rpm as usize, "{} admissions in a window, RPM {}", n, l.rpm);
                        }
                    }
                }
            }
        }
    }

    /// A finish at `now`, as the reference sees it.
    fn finish_ref(c: &mut Call, now: u64, tokens: u64, cost: u64) {
        if c.finished {
            return;
        }
        if c.tokens.is_none() && c.lease_end + WINDOW_MS > now {
            c.tokens = Some((now, tokens));
        }
        if c.lease_end > now {
            c.money = Some((now, cost));
            c.lease_end = now;
        }
        c.finished = true;
    }
}
