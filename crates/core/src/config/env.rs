//! Loading a scope from environment-style keys (`{SCOPE}__{PROVIDER}__{N}__{FIELD}` and
//! the scope keys of SPEC §2.1), from any key/value source: tests never touch the
//! process environment.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::{Map, Value};

use super::guards;
use super::LoadedScope;
use crate::error::ConfigError;
use crate::hedge::ThresholdSetting;
use crate::resume::{PrefillDialect, ResumeSetting};
use crate::secret::{Secret, REDACTED};
use crate::settings::{OnNoRunnable, RetryPrefer, ScopeKind, ScopeSettings};
use crate::source::{SourceApi, SourceAuth, SourceConfig};

/// Segment names that belong to scope keys and can never be a provider name.
pub const RESERVED_SEGMENTS: [&str; 15] = [
    "HEDGE",
    "STREAM",
    "RETRY",
    "LIMITS",
    "BREAKER",
    "CACHE",
    "TELEMETRY",
    "REDIS",
    "TLS",
    "STRUCTURED",
    "OCR",
    "MODEL_ALIASES",
    "KIND",
    "RESPONSES",
    "AFFINITY",
];

/// The FIELDs a source accepts.
pub const SOURCE_FIELDS: [&str; 27] = [
    "BASE_URL",
    "API_KEY",
    "MODEL",
    "RPM",
    "TPM",
    "EST_TOKENS",
    "MAX_CONCURRENCY",
    "TIMEOUT_S",
    "TTFT_TIMEOUT_S",
    "INTER_TOKEN_TIMEOUT_S",
    "PRIORITY",
    "WEIGHT",
    "INPUT_PRICE",
    "OUTPUT_PRICE",
    "CACHED_INPUT_PRICE",
    "CACHE_WRITE_PRICE",
    "CACHE_WRITE_1H_PRICE",
    "PRICE_PER_CALL",
    "BATCH_SIZE",
    "EXTRA_BODY",
    "PREFILL",
    "CONTEXT_WINDOW",
    "API",
    "AUTH",
    "MAX_TOKENS_FIELD",
    "MAX_OUTPUT_TOKENS",
    "SIGNATURE_GROUP",
];

/// Scope keys: (group or "" for two-segment keys, field).
pub const SCOPE_KEYS: [(&str, &str); 49] = [
    ("", "CALL_DEADLINE_S"),
    ("", "MODEL_ALIASES"),
    ("", "KIND"),
    ("RETRY", "MAX_ATTEMPTS"),
    ("RETRY", "STALL_WINDOW_S"),
    ("RETRY", "BACKOFF_BASE_S"),
    ("RETRY", "BACKOFF_MAX_S"),
    ("RETRY", "ON_NO_RUNNABLE"),
    ("RETRY", "PREFER"),
    ("RETRY", "THROTTLE_MAX"),
    ("RETRY", "THROTTLE_RATIO"),
    ("LIMITS", "RPM"),
    ("LIMITS", "TPM"),
    ("LIMITS", "LEASE_S"),
    ("BREAKER", "FAILURES"),
    ("BREAKER", "OPEN_S"),
    ("BREAKER", "OPEN_MAX_S"),
    ("BREAKER", "DEAD_S"),
    ("BREAKER", "DEAD_AFTER"),
    ("HEDGE", "AFTER_S"),
    ("HEDGE", "STALL_AFTER_S"),
    ("HEDGE", "MAX_EXTRA"),
    ("HEDGE", "BUDGET_PCT"),
    ("HEDGE", "BURST"),
    ("HEDGE", "BANK_S"),
    ("HEDGE", "WINDOW_S"),
    ("HEDGE", "MIN_SAMPLES"),
    ("HEDGE", "MIN_S"),
    ("HEDGE", "MAX_S"),
    ("HEDGE", "STALL_MIN_S"),
    ("HEDGE", "STALL_MAX_S"),
    ("HEDGE", "AFTER_PRIOR_S"),
    ("HEDGE", "STALL_PRIOR_S"),
    ("STREAM", "STALL_THRESHOLD_MS"),
    ("STREAM", "RESUME"),
    ("STREAM", "MAX_RESUMES"),
    ("CACHE", "TTL_S"),
    ("CACHE", "CAPACITY"),
    ("TELEMETRY", "URL"),
    ("REDIS", "URL"),
    ("TLS", "CA_FILE"),
    ("STRUCTURED", "MAX_REASKS"),
    ("RESPONSES", "TTL_S"),
    ("RESPONSES", "MAX_BYTES_PER_KEY"),
    ("", "AFFINITY"),
    ("AFFINITY", "TTL_S"),
    ("SIGNATURE", "TTL_S"),
    ("KEYS", "ESTIMATE_MARGIN"),
    ("KEYS", "MIN_OUTPUT_TOKENS"),
];

/// `OCR__PROMPT` is the one scope key outside the table above (it is free text).
const OCR_PROMPT: (&str, &str) = ("OCR", "PROMPT");

const REQUIRED_SOURCE_FIELDS: [&str; 3] = ["BASE_URL", "API_KEY", "MODEL"];

/// Scope names found in the variables: every first segment of a source key
/// (`{S}__{P}__{N}__{FIELD}` with a numeric `N`), upper-case, sorted.
pub fn discover_scopes<I, K, V>(vars: I) -> Vec<String>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut out = BTreeSet::new();
    for (k, _) in vars {
        let k = k.as_ref();
        let segs: Vec<&str> = k.split("__").collect();
        if segs.len() == 4
            && is_upper_segment(segs[0])
            && is_upper_segment(segs[1])
            && !segs[2].is_empty()
            && segs[2].chars().all(|c| c.is_ascii_digit())
            && SOURCE_FIELDS.contains(&segs[3])
        {
            out.insert(segs[0].to_string());
        }
    }
    out.into_iter().collect()
}

fn is_upper_segment(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && !s.starts_with('_')
        && !s.ends_with('_')
}

/// Loads and guards one scope from key/value pairs (e.g. `std::env::vars()`).
///
/// Every problem is reported at once, each naming its key, its value (secrets and
/// URL passwords redacted) and what was expected.
pub fn load_scope<I, K, V>(
    vars: I,
    scope: &str,
    kind: ScopeKind,
) -> Result<LoadedScope, ConfigError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let scope = scope.to_uppercase();
    let prefix = format!("{scope}__");
    let mut errors: Vec<ConfigError> = Vec::new();
    let mut scope_vals: BTreeMap<(String, String), (String, String)> = BTreeMap::new();
    let mut sources: BTreeMap<(String, u32), BTreeMap<String, (String, String)>> = BTreeMap::new();

    for (k, v) in vars {
        let key = k.as_ref();
        let Some(rest) = key.strip_prefix(&prefix) else {
            continue;
        };
        let value = v.as_ref().to_string();
        let segs: Vec<&str> = rest.split("__").collect();
        if let Some(bad) = segs.iter().find(|s| !is_upper_segment(s)) {
            errors.push(ConfigError::UnknownKey {
                key: key.to_string(),
                hint: format!(
                    "segment {bad:?} is not upper-case letters/digits; keys look like {scope}__<PROVIDER>__<N>__<FIELD> or {scope}__<GROUP>__<KEY>"
                ),
            });
            continue;
        }
        match segs.as_slice() {
            [field] => {
                if SCOPE_KEYS.contains(&("", *field)) {
                    scope_vals.insert((String::new(), field.to_string()), (key.to_string(), value));
                } else {
                    errors.push(unknown_scope_key(key, &scope));
                }
            }
            [group, field] => {
                if SCOPE_KEYS.contains(&(*group, *field)) || (*group, *field) == OCR_PROMPT {
                    scope_vals.insert(
                        (group.to_string(), field.to_string()),
                        (key.to_string(), value),
                    );
                } else if RESERVED_SEGMENTS.contains(group) {
                    errors.push(unknown_scope_key(key, &scope));
                } else {
                    errors.push(ConfigError::UnknownKey {
                        key: key.to_string(),
                        hint: format!(
                            "a source key needs an index: {scope}__{group}__0__{field}"
                        ),
                    });
                }
            }
            [provider, n, field] => {
                if RESERVED_SEGMENTS.contains(provider) {
                    errors.push(ConfigError::ReservedProvider {
                        key: key.to_string(),
                        provider: provider.to_string(),
                        reserved: RESERVED_SEGMENTS.join(", "),
                    });
                    continue;
                }
                let Ok(index) = n.parse::<u32>() else {
                    errors.push(ConfigError::UnknownKey {
                        key: key.to_string(),
                        hint: format!(
                            "the third segment must be the source index (0, 1, …), got {n:?}"
                        ),
                    });
                    continue;
                };
                if !SOURCE_FIELDS.contains(field) {
                    errors.push(ConfigError::UnknownKey {
                        key: key.to_string(),
                        hint: format!(
                            "unknown source field {field:?}; fields are {}",
                            source_field_list()
                        ),
                    });
                    continue;
                }
                sources
                    .entry((provider.to_string(), index))
                    .or_default()
                    .insert(field.to_string(), (key.to_string(), value));
            }
            _ => errors.push(ConfigError::UnknownKey {
                key: key.to_string(),
                hint: format!(
                    "too many segments; keys look like {scope}__<PROVIDER>__<N>__<FIELD> or {scope}__<GROUP>__<KEY>"
                ),
            }),
        }
    }

    let mut built = Vec::new();
    for ((provider, index), fields) in &sources {
        if let Some(src) = build_source(&scope, provider, *index, fields, &mut errors) {
            built.push(src);
        }
    }
    let mut settings = ScopeSettings::new(scope.clone(), built);
    apply_scope_keys(&mut settings, &scope_vals, &mut errors);
    if let Some((k, v)) = scope_vals.get(&(String::new(), "KIND".to_string())) {
        match parse_kind(k, v) {
            Ok(declared) if declared != kind => errors.push(ConfigError::Guard {
                key: k.clone(),
                value: v.trim().to_string(),
                message: format!(
                    "the scope is declared {declared} but is being loaded as a {kind} scope \
                     (a {kind} client); use the {declared} client, or set {k}={kind}"
                ),
            }),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }

    if sources.is_empty() && errors.is_empty() {
        errors.push(ConfigError::NoSources {
            scope: scope.clone(),
        });
    }
    ConfigError::from_list(errors)?;
    let warnings = guards::check(&settings, kind)?;
    Ok(LoadedScope { settings, warnings })
}

/// The kind a scope declares with `{S}__KIND` (`chat`, `embedding` or `ocr`); `chat`
/// when the key is absent. No kind is ever inferred from the scope's name.
pub fn scope_kind<I, K, V>(vars: I, scope: &str) -> Result<ScopeKind, ConfigError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let key = format!("{}__KIND", scope.to_uppercase());
    let mut kind = ScopeKind::Chat;
    for (k, v) in vars {
        if k.as_ref() == key {
            kind = parse_kind(&key, v.as_ref())?;
        }
    }
    Ok(kind)
}

fn parse_kind(key: &str, v: &str) -> Result<ScopeKind, ConfigError> {
    v.parse::<ScopeKind>()
        .map_err(|()| invalid(key, v.trim(), "chat, embedding or ocr"))
}

fn unknown_scope_key(key: &str, scope: &str) -> ConfigError {
    let list: Vec<String> = SCOPE_KEYS
        .iter()
        .chain(std::iter::once(&OCR_PROMPT))
        .map(|(g, f)| {
            if g.is_empty() {
                format!("{scope}__{f}")
            } else {
                format!("{scope}__{g}__{f}")
            }
        })
        .collect();
    ConfigError::UnknownKey {
        key: key.to_string(),
        hint: format!("scope keys are {}", list.join(", ")),
    }
}

fn source_field_list() -> String {
    SOURCE_FIELDS.join(", ")
}

type Fields = BTreeMap<String, (String, String)>;

fn build_source(
    scope: &str,
    provider: &str,
    index: u32,
    fields: &Fields,
    errors: &mut Vec<ConfigError>,
) -> Option<SourceConfig> {
    let mut missing = false;
    for f in REQUIRED_SOURCE_FIELDS {
        if !fields.contains_key(f) {
            errors.push(ConfigError::Missing {
                key: format!("{scope}__{provider}__{index}__{f}"),
                expected: match f {
                    "BASE_URL" => "the source's base URL, e.g. https://api.deepseek.com/v1",
                    "API_KEY" => "the API key (may be empty for local servers)",
                    _ => "the upstream model id",
                }
                .to_string(),
            });
            missing = true;
        }
    }
    if missing {
        return None;
    }
    let get = |f: &str| fields.get(f).map(|(k, v)| (k.as_str(), v.trim()));
    let (url_key, url_val) = get("BASE_URL")?;
    // A bad URL is reported with every other bad field of the source.
    let (base_url, url_ok) = match guards::base_url(url_key, url_val) {
        Ok(u) => (u, true),
        Err(e) => {
            errors.push(e);
            ("http://invalid".to_string(), false)
        }
    };
    let api_key = Secret::new(fields["API_KEY"].1.trim());
    let model = get("MODEL")?.1.to_string();
    let mut src = SourceConfig::new(provider, index, base_url, api_key, model);

    let mut run = |r: Result<(), ConfigError>| {
        if let Err(e) = r {
            errors.push(e);
        }
    };
    if let Some((k, v)) = get("RPM") {
        run(parse_int::<u32>(k, v).map(|x| src.rpm = x));
    }
    if let Some((k, v)) = get("TPM") {
        run(parse_int::<u64>(k, v).map(|x| src.tpm = x));
    }
    if let Some((k, v)) = get("EST_TOKENS") {
        run(parse_int::<u64>(k, v).map(|x| src.est_tokens = x));
    }
    if let Some((k, v)) = get("MAX_CONCURRENCY") {
        run(parse_int::<u32>(k, v).map(|x| src.max_concurrency = x));
    }
    if let Some((k, v)) = get("PRIORITY") {
        run(parse_int::<u32>(k, v).map(|x| src.priority = x));
    }
    if let Some((k, v)) = get("WEIGHT") {
        run(parse_int::<u32>(k, v)
            .and_then(|x| guards::int_in(k, x, &guards::WEIGHT_RANGE))
            .map(|x| src.weight = x));
    }
    if let Some((k, v)) = get("BATCH_SIZE") {
        run(parse_int::<u32>(k, v)
            .and_then(|x| guards::int_in(k, x, &guards::BATCH_SIZE_RANGE))
            .map(|x| src.batch_size = x));
    }
    if let Some((k, v)) = get("TIMEOUT_S") {
        run(parse_secs(k, v).map(|x| src.timeout = x));
    }
    if let Some((k, v)) = get("TTFT_TIMEOUT_S") {
        run(parse_secs(k, v).map(|x| src.ttft_timeout = Some(x)));
    }
    if let Some((k, v)) = get("INTER_TOKEN_TIMEOUT_S") {
        run(parse_secs(k, v).map(|x| src.inter_token_timeout = Some(x)));
    }
    if let Some((k, v)) = get("INPUT_PRICE") {
        run(parse_price(k, v).map(|x| src.input_price = Some(x)));
    }
    if let Some((k, v)) = get("OUTPUT_PRICE") {
        run(parse_price(k, v).map(|x| src.output_price = Some(x)));
    }
    if let Some((k, v)) = get("CACHED_INPUT_PRICE") {
        run(parse_price(k, v).map(|x| src.cached_input_price = Some(x)));
    }
    if let Some((k, v)) = get("CACHE_WRITE_PRICE") {
        run(parse_price(k, v).map(|x| src.cache_write_price = Some(x)));
    }
    if let Some((k, v)) = get("CACHE_WRITE_1H_PRICE") {
        run(parse_price(k, v).map(|x| src.cache_write_1h_price = Some(x)));
    }
    if let Some((k, v)) = get("PRICE_PER_CALL") {
        run(parse_price(k, v).map(|x| src.price_per_call = Some(x)));
    }
    if let Some((k, v)) = get("EXTRA_BODY") {
        run(parse_object(k, v).map(|x| src.extra_body = x));
    }
    if let Some((k, v)) = get("CONTEXT_WINDOW") {
        run(parse_int::<u64>(k, v)
            .and_then(|x| guards::int_in(k, x, &guards::CONTEXT_WINDOW_RANGE))
            .map(|x| src.context_window = Some(x)));
    }
    if let Some((k, v)) = get("PREFILL") {
        run(parse_prefill(k, v).map(|x| src.prefill = x));
    }
    if let Some((k, v)) = get("API") {
        run(parse_api(k, v).map(|x| src.api = x));
    }
    if let Some((k, v)) = get("AUTH") {
        run(parse_auth(k, v).map(|x| src.auth = x));
    }
    if let Some((k, v)) = get("MAX_OUTPUT_TOKENS") {
        run(parse_int::<u64>(k, v)
            .and_then(|x| guards::int_in(k, x, &guards::MAX_OUTPUT_TOKENS_RANGE))
            .map(|x| src.max_output_tokens = Some(x)));
    }
    if let Some((k, v)) = get("SIGNATURE_GROUP") {
        let g = v.trim();
        run(
            if g.is_empty()
                || g.len() > 64
                || g.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                Err(invalid(k, v, "a group name: 1 to 64 characters, no spaces"))
            } else {
                src.signature_group = Some(g.to_ascii_lowercase());
                Ok(())
            },
        );
    }
    if let Some((k, v)) = get("MAX_TOKENS_FIELD") {
        run(match v.trim().to_ascii_lowercase().as_str() {
            "" | "max_tokens" => Ok(()),
            "max_completion_tokens" => {
                src.max_completion_tokens = true;
                Ok(())
            }
            _ => Err(invalid(k, v, "max_tokens or max_completion_tokens")),
        });
    }
    url_ok.then_some(src)
}

/// `API`: `chat` (also empty), `messages` or `responses` (SPEC §23.1).
fn parse_api(k: &str, v: &str) -> Result<SourceApi, ConfigError> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(SourceApi::Chat);
    }
    t.parse::<SourceApi>()
        .map_err(|()| invalid(k, v, "chat, messages or responses"))
}

/// `AUTH`: `x-api-key`, `bearer` or `client` (empty = the API's own way).
fn parse_auth(k: &str, v: &str) -> Result<Option<SourceAuth>, ConfigError> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    t.parse::<SourceAuth>()
        .map(Some)
        .map_err(|()| invalid(k, v, "x-api-key, bearer or client"))
}

/// `PREFILL`: `none` (or empty) = no prefill, else a dialect.
fn parse_prefill(k: &str, v: &str) -> Result<Option<PrefillDialect>, ConfigError> {
    let t = v.trim();
    if t.is_empty() || t.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    t.parse::<PrefillDialect>()
        .map(Some)
        .map_err(|()| invalid(k, v, "none, assistant, prefix, partial or vllm"))
}

fn apply_scope_keys(
    s: &mut ScopeSettings,
    vals: &BTreeMap<(String, String), (String, String)>,
    errors: &mut Vec<ConfigError>,
) {
    let mut run = |r: Result<(), ConfigError>| {
        if let Err(e) = r {
            errors.push(e);
        }
    };
    for ((group, field), (key, raw)) in vals {
        let k = key.as_str();
        let v = raw.trim();
        match (group.as_str(), field.as_str()) {
            ("", "CALL_DEADLINE_S") => run(parse_secs(k, v).map(|x| s.call_deadline = Some(x))),
            ("", "MODEL_ALIASES") => run(parse_aliases(k, v).map(|x| s.model_aliases = x)),
            // Checked against the kind the scope is loaded as, in `load_scope`.
            ("", "KIND") => {}
            ("RETRY", "MAX_ATTEMPTS") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MAX_ATTEMPTS_RANGE))
                .map(|x| s.retry.max_attempts = x)),
            ("RETRY", "STALL_WINDOW_S") => run(parse_secs(k, v).map(|x| s.retry.stall_window = x)),
            ("RETRY", "BACKOFF_BASE_S") => run(parse_secs(k, v).map(|x| s.retry.backoff_base = x)),
            ("RETRY", "BACKOFF_MAX_S") => run(parse_secs(k, v).map(|x| s.retry.backoff_max = x)),
            ("RETRY", "THROTTLE_MAX") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::THROTTLE_MAX_RANGE))
                .map(|x| s.retry.throttle.max_tokens = x)),
            ("RETRY", "THROTTLE_RATIO") => run(v
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0 && *x <= 10.0)
                .ok_or_else(|| {
                    invalid(
                        k,
                        v,
                        "a number of tokens a success gives back, above 0 and at most 10, e.g. 0.2",
                    )
                })
                .map(|x| s.retry.throttle.ratio = x)),
            ("RETRY", "PREFER") => run(parse_prefer(k, v).map(|x| s.retry.prefer = x)),
            ("KEYS", "ESTIMATE_MARGIN") => run(v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && (0.0..=10.0).contains(x))
                .ok_or_else(|| {
                    invalid(
                        k,
                        v,
                        "a fraction of the prompt estimate added to reservations, 0 to 10, e.g. 0.25",
                    )
                })
                .map(|x| s.keys.estimate_margin_pct = (x * 100.0).round() as u64)),
            ("KEYS", "MIN_OUTPUT_TOKENS") => run(parse_int::<u64>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MAX_OUTPUT_TOKENS_RANGE))
                .map(|x| s.keys.min_output_tokens = x)),
            ("RETRY", "ON_NO_RUNNABLE") => {
                run(parse_on_no_runnable(k, v).map(|x| s.retry.on_no_runnable = x))
            }
            ("LIMITS", "RPM") => run(parse_int::<u32>(k, v).map(|x| s.limits.rpm = x)),
            ("LIMITS", "TPM") => run(parse_int::<u64>(k, v).map(|x| s.limits.tpm = x)),
            ("LIMITS", "LEASE_S") => run(parse_secs(k, v)
                .and_then(|x| guards::lease(k, x))
                .map(|x| s.limits.lease = x)),
            ("BREAKER", "FAILURES") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::BREAKER_FAILURES_RANGE))
                .map(|x| s.breaker.failures = x)),
            ("BREAKER", "OPEN_S") => run(parse_secs(k, v).map(|x| s.breaker.open = x)),
            ("BREAKER", "OPEN_MAX_S") => run(parse_secs(k, v).map(|x| s.breaker.open_max = x)),
            ("BREAKER", "DEAD_S") => run(parse_secs(k, v).map(|x| s.breaker.dead = x)),
            ("BREAKER", "DEAD_AFTER") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::BREAKER_FAILURES_RANGE))
                .map(|x| s.breaker.dead_after = x)),
            ("HEDGE", "AFTER_S") => run(parse_threshold(k, v).map(|x| s.hedge.after = x)),
            ("HEDGE", "STALL_AFTER_S") => {
                run(parse_threshold(k, v).map(|x| s.hedge.stall_after = x))
            }
            ("HEDGE", "AFTER_PRIOR_S") => run(parse_prior(k, v).map(|x| s.hedge.priors.after = x)),
            ("HEDGE", "STALL_PRIOR_S") => run(parse_prior(k, v).map(|x| s.hedge.priors.stall = x)),
            ("HEDGE", "BURST") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::BURST_RANGE))
                .map(|x| s.hedge.burst = x)),
            ("HEDGE", "BANK_S") => run(parse_secs(k, v)
                .and_then(|x| guards::hedge_bank(k, x))
                .map(|x| s.hedge.bank = x)),
            ("HEDGE", "WINDOW_S") => run(parse_secs(k, v)
                .and_then(|x| guards::hedge_window(k, x))
                .map(|x| s.hedge.window = x)),
            ("HEDGE", "MIN_SAMPLES") => run(parse_int::<u64>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MIN_SAMPLES_RANGE))
                .map(|x| s.hedge.min_samples = x)),
            ("HEDGE", "MIN_S") => run(parse_secs(k, v).map(|x| s.hedge.after_bounds.min = x)),
            ("HEDGE", "MAX_S") => run(parse_secs(k, v).map(|x| s.hedge.after_bounds.max = x)),
            ("HEDGE", "STALL_MIN_S") => run(parse_secs(k, v).map(|x| s.hedge.stall_bounds.min = x)),
            ("HEDGE", "STALL_MAX_S") => run(parse_secs(k, v).map(|x| s.hedge.stall_bounds.max = x)),
            ("HEDGE", "MAX_EXTRA") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MAX_EXTRA_RANGE))
                .map(|x| s.hedge.max_extra = x)),
            ("HEDGE", "BUDGET_PCT") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::BUDGET_PCT_RANGE))
                .map(|x| s.hedge.budget_pct = x)),
            ("STREAM", "STALL_THRESHOLD_MS") => run(parse_int::<u64>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::STALL_THRESHOLD_MS_RANGE))
                .map(|x| s.stream.stall_threshold = Duration::from_millis(x))),
            ("STREAM", "RESUME") => run(v
                .parse::<ResumeSetting>()
                .map(|x| s.stream.resume = x)
                .map_err(|()| invalid(k, v, "auto, prefill or off"))),
            ("STREAM", "MAX_RESUMES") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MAX_RESUMES_RANGE))
                .map(|x| s.stream.max_resumes = x)),
            ("CACHE", "TTL_S") => run(parse_secs(k, v).map(|x| s.cache.ttl = Some(x))),
            ("CACHE", "CAPACITY") => run(parse_int::<u64>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::CACHE_CAPACITY_RANGE))
                .map(|x| s.cache.capacity = x as usize)),
            ("TELEMETRY", "URL") => {
                run(guards::telemetry_url(k, v).map(|_| s.telemetry_url = Some(Secret::new(v))))
            }
            ("REDIS", "URL") => {
                run(guards::redis_url(k, v).map(|_| s.redis_url = Some(Secret::new(v))))
            }
            ("TLS", "CA_FILE") => run(if v.is_empty() {
                Err(invalid(k, v, "the path of a PEM file of CA certificates"))
            } else {
                s.tls_ca_file = Some(v.to_string());
                Ok(())
            }),
            ("RESPONSES", "TTL_S") => run(parse_secs(k, v).map(|x| s.responses_ttl = x)),
            ("RESPONSES", "MAX_BYTES_PER_KEY") => run(parse_int::<u64>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::RESPONSES_MAX_BYTES_PER_KEY_RANGE))
                .map(|x| s.responses_max_bytes_per_key = x)),
            ("", "AFFINITY") => run(v
                .parse::<crate::affinity::AffinityMode>()
                .map(|x| s.affinity.mode = x)
                .map_err(|()| invalid(k, v, "off or session"))),
            ("AFFINITY", "TTL_S") => run(parse_secs(k, v).map(|x| s.affinity.ttl = x)),
            ("SIGNATURE", "TTL_S") => run(parse_secs(k, v).map(|x| s.signature_ttl = x)),
            ("STRUCTURED", "MAX_REASKS") => run(parse_int::<u32>(k, v)
                .and_then(|x| guards::int_in(k, x, &guards::MAX_REASKS_RANGE))
                .map(|x| s.max_reasks = x)),
            ("OCR", "PROMPT") => run(if v.is_empty() {
                Err(invalid(k, v, "a non-empty instruction"))
            } else {
                s.ocr_prompt = raw.to_string();
                Ok(())
            }),
            _ => {}
        }
    }
}

fn invalid(key: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

fn parse_int<T>(key: &str, v: &str) -> Result<T, ConfigError>
where
    T: std::str::FromStr + num_bounds::Bounded,
{
    v.parse::<T>()
        .map_err(|_| invalid(key, v, &format!("an integer in 0..={}", T::max_text())))
}

fn parse_prefer(key: &str, v: &str) -> Result<RetryPrefer, ConfigError> {
    match v.to_ascii_lowercase().as_str() {
        "other" => Ok(RetryPrefer::Other),
        "same" => Ok(RetryPrefer::Same),
        _ => Err(invalid(key, v, "`other` or `same`")),
    }
}

fn parse_on_no_runnable(key: &str, v: &str) -> Result<OnNoRunnable, ConfigError> {
    match v.to_ascii_lowercase().as_str() {
        "wait" => Ok(OnNoRunnable::Wait),
        "fail" => Ok(OnNoRunnable::Fail),
        _ => Err(invalid(key, v, "`wait` or `fail`")),
    }
}

/// `auto`, `off`, or a number of seconds (a static threshold).
fn parse_threshold(key: &str, v: &str) -> Result<ThresholdSetting, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(ThresholdSetting::Auto),
        "off" => Ok(ThresholdSetting::Off),
        _ => match v.parse::<f64>() {
            Ok(x) => guards::seconds(key, x).map(ThresholdSetting::Static),
            Err(_) => Err(invalid(
                key,
                v,
                "auto, off, or a number of seconds, e.g. 2.5",
            )),
        },
    }
}

fn parse_prior(key: &str, v: &str) -> Result<Option<Duration>, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "off" => Ok(None),
        _ => match v.parse::<f64>() {
            Ok(x) => guards::seconds(key, x).map(Some),
            Err(_) => Err(invalid(key, v, "off, or a number of seconds, e.g. 15")),
        },
    }
}

fn parse_secs(key: &str, v: &str) -> Result<Duration, ConfigError> {
    match v.parse::<f64>() {
        Ok(x) => guards::seconds(key, x),
        Err(_) => Err(invalid(key, v, "a number of seconds, e.g. 2.5")),
    }
}

fn parse_price(key: &str, v: &str) -> Result<f64, ConfigError> {
    match v.parse::<f64>() {
        Ok(x) => guards::price(key, x),
        Err(_) => Err(invalid(key, v, "a price per 1M tokens, e.g. 0.27")),
    }
}

fn parse_object(key: &str, v: &str) -> Result<Map<String, Value>, ConfigError> {
    // EXTRA_BODY may carry credentials of an upstream: its text is never echoed.
    match serde_json::from_str::<Value>(v) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(invalid(
            key,
            REDACTED,
            "a JSON object, e.g. {\"top_p\":0.9}",
        )),
        Err(e) => Err(invalid(
            key,
            REDACTED,
            &format!(
                "a JSON object (parse error at line {} column {})",
                e.line(),
                e.column()
            ),
        )),
    }
}

fn parse_aliases(key: &str, v: &str) -> Result<Vec<String>, ConfigError> {
    let list: Vec<String> = v.split(',').map(|a| a.trim().to_string()).collect();
    if list
        .iter()
        .any(|a| a.is_empty() || a.contains(char::is_whitespace))
    {
        return Err(invalid(
            key,
            v,
            "a comma-separated list of non-empty model names or `*` globs (`claude-*`)",
        ));
    }
    Ok(list)
}

mod num_bounds {
    /// The text of an integer type's maximum, for messages.
    pub trait Bounded {
        fn max_text() -> String;
    }
    impl Bounded for u32 {
        fn max_text() -> String {
            u32::MAX.to_string()
        }
    }
    impl Bounded for u64 {
        fn max_text() -> String {
            u64::MAX.to_string()
        }
    }
}
