//! The assembly guards of SPEC §2.2, defined once. The environment loader, settings
//! built in code and the client builders all call [`check`]; the loader also uses the
//! value rules ([`seconds`], [`int_in`], …) so a bad value is reported the same way
//! whichever path it came from.

use std::ops::RangeInclusive;
use std::time::Duration;

use crate::config::ConfigWarning;
use crate::error::ConfigError;
use crate::hedge::ThresholdSetting;
use crate::settings::{ScopeKind, ScopeSettings};

/// Range of `HEDGE__MAX_EXTRA`.
pub const MAX_EXTRA_RANGE: RangeInclusive<u32> = 1..=3;
/// Range of `HEDGE__BUDGET_PCT` (0 = no cap; 300 allows three extra legs per call).
pub const BUDGET_PCT_RANGE: RangeInclusive<u32> = 0..=300;
/// Range of `HEDGE__BURST` (legs).
pub const BURST_RANGE: RangeInclusive<u32> = 1..=100;
/// `RETRY__THROTTLE_MAX`: 0 turns the throttle off.
pub const THROTTLE_MAX_RANGE: RangeInclusive<u32> = 0..=1000;
/// Range of `HEDGE__MIN_SAMPLES`.
pub const MIN_SAMPLES_RANGE: RangeInclusive<u64> = 1..=1_000_000;
/// The shortest `HEDGE__WINDOW_S` (ten slots of at least a second).
pub const MIN_HEDGE_WINDOW: Duration = Duration::from_secs(10);
/// Range of `RETRY__MAX_ATTEMPTS`.
pub const MAX_ATTEMPTS_RANGE: RangeInclusive<u32> = 1..=100;
/// Range of `BREAKER__FAILURES`.
pub const BREAKER_FAILURES_RANGE: RangeInclusive<u32> = 1..=1000;
/// Range of `WEIGHT`.
pub const WEIGHT_RANGE: RangeInclusive<u32> = 1..=1_000_000;
/// Range of `BATCH_SIZE`.
pub const BATCH_SIZE_RANGE: RangeInclusive<u32> = 1..=100_000;
/// Range of `STRUCTURED__MAX_REASKS`.
pub const MAX_REASKS_RANGE: RangeInclusive<u32> = 0..=10;
/// Range of `CONTEXT_WINDOW` (tokens).
pub const CONTEXT_WINDOW_RANGE: RangeInclusive<u64> = 1..=100_000_000;
/// Range of `{…}__MAX_OUTPUT_TOKENS`.
pub const MAX_OUTPUT_TOKENS_RANGE: RangeInclusive<u64> = 1..=10_000_000;
/// Range of `STREAM__MAX_RESUMES`.
pub const MAX_RESUMES_RANGE: RangeInclusive<u32> = 0..=10;
/// Range of `CACHE__CAPACITY`.
pub const CACHE_CAPACITY_RANGE: RangeInclusive<u64> = 1..=100_000_000;
/// Range of `RESPONSES__MAX_BYTES_PER_KEY`: 64 KiB (a few turns) to 1 TiB.
pub const RESPONSES_MAX_BYTES_PER_KEY_RANGE: RangeInclusive<u64> = 65_536..=(1 << 40);
/// Range of `STREAM__STALL_THRESHOLD_MS`.
pub const STALL_THRESHOLD_MS_RANGE: RangeInclusive<u64> = 1..=3_600_000;
/// The longest time any setting may hold (a day; longer is a typo, and overflows timers).
pub const MAX_SECONDS: f64 = 86_400.0;

fn invalid(key: &str, value: impl ToString, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// A time in seconds: finite, > 0, at most [`MAX_SECONDS`].
pub fn seconds(key: &str, secs: f64) -> Result<Duration, ConfigError> {
    if !secs.is_finite() || secs <= 0.0 || secs > MAX_SECONDS {
        return Err(invalid(
            key,
            secs,
            format!("a finite number of seconds > 0 and ≤ {MAX_SECONDS}"),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The same rule for a [`Duration`] given in code.
pub fn duration(key: &str, d: Duration) -> Result<Duration, ConfigError> {
    seconds(key, d.as_secs_f64())
}

/// An integer inside a range.
pub fn int_in<T>(key: &str, v: T, range: &RangeInclusive<T>) -> Result<T, ConfigError>
where
    T: PartialOrd + Copy + std::fmt::Display,
{
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            key,
            v,
            format!("an integer in {}..={}", range.start(), range.end()),
        ))
    }
}

/// A price: finite and ≥ 0.
pub fn price(key: &str, p: f64) -> Result<f64, ConfigError> {
    if p.is_finite() && p >= 0.0 {
        Ok(p)
    } else {
        Err(invalid(
            key,
            p,
            "a finite price ≥ 0 (currency units per 1M tokens)",
        ))
    }
}

/// An upstream base URL: absolute http(s) with a host.
pub fn base_url(key: &str, raw: &str) -> Result<String, ConfigError> {
    let expected = "an absolute http:// or https:// URL, e.g. https://api.deepseek.com/v1";
    match url::Url::parse(raw) {
        Ok(u) if (u.scheme() == "http" || u.scheme() == "https") && u.host().is_some() => {
            if u.password().is_some() || !u.username().is_empty() {
                return Err(invalid(
                    key,
                    crate::secret::redact_url(raw),
                    "a URL without credentials (put the key in API_KEY)",
                ));
            }
            Ok(raw.trim_end_matches('/').to_string())
        }
        _ => Err(invalid(key, crate::secret::redact_url(raw), expected)),
    }
}

/// A telemetry URL: `sqlite://…` or `postgres://…`/`postgresql://…`.
pub fn telemetry_url(key: &str, raw: &str) -> Result<(), ConfigError> {
    let ok = ["sqlite:", "postgres://", "postgresql://"]
        .iter()
        .any(|p| raw.starts_with(p));
    if ok && raw.len() > "sqlite:".len() {
        Ok(())
    } else {
        Err(invalid(
            key,
            crate::secret::redact_url(raw),
            "sqlite://path.db or postgres://user@host/db",
        ))
    }
}

/// What a Redis URL must look like (in errors).
pub const REDIS_URL_FORMS: &str = "redis://[user:password@]host:port[/db], rediss://… (TLS), \
     or a Redis Cluster redis+cluster://[user:password@]host:port,host:port,… \
     (rediss+cluster:// for TLS)";

/// A Redis URL: `redis://…`, `rediss://…` (TLS), or a cluster
/// `redis+cluster://[user:password@]h1:p1,h2:p2,…` (`rediss+cluster://` for TLS).
pub fn redis_url(key: &str, raw: &str) -> Result<(), ConfigError> {
    if redis_nodes(raw).is_some() {
        Ok(())
    } else {
        Err(invalid(
            key,
            crate::secret::redact_url(raw),
            REDIS_URL_FORMS,
        ))
    }
}

/// The node URLs of a Redis URL (one for `redis://`/`rediss://`, each seed node of a
/// cluster URL with the cluster URL's credentials and query), and whether it names a
/// cluster; `None` if it is none of the accepted forms.
pub fn redis_nodes(raw: &str) -> Option<(Vec<String>, bool)> {
    let (scheme, rest) = raw.split_once("://")?;
    let (node_scheme, cluster) = match scheme {
        "redis" | "rediss" => (scheme, false),
        "redis+cluster" => ("redis", true),
        "rediss+cluster" => ("rediss", true),
        _ => return None,
    };
    if !cluster {
        let u = url::Url::parse(raw).ok()?;
        return u
            .host_str()
            .filter(|h| !h.is_empty())
            .map(|_| (vec![raw.to_string()], false));
    }
    // [userinfo@]hosts[/path][?query]
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (Some(u), r),
        None => (None, rest),
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (hosts, tail) = rest.split_at(end);
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() {
            return None;
        }
        let node = match userinfo {
            Some(u) => format!("{node_scheme}://{u}@{host}{tail}"),
            None => format!("{node_scheme}://{host}{tail}"),
        };
        let u = url::Url::parse(&node).ok()?;
        u.host_str().filter(|h| !h.is_empty())?;
        u.port()?;
        nodes.push(node);
    }
    (!nodes.is_empty()).then_some((nodes, true))
}

/// Smallest lease (`LIMITS__LEASE_S`): the heartbeat renews every third of it.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// A lease length: at least [`MIN_LEASE`].
pub fn lease(key: &str, d: Duration) -> Result<Duration, ConfigError> {
    if d >= MIN_LEASE {
        Ok(d)
    } else {
        Err(invalid(
            key,
            format!("{}", d.as_secs_f64()),
            "a lease of at least 1 second",
        ))
    }
}

/// The longest `HEDGE__BANK_S`.
pub const MAX_HEDGE_BANK: Duration = Duration::from_secs(3600);

/// `HEDGE__BANK_S`: 0 (the burst only) up to [`MAX_HEDGE_BANK`].
pub fn hedge_bank(key: &str, d: Duration) -> Result<Duration, ConfigError> {
    if d <= MAX_HEDGE_BANK {
        Ok(d)
    } else {
        Err(invalid(
            key,
            format!("{}", d.as_secs_f64()),
            "0 to 3600 seconds",
        ))
    }
}

/// `HEDGE__WINDOW_S`: at least [`MIN_HEDGE_WINDOW`].
pub fn hedge_window(key: &str, d: Duration) -> Result<Duration, ConfigError> {
    if d >= MIN_HEDGE_WINDOW {
        Ok(d)
    } else {
        Err(invalid(
            key,
            format!("{}", d.as_secs_f64()),
            "a window of at least 10 seconds",
        ))
    }
}

/// The environment key of a scope setting (used in guard messages, whatever the path).
pub fn scope_key(scope: &str, suffix: &str) -> String {
    format!("{scope}__{suffix}")
}

/// The environment key of a source field.
pub fn source_key(scope: &str, source_name: &str, field: &str) -> String {
    // name is `{provider}-{n}`; the key is `{SCOPE}__{PROVIDER}__{N}__{FIELD}`.
    match source_name.rsplit_once('-') {
        Some((p, n)) if n.chars().all(|c| c.is_ascii_digit()) => {
            format!("{scope}__{}__{n}__{field}", p.to_uppercase())
        }
        _ => format!("{scope}__{}__{field}", source_name.to_uppercase()),
    }
}

fn secs_str(d: Duration) -> String {
    format!("{}", d.as_secs_f64())
}

/// Checks every rule of SPEC §2.2 on assembled settings. Returns the warnings (also
/// logged with `tracing::warn!`), or every error found.
pub fn check(s: &ScopeSettings, kind: ScopeKind) -> Result<Vec<ConfigWarning>, ConfigError> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let scope = s.name.as_str();
    let mut push = |r: Result<(), ConfigError>| {
        if let Err(e) = r {
            errors.push(e);
        }
    };

    if scope.is_empty() || !scope.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        push(Err(invalid(
            "scope name",
            scope,
            "upper-case letters, digits and single underscores",
        )));
    }

    // Sources.
    if s.sources.is_empty() {
        push(Err(ConfigError::NoSources {
            scope: scope.to_string(),
        }));
    }
    let mut seen = std::collections::BTreeSet::new();
    for src in &s.sources {
        let k = |f: &str| source_key(scope, &src.name, f);
        if !seen.insert(src.name.as_str()) {
            push(Err(ConfigError::DuplicateSource {
                scope: scope.to_string(),
                source_name: src.name.clone(),
            }));
        }
        push(base_url(&k("BASE_URL"), &src.base_url).map(|_| ()));
        if src.model.trim().is_empty() {
            push(Err(invalid(
                &k("MODEL"),
                "",
                "a non-empty upstream model id",
            )));
        }
        push(duration(&k("TIMEOUT_S"), src.timeout).map(|_| ()));
        if let Some(t) = src.ttft_timeout {
            push(duration(&k("TTFT_TIMEOUT_S"), t).map(|_| ()));
        }
        if let Some(t) = src.inter_token_timeout {
            push(duration(&k("INTER_TOKEN_TIMEOUT_S"), t).map(|_| ()));
        }
        if kind != ScopeKind::Chat && src.api != crate::source::SourceApi::Chat {
            push(Err(invalid(
                &k("API"),
                src.api.as_str(),
                format!(
                    "chat: a {} scope calls OpenAI-compatible endpoints only",
                    kind.operation()
                ),
            )));
        }
        push(int_in(&k("WEIGHT"), src.weight, &WEIGHT_RANGE).map(|_| ()));
        push(int_in(&k("BATCH_SIZE"), src.batch_size, &BATCH_SIZE_RANGE).map(|_| ()));
        let est = src.effective_est_tokens(s.limits.tpm);
        for (limit_key, limit) in [
            (k("TPM"), src.tpm),
            (scope_key(scope, "LIMITS__TPM"), s.limits.tpm),
        ] {
            if limit > 0 && est > limit {
                push(Err(ConfigError::Guard {
                    key: k("EST_TOKENS"),
                    value: est.to_string(),
                    message: format!(
                        "must be ≤ {limit_key} ({limit}): a reservation above the limit is never admitted"
                    ),
                }));
            }
        }
        for (field, p) in [
            ("INPUT_PRICE", src.input_price),
            ("OUTPUT_PRICE", src.output_price),
            ("CACHED_INPUT_PRICE", src.cached_input_price),
            ("CACHE_WRITE_PRICE", src.cache_write_price),
            ("PRICE_PER_CALL", src.price_per_call),
        ] {
            if let Some(p) = p {
                push(price(&k(field), p).map(|_| ()));
            }
        }
    }

    // Scope numbers.
    if let Some(d) = s.call_deadline {
        push(duration(&scope_key(scope, "CALL_DEADLINE_S"), d).map(|_| ()));
    }
    let r = &s.retry;
    push(
        int_in(
            &scope_key(scope, "RETRY__MAX_ATTEMPTS"),
            r.max_attempts,
            &MAX_ATTEMPTS_RANGE,
        )
        .map(|_| ()),
    );
    push(duration(&scope_key(scope, "RETRY__STALL_WINDOW_S"), r.stall_window).map(|_| ()));
    push(duration(&scope_key(scope, "RETRY__BACKOFF_BASE_S"), r.backoff_base).map(|_| ()));
    push(duration(&scope_key(scope, "RETRY__BACKOFF_MAX_S"), r.backoff_max).map(|_| ()));
    if r.backoff_max < r.backoff_base {
        push(Err(ConfigError::Guard {
            key: scope_key(scope, "RETRY__BACKOFF_MAX_S"),
            value: secs_str(r.backoff_max),
            message: format!(
                "must be ≥ RETRY__BACKOFF_BASE_S ({})",
                secs_str(r.backoff_base)
            ),
        }));
    }
    let b = &s.breaker;
    push(
        int_in(
            &scope_key(scope, "BREAKER__FAILURES"),
            b.failures,
            &BREAKER_FAILURES_RANGE,
        )
        .map(|_| ()),
    );
    push(duration(&scope_key(scope, "BREAKER__OPEN_S"), b.open).map(|_| ()));
    push(duration(&scope_key(scope, "BREAKER__OPEN_MAX_S"), b.open_max).map(|_| ()));
    push(duration(&scope_key(scope, "BREAKER__DEAD_S"), b.dead).map(|_| ()));
    push(
        int_in(
            &scope_key(scope, "BREAKER__DEAD_AFTER"),
            b.dead_after,
            &BREAKER_FAILURES_RANGE,
        )
        .map(|_| ()),
    );
    let stall_ms = s.stream.stall_threshold.as_millis() as u64;
    push(
        int_in(
            &scope_key(scope, "STREAM__STALL_THRESHOLD_MS"),
            stall_ms,
            &STALL_THRESHOLD_MS_RANGE,
        )
        .map(|_| ()),
    );
    if let Some(ttl) = s.cache.ttl {
        push(duration(&scope_key(scope, "CACHE__TTL_S"), ttl).map(|_| ()));
    }
    push(duration(&scope_key(scope, "AFFINITY__TTL_S"), s.affinity.ttl).map(|_| ()));
    // Days, not seconds: a conversation resumes days later (up to a year).
    push(
        int_in(
            &scope_key(scope, "SIGNATURE__TTL_S"),
            s.signature_ttl.as_secs(),
            &(1..=365 * 24 * 3600),
        )
        .map(|_| ()),
    );
    push(
        int_in(
            &scope_key(scope, "CACHE__CAPACITY"),
            s.cache.capacity as u64,
            &CACHE_CAPACITY_RANGE,
        )
        .map(|_| ()),
    );
    push(
        int_in(
            &scope_key(scope, "STRUCTURED__MAX_REASKS"),
            s.max_reasks,
            &MAX_REASKS_RANGE,
        )
        .map(|_| ()),
    );
    if let Some(u) = &s.telemetry_url {
        push(telemetry_url(
            &scope_key(scope, "TELEMETRY__URL"),
            u.expose(),
        ));
    }
    if let Some(u) = &s.redis_url {
        push(redis_url(&scope_key(scope, "REDIS__URL"), u.expose()));
    }
    push(lease(&scope_key(scope, "LIMITS__LEASE_S"), s.limits.lease).map(|_| ()));
    if let Some(f) = &s.tls_ca_file {
        if f.is_empty() {
            push(Err(invalid(
                &scope_key(scope, "TLS__CA_FILE"),
                f.clone(),
                "the path of a PEM file of CA certificates",
            )));
        }
    }

    // Hedging.
    let h = &s.hedge;
    let k_after = scope_key(scope, "HEDGE__AFTER_S");
    let k_stall = scope_key(scope, "HEDGE__STALL_AFTER_S");
    push(
        int_in(
            &scope_key(scope, "HEDGE__MAX_EXTRA"),
            h.max_extra,
            &MAX_EXTRA_RANGE,
        )
        .map(|_| ()),
    );
    push(
        int_in(
            &scope_key(scope, "HEDGE__BUDGET_PCT"),
            h.budget_pct,
            &BUDGET_PCT_RANGE,
        )
        .map(|_| ()),
    );
    push(int_in(&scope_key(scope, "HEDGE__BURST"), h.burst, &BURST_RANGE).map(|_| ()));
    push(
        int_in(
            &scope_key(scope, "HEDGE__MIN_SAMPLES"),
            h.min_samples,
            &MIN_SAMPLES_RANGE,
        )
        .map(|_| ()),
    );
    push(hedge_window(&scope_key(scope, "HEDGE__WINDOW_S"), h.window).map(|_| ()));
    push(hedge_bank(&scope_key(scope, "HEDGE__BANK_S"), h.bank).map(|_| ()));
    for (b, min_key, max_key) in [
        (h.after_bounds, "HEDGE__MIN_S", "HEDGE__MAX_S"),
        (h.stall_bounds, "HEDGE__STALL_MIN_S", "HEDGE__STALL_MAX_S"),
    ] {
        push(duration(&scope_key(scope, min_key), b.min).map(|_| ()));
        push(duration(&scope_key(scope, max_key), b.max).map(|_| ()));
        if b.min > b.max {
            push(Err(ConfigError::Guard {
                key: scope_key(scope, min_key),
                value: secs_str(b.min),
                message: format!("must be ≤ {max_key} ({})", secs_str(b.max)),
            }));
        }
    }
    if let ThresholdSetting::Static(after) = h.after {
        push(duration(&k_after, after).map(|_| ()));
        if let Some(min_timeout) = s.sources.iter().map(|x| x.timeout).min() {
            if after >= min_timeout {
                push(Err(ConfigError::Guard {
                    key: k_after.clone(),
                    value: secs_str(after),
                    message: format!(
                        "must be < the smallest TIMEOUT_S of the sources ({}): the hedge could never fire",
                        secs_str(min_timeout)
                    ),
                }));
            }
        }
        if let Some(deadline) = s.call_deadline {
            if after >= deadline {
                push(Err(ConfigError::Guard {
                    key: k_after.clone(),
                    value: secs_str(after),
                    message: format!(
                        "must be < CALL_DEADLINE_S ({}): the deadline comes first",
                        secs_str(deadline)
                    ),
                }));
            }
        }
        if let Some(min_ttft) = s.sources.iter().filter_map(|x| x.ttft_timeout).min() {
            if after >= min_ttft {
                warnings.push(ConfigWarning {
                    key: k_after.clone(),
                    message: format!(
                        "{} ≥ the smallest TTFT_TIMEOUT_S ({}): streamed calls are cut by the TTFT watchdog before the hedge fires (plain calls still hedge)",
                        secs_str(after),
                        secs_str(min_ttft)
                    ),
                });
            }
        }
    }
    if let ThresholdSetting::Static(stall_after) = h.stall_after {
        push(duration(&k_stall, stall_after).map(|_| ()));
        if let Some(min_gap) = s.sources.iter().map(|x| x.inter_token_budget()).min() {
            if stall_after >= min_gap {
                push(Err(ConfigError::Guard {
                    key: k_stall.clone(),
                    value: secs_str(stall_after),
                    message: format!(
                        "must be < the smallest INTER_TOKEN_TIMEOUT_S (or TIMEOUT_S) of the sources ({}): the watchdog cuts the stream first",
                        secs_str(min_gap)
                    ),
                }));
            }
        }
        if let Some(deadline) = s.call_deadline {
            if stall_after >= deadline {
                push(Err(ConfigError::Guard {
                    key: k_stall.clone(),
                    value: secs_str(stall_after),
                    message: format!(
                        "must be < CALL_DEADLINE_S ({}): the deadline comes first",
                        secs_str(deadline)
                    ),
                }));
            }
        }
    }
    // `auto` is off by rule where it cannot fire (one source, not a chat scope): only a
    // static threshold there is a configuration worth a warning.
    let is_static = |t: ThresholdSetting| matches!(t, ThresholdSetting::Static(_));
    if is_static(h.after) || is_static(h.stall_after) {
        let key = if is_static(h.after) {
            &k_after
        } else {
            &k_stall
        };
        if s.sources.len() == 1 {
            warnings.push(ConfigWarning {
                key: key.clone(),
                message: "the scope has one source: a hedge leg needs another source, so hedging never fires".into(),
            });
        }
        if kind != ScopeKind::Chat {
            warnings.push(ConfigWarning {
                key: key.clone(),
                message: format!(
                    "hedging is chat-only: it never fires on this {} scope",
                    kind.operation()
                ),
            });
        }
    }

    ConfigError::from_list(errors)?;
    for w in &warnings {
        tracing::warn!(key = %w.key, "{}", w.message);
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::SourceConfig;

    fn scope(n: usize) -> ScopeSettings {
        let sources = (0..n)
            .map(|i| SourceConfig::new("p", i as u32, "http://127.0.0.1:1/v1", "", "m"))
            .collect();
        ScopeSettings::new("LLM", sources)
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn errors_of(s: &ScopeSettings, kind: ScopeKind) -> Vec<String> {
        match check(s, kind) {
            Ok(_) => vec![],
            Err(e) => e.all().iter().map(|e| e.to_string()).collect(),
        }
    }

    fn warnings_of(s: &ScopeSettings, kind: ScopeKind) -> Vec<String> {
        check(s, kind)
            .unwrap()
            .into_iter()
            .map(|w| format!("{}: {}", w.key, w.message))
            .collect()
    }

    #[test]
    fn defaults_pass_without_warnings() {
        assert!(warnings_of(&scope(2), ScopeKind::Chat).is_empty());
    }

    #[test]
    fn guard_table() {
        // Each row: (name, mutate, expect error substring or None, expect warning substring or None)
        type Mut = fn(&mut ScopeSettings);
        let rows: Vec<(&str, Mut, Option<&str>, Option<&str>)> = vec![
            (
                "no sources",
                |s| s.sources.clear(),
                Some("has no source"),
                None,
            ),
            (
                "zero timeout",
                |s| s.sources[0].timeout = Duration::ZERO,
                Some("LLM__P__0__TIMEOUT_S"),
                None,
            ),
            (
                "weight 0",
                |s| s.sources[0].weight = 0,
                Some("LLM__P__0__WEIGHT"),
                None,
            ),
            (
                "negative price",
                |s| s.sources[0].input_price = Some(-1.0),
                Some("INPUT_PRICE"),
                None,
            ),
            (
                "nan price",
                |s| s.sources[0].output_price = Some(f64::NAN),
                Some("OUTPUT_PRICE"),
                None,
            ),
            (
                "negative cached input price",
                |s| s.sources[0].cached_input_price = Some(-0.1),
                Some("LLM__P__0__CACHED_INPUT_PRICE"),
                None,
            ),
            (
                "nan cache write price",
                |s| s.sources[0].cache_write_price = Some(f64::NAN),
                Some("LLM__P__0__CACHE_WRITE_PRICE"),
                None,
            ),
            (
                "infinite cache write price",
                |s| s.sources[0].cache_write_price = Some(f64::INFINITY),
                Some("LLM__P__0__CACHE_WRITE_PRICE"),
                None,
            ),
            (
                "bad url",
                |s| s.sources[0].base_url = "ftp://x".into(),
                Some("BASE_URL"),
                None,
            ),
            (
                "empty model",
                |s| s.sources[0].model = " ".into(),
                Some("MODEL"),
                None,
            ),
            (
                "duplicate",
                |s| {
                    let c = s.sources[0].clone();
                    s.sources[1] = c;
                },
                Some("used twice"),
                None,
            ),
            (
                "attempts 0",
                |s| s.retry.max_attempts = 0,
                Some("RETRY__MAX_ATTEMPTS"),
                None,
            ),
            (
                "backoff max < base",
                |s| s.retry.backoff_max = Duration::from_millis(100),
                Some("RETRY__BACKOFF_MAX_S"),
                None,
            ),
            (
                "zero deadline",
                |s| s.call_deadline = Some(Duration::ZERO),
                Some("CALL_DEADLINE_S"),
                None,
            ),
            (
                "after ≥ min timeout",
                |s| {
                    s.sources[1].timeout = secs(5.0);
                    s.hedge.after = crate::hedge::ThresholdSetting::Static(secs(5.0));
                },
                Some("smallest TIMEOUT_S"),
                None,
            ),
            (
                "after ≥ deadline",
                |s| {
                    s.call_deadline = Some(secs(2.0));
                    s.hedge.after = crate::hedge::ThresholdSetting::Static(secs(2.0));
                },
                Some("CALL_DEADLINE_S (2)"),
                None,
            ),
            (
                "after ≥ min ttft",
                |s| {
                    s.sources[0].ttft_timeout = Some(secs(3.0));
                    s.hedge.after = crate::hedge::ThresholdSetting::Static(secs(3.0));
                },
                None,
                Some("TTFT watchdog"),
            ),
            (
                "stall ≥ min inter-token",
                |s| {
                    s.sources[0].inter_token_timeout = Some(secs(4.0));
                    s.hedge.stall_after = crate::hedge::ThresholdSetting::Static(secs(4.0));
                },
                Some("INTER_TOKEN_TIMEOUT_S"),
                None,
            ),
            (
                "stall ≥ timeout fallback",
                |s| {
                    s.sources[0].timeout = secs(4.0);
                    s.hedge.stall_after = crate::hedge::ThresholdSetting::Static(secs(10.0));
                },
                Some("INTER_TOKEN_TIMEOUT_S (or TIMEOUT_S)"),
                None,
            ),
            (
                "stall ≥ deadline",
                |s| {
                    s.call_deadline = Some(secs(2.0));
                    s.hedge.stall_after = crate::hedge::ThresholdSetting::Static(secs(3.0));
                },
                Some("HEDGE__STALL_AFTER_S"),
                None,
            ),
            (
                "max_extra 0",
                |s| s.hedge.max_extra = 0,
                Some("HEDGE__MAX_EXTRA"),
                None,
            ),
            (
                "max_extra 4",
                |s| s.hedge.max_extra = 4,
                Some("HEDGE__MAX_EXTRA"),
                None,
            ),
            (
                "single source hedge",
                |s| {
                    s.sources.truncate(1);
                    s.hedge.after = crate::hedge::ThresholdSetting::Static(secs(1.0));
                },
                None,
                Some("one source"),
            ),
            (
                "tpm without est is fine",
                |s| s.sources[0].tpm = 6000,
                None,
                None,
            ),
            (
                "est above tpm",
                |s| {
                    s.sources[0].tpm = 100;
                    s.sources[0].est_tokens = 200;
                },
                Some("LLM__P__0__EST_TOKENS"),
                None,
            ),
            (
                "est above scope tpm",
                |s| {
                    s.limits.tpm = 100;
                    s.sources[0].est_tokens = 200;
                },
                Some("LLM__LIMITS__TPM"),
                None,
            ),
            (
                "zero stall threshold",
                |s| s.stream.stall_threshold = Duration::ZERO,
                Some("STREAM__STALL_THRESHOLD_MS"),
                None,
            ),
            (
                "bad telemetry url",
                |s| s.telemetry_url = Some("mysql://u:pw@h/x".into()),
                Some("TELEMETRY__URL"),
                None,
            ),
            (
                "bad redis url",
                |s| s.redis_url = Some("http://h".into()),
                Some("REDIS__URL"),
                None,
            ),
            (
                "cluster url without ports",
                |s| s.redis_url = Some("redis+cluster://h1,h2".into()),
                Some("REDIS__URL"),
                None,
            ),
            (
                "cluster url",
                |s| s.redis_url = Some("redis+cluster://:pw@h1:7001,h2:7002".into()),
                None,
                None,
            ),
            (
                "tls url",
                |s| s.redis_url = Some("rediss://:pw@h1:6380/2".into()),
                None,
                None,
            ),
            (
                "lease under a second",
                |s| s.limits.lease = Duration::from_millis(500),
                Some("LIMITS__LEASE_S"),
                None,
            ),
            (
                "empty ca file",
                |s| s.tls_ca_file = Some(String::new()),
                Some("TLS__CA_FILE"),
                None,
            ),
        ];
        for (name, mutate, err, warn) in rows {
            let mut s = scope(2);
            mutate(&mut s);
            let errs = errors_of(&s, ScopeKind::Chat);
            match err {
                Some(want) => assert!(
                    errs.iter().any(|e| e.contains(want)),
                    "{name}: expected an error containing {want:?}, got {errs:?}"
                ),
                None => assert!(errs.is_empty(), "{name}: unexpected errors {errs:?}"),
            }
            if let Some(want) = warn {
                let ws = warnings_of(&s, ScopeKind::Chat);
                assert!(
                    ws.iter().any(|w| w.contains(want)),
                    "{name}: expected a warning containing {want:?}, got {ws:?}"
                );
            }
        }
    }

    #[test]
    fn hedge_on_embedding_or_ocr_scope_warns() {
        for kind in [ScopeKind::Embedding, ScopeKind::Ocr] {
            let mut s = scope(2);
            s.hedge.stall_after = crate::hedge::ThresholdSetting::Static(secs(1.0));
            let ws = warnings_of(&s, kind);
            assert!(ws.iter().any(|w| w.contains("chat-only")), "{ws:?}");
        }
    }

    #[test]
    fn redis_url_forms() {
        assert_eq!(
            redis_nodes("redis://:pw@h:6379/1"),
            Some((vec!["redis://:pw@h:6379/1".to_string()], false))
        );
        assert_eq!(
            redis_nodes("rediss+cluster://u:pw@h1:7001,h2:7002/?protocol=resp3"),
            Some((
                vec![
                    "rediss://u:pw@h1:7001/?protocol=resp3".to_string(),
                    "rediss://u:pw@h2:7002/?protocol=resp3".to_string()
                ],
                true
            ))
        );
        for bad in [
            "redis+cluster://",
            "redis+cluster://h1:1,,h2:2",
            "redis+cluster://h1",
            "http://h:1",
            "redis://",
            "valkey+cluster://h:1",
        ] {
            assert_eq!(redis_nodes(bad), None, "{bad}");
        }
        let e = redis_url("K", "redis+cluster://:hunter2@h1,h2").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(e.to_string().contains("redis+cluster://"), "{e}");
    }

    #[test]
    fn errors_never_show_url_passwords() {
        let mut s = scope(2);
        s.telemetry_url = Some("mysql://u:hunter2@h/x".into());
        let text = check(&s, ScopeKind::Chat).unwrap_err().to_string();
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn all_errors_are_reported_together() {
        let mut s = scope(2);
        s.retry.max_attempts = 0;
        s.hedge.max_extra = 9;
        assert_eq!(check(&s, ScopeKind::Chat).unwrap_err().all().len(), 2);
    }
}
