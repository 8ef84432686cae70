//! Configuration (SPEC §2): scopes from environment-style keys, from code, or both,
//! always through the same guards.
//!
//! - [`load_scope`] reads any key/value source (`std::env::vars()`, a map in a test).
//! - Settings built in code ([`crate::ScopeSettings::new`] + field edits) are checked by
//!   [`guards::check`], which the loader and every client builder call too.
//! - "Both": load from the environment, edit the struct, hand it to a builder.

pub mod env;
pub mod guards;

use serde::Serialize;

pub use env::{
    discover_scopes, load_scope, scope_kind, RESERVED_SEGMENTS, SCOPE_KEYS, SOURCE_FIELDS,
};

use crate::settings::ScopeSettings;

/// A configuration that works but probably not as intended (SPEC §2.2). Returned as a
/// value and logged with `tracing::warn!`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigWarning {
    /// The key the warning is about.
    pub key: String,
    /// What will happen.
    pub message: String,
}

impl std::fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// A loaded and guarded scope, with its warnings.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedScope {
    /// The settings.
    pub settings: ScopeSettings,
    /// What the guards warned about.
    pub warnings: Vec<ConfigWarning>,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::error::ConfigError;
    use crate::settings::{OnNoRunnable, ScopeKind};

    fn base() -> Vec<(String, String)> {
        [
            ("LLM__DEEPSEEK__0__BASE_URL", "https://api.deepseek.com/v1/"),
            ("LLM__DEEPSEEK__0__API_KEY", "sk-secret-key"),
            ("LLM__DEEPSEEK__0__MODEL", "deepseek-chat"),
            ("LLM__QWEN__1__BASE_URL", "http://127.0.0.1:8000/v1"),
            ("LLM__QWEN__1__API_KEY", ""),
            ("LLM__QWEN__1__MODEL", "qwen"),
            ("UNRELATED", "x"),
            ("OTHER__A__0__BASE_URL", "not even a url"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn with(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v = base();
        v.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        v
    }

    fn load(extra: &[(&str, &str)]) -> Result<LoadedScope, ConfigError> {
        load_scope(with(extra), "llm", ScopeKind::Chat)
    }

    fn err_text(extra: &[(&str, &str)]) -> String {
        load(extra).unwrap_err().to_string()
    }

    #[test]
    fn loads_sources_and_defaults() {
        let l = load(&[]).unwrap();
        let s = &l.settings;
        assert_eq!(s.name, "LLM");
        let names: Vec<&str> = s.sources.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["deepseek-0", "qwen-1"]);
        assert_eq!(s.sources[0].base_url, "https://api.deepseek.com/v1");
        assert_eq!(s.sources[0].api_key.expose(), "sk-secret-key");
        assert!(s.sources[1].api_key.is_empty());
        assert_eq!(s.sources[0].timeout, Duration::from_secs(60));
        assert_eq!(s.retry.max_attempts, 3);
        assert_eq!(
            s.hedge.after,
            crate::hedge::ThresholdSetting::Auto,
            "auto by default"
        );
        assert!(l.warnings.is_empty());
    }

    #[test]
    fn every_key_parses() {
        let l = load(&[
            ("LLM__DEEPSEEK__0__RPM", "60"),
            ("LLM__DEEPSEEK__0__TPM", "100000"),
            ("LLM__DEEPSEEK__0__EST_TOKENS", "500"),
            ("LLM__DEEPSEEK__0__MAX_CONCURRENCY", "4"),
            ("LLM__DEEPSEEK__0__TIMEOUT_S", "30"),
            ("LLM__DEEPSEEK__0__TTFT_TIMEOUT_S", "10"),
            ("LLM__DEEPSEEK__0__INTER_TOKEN_TIMEOUT_S", "20"),
            ("LLM__DEEPSEEK__0__PRIORITY", "1"),
            ("LLM__DEEPSEEK__0__WEIGHT", "3"),
            ("LLM__DEEPSEEK__0__INPUT_PRICE", "0.27"),
            ("LLM__DEEPSEEK__0__OUTPUT_PRICE", "1.1"),
            ("LLM__DEEPSEEK__0__CACHED_INPUT_PRICE", "0.07"),
            ("LLM__DEEPSEEK__0__CACHE_WRITE_PRICE", "0.3375"),
            ("LLM__DEEPSEEK__0__PRICE_PER_CALL", "0.01"),
            ("LLM__DEEPSEEK__0__BATCH_SIZE", "16"),
            ("LLM__DEEPSEEK__0__EXTRA_BODY", "{\"top_p\": 0.9}"),
            ("LLM__CALL_DEADLINE_S", "120"),
            ("LLM__MODEL_ALIASES", "gpt-4o, chat"),
            ("LLM__RETRY__MAX_ATTEMPTS", "5"),
            ("LLM__RETRY__STALL_WINDOW_S", "30"),
            ("LLM__RETRY__BACKOFF_BASE_S", "0.25"),
            ("LLM__RETRY__BACKOFF_MAX_S", "4"),
            ("LLM__RETRY__ON_NO_RUNNABLE", "FAIL"),
            ("LLM__LIMITS__RPM", "100"),
            ("LLM__LIMITS__TPM", "200000"),
            ("LLM__BREAKER__FAILURES", "3"),
            ("LLM__BREAKER__OPEN_S", "10"),
            ("LLM__BREAKER__DEAD_S", "100"),
            ("LLM__HEDGE__AFTER_S", "5"),
            ("LLM__HEDGE__STALL_AFTER_S", "8"),
            ("LLM__HEDGE__MAX_EXTRA", "2"),
            ("LLM__HEDGE__BUDGET_PCT", "10"),
            ("LLM__STREAM__STALL_THRESHOLD_MS", "500"),
            ("LLM__CACHE__TTL_S", "60"),
            ("LLM__CACHE__CAPACITY", "100"),
            ("LLM__TELEMETRY__URL", "sqlite://x.db"),
            ("LLM__REDIS__URL", "redis://127.0.0.1:6379"),
            ("LLM__STRUCTURED__MAX_REASKS", "1"),
            ("LLM__OCR__PROMPT", "Read it."),
            ("LLM__AFFINITY", "off"),
            ("LLM__AFFINITY__TTL_S", "120"),
        ])
        .unwrap();
        let s = &l.settings;
        let d = &s.sources[0];
        assert_eq!(
            (d.rpm, d.tpm, d.est_tokens, d.max_concurrency),
            (60, 100000, 500, 4)
        );
        assert_eq!(d.timeout, Duration::from_secs(30));
        assert_eq!(d.ttft_timeout, Some(Duration::from_secs(10)));
        assert_eq!(d.inter_token_timeout, Some(Duration::from_secs(20)));
        assert_eq!((d.priority, d.weight, d.batch_size), (1, 3, 16));
        assert_eq!(d.input_price, Some(0.27));
        assert_eq!(d.output_price, Some(1.1));
        assert_eq!(d.cached_input_price, Some(0.07));
        assert_eq!(d.cache_write_price, Some(0.3375));
        assert_eq!(d.price_per_call, Some(0.01));
        assert_eq!(d.extra_body["top_p"], 0.9);
        assert_eq!(s.call_deadline, Some(Duration::from_secs(120)));
        assert_eq!(s.model_aliases, ["gpt-4o", "chat"]);
        assert_eq!(s.retry.max_attempts, 5);
        assert_eq!(s.retry.on_no_runnable, OnNoRunnable::Fail);
        assert_eq!(s.retry.backoff_base, Duration::from_millis(250));
        assert_eq!((s.limits.rpm, s.limits.tpm), (100, 200000));
        assert_eq!(s.breaker.failures, 3);
        assert_eq!(
            s.hedge.after,
            crate::hedge::ThresholdSetting::Static(Duration::from_secs(5))
        );
        assert_eq!(
            s.hedge.stall_after,
            crate::hedge::ThresholdSetting::Static(Duration::from_secs(8))
        );
        assert_eq!((s.hedge.max_extra, s.hedge.budget_pct), (2, 10));
        assert_eq!(s.stream.stall_threshold, Duration::from_millis(500));
        assert_eq!(s.cache.ttl, Some(Duration::from_secs(60)));
        assert_eq!(s.cache.capacity, 100);
        assert!(s.telemetry_url.is_some() && s.redis_url.is_some());
        assert_eq!(s.max_reasks, 1);
        assert_eq!(s.ocr_prompt, "Read it.");
        assert_eq!(s.affinity.mode, crate::affinity::AffinityMode::Off);
        assert_eq!(s.affinity.ttl, Duration::from_secs(120));
    }

    #[test]
    fn malformed_values_name_key_value_and_expectation() {
        let rows = [
            ("LLM__DEEPSEEK__0__RPM", "ten", "an integer"),
            ("LLM__DEEPSEEK__0__RPM", "-1", "an integer"),
            ("LLM__DEEPSEEK__0__TIMEOUT_S", "0", "> 0"),
            ("LLM__DEEPSEEK__0__TIMEOUT_S", "NaN", "finite"),
            ("LLM__DEEPSEEK__0__TIMEOUT_S", "inf", "finite"),
            ("LLM__DEEPSEEK__0__WEIGHT", "0", "1..=1000000"),
            ("LLM__DEEPSEEK__0__INPUT_PRICE", "-0.5", "≥ 0"),
            ("LLM__DEEPSEEK__0__CACHED_INPUT_PRICE", "-0.01", "≥ 0"),
            ("LLM__DEEPSEEK__0__CACHED_INPUT_PRICE", "NaN", "≥ 0"),
            (
                "LLM__DEEPSEEK__0__CACHED_INPUT_PRICE",
                "cheap",
                "a price per 1M tokens",
            ),
            ("LLM__DEEPSEEK__0__CACHE_WRITE_PRICE", "-1", "≥ 0"),
            ("LLM__DEEPSEEK__0__CACHE_WRITE_PRICE", "inf", "≥ 0"),
            ("LLM__DEEPSEEK__0__EXTRA_BODY", "[1]", "JSON object"),
            ("LLM__HEDGE__MAX_EXTRA", "4", "1..=3"),
            ("LLM__HEDGE__MAX_EXTRA", "0", "1..=3"),
            ("LLM__RETRY__ON_NO_RUNNABLE", "maybe", "`wait` or `fail`"),
            ("LLM__CALL_DEADLINE_S", "-3", "> 0"),
            ("LLM__MODEL_ALIASES", "a,,b", "comma-separated"),
            ("LLM__STREAM__STALL_THRESHOLD_MS", "0", "1..="),
            ("LLM__AFFINITY", "sticky", "off or session"),
            ("LLM__AFFINITY__TTL_S", "0", "> 0"),
        ];
        for (key, value, expected) in rows {
            let text = err_text(&[(key, value)]);
            assert!(text.contains(key), "{key}: {text}");
            assert!(text.contains(expected), "{key}={value}: {text}");
        }
    }

    #[test]
    fn secrets_never_appear_in_errors() {
        let text = err_text(&[
            ("LLM__DEEPSEEK__0__EXTRA_BODY", "{\"api_key\": \"sk-inner\""),
            ("LLM__TELEMETRY__URL", "mysql://u:hunter2@h/db"),
            ("LLM__REDIS__URL", "http://:pw-redis@h"),
            ("LLM__DEEPSEEK__0__RPM", "x"),
        ]);
        for secret in ["sk-secret-key", "sk-inner", "hunter2", "pw-redis"] {
            assert!(!text.contains(secret), "{secret} leaked: {text}");
        }
        assert!(text.contains("4 configuration errors"), "{text}");
    }

    #[test]
    fn unknown_fields_and_keys_are_errors() {
        let text = err_text(&[("LLM__DEEPSEEK__0__BASEURL", "x")]);
        assert!(text.contains("unknown source field \"BASEURL\""), "{text}");
        let text = err_text(&[("LLM__RETRY__MAX_ATTEMPT", "3")]);
        assert!(text.contains("LLM__RETRY__MAX_ATTEMPTS"), "{text}");
        let text = err_text(&[("LLM__DEEPSEEK__BASE_URL", "x")]);
        assert!(text.contains("needs an index"), "{text}");
        let text = err_text(&[("LLM__DEEPSEEK__X__MODEL", "m")]);
        assert!(text.contains("source index"), "{text}");
        let text = err_text(&[("LLM__A__0__B__C", "m")]);
        assert!(text.contains("too many segments"), "{text}");
        let text = err_text(&[("LLM__DeepSeek__0__MODEL", "m")]);
        assert!(text.contains("upper-case"), "{text}");
    }

    #[test]
    fn reserved_segments_cannot_be_providers() {
        for r in RESERVED_SEGMENTS {
            let key = format!("LLM__{r}__0__MODEL");
            let e = load_scope(with(&[(key.as_str(), "m")]), "LLM", ScopeKind::Chat).unwrap_err();
            assert!(
                e.all().iter().any(
                    |e| matches!(e, ConfigError::ReservedProvider { provider, .. } if provider == r)
                ),
                "{r}: {e}"
            );
        }
    }

    #[test]
    fn missing_required_fields_are_named() {
        let vars = vec![("LLM__A__0__BASE_URL".to_string(), "http://x".to_string())];
        let text = load_scope(vars, "LLM", ScopeKind::Chat)
            .unwrap_err()
            .to_string();
        assert!(text.contains("LLM__A__0__API_KEY is missing"), "{text}");
        assert!(text.contains("LLM__A__0__MODEL is missing"), "{text}");
    }

    #[test]
    fn empty_scope_is_an_error() {
        let e = load_scope(base(), "NOPE", ScopeKind::Chat).unwrap_err();
        assert!(matches!(e, ConfigError::NoSources { .. }), "{e}");
    }

    #[test]
    fn guards_run_on_env_path_with_warnings() {
        let l = load(&[
            ("LLM__DEEPSEEK__0__TTFT_TIMEOUT_S", "2"),
            ("LLM__HEDGE__AFTER_S", "3"),
        ])
        .unwrap();
        assert_eq!(l.warnings.len(), 1);
        assert_eq!(l.warnings[0].key, "LLM__HEDGE__AFTER_S");
        assert_eq!(
            l.warnings[0].to_string(),
            format!("LLM__HEDGE__AFTER_S: {}", l.warnings[0].message)
        );
        let text = err_text(&[
            ("LLM__DEEPSEEK__0__TIMEOUT_S", "2"),
            ("LLM__HEDGE__AFTER_S", "3"),
        ]);
        assert!(text.contains("could never fire"), "{text}");
        let e = load_scope(
            with(&[("LLM__HEDGE__AFTER_S", "3")]),
            "LLM",
            ScopeKind::Embedding,
        )
        .unwrap();
        assert!(e.warnings.iter().any(|w| w.message.contains("chat-only")));
    }

    #[test]
    fn the_kind_is_declared_never_inferred_from_the_name() {
        use crate::config::scope_kind;
        // A scope named EMBED is a chat scope unless it says otherwise.
        let mut v = base();
        v.iter_mut()
            .for_each(|(k, _)| *k = k.replacen("LLM__", "EMBED__", 1));
        assert_eq!(scope_kind(v.clone(), "embed").unwrap(), ScopeKind::Chat);
        assert!(load_scope(v.clone(), "EMBED", ScopeKind::Chat).is_ok());
        v.push(("EMBED__KIND".into(), " Embedding ".into()));
        assert_eq!(
            scope_kind(v.clone(), "EMBED").unwrap(),
            ScopeKind::Embedding
        );
        assert!(load_scope(v.clone(), "EMBED", ScopeKind::Embedding).is_ok());
        let text = load_scope(v.clone(), "EMBED", ScopeKind::Chat)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("EMBED__KIND") && text.contains("declared embedding"),
            "{text}"
        );
        let bad = with(&[("LLM__KIND", "vision")]);
        let e = scope_kind(bad.clone(), "LLM").unwrap_err().to_string();
        assert!(
            e.contains("LLM__KIND") && e.contains("chat, embedding or ocr"),
            "{e}"
        );
        assert!(load_scope(bad, "LLM", ScopeKind::Chat).is_err());
        assert_eq!(
            scope_kind(with(&[("LLM__KIND", "ocr")]), "LLM").unwrap(),
            ScopeKind::Ocr
        );
    }

    #[test]
    fn discovers_scopes() {
        let mut v = base();
        v.push(("EMBED__BGE__0__MODEL".into(), "bge".into()));
        v.push(("RUST_LOG".into(), "info".into()));
        v.push(("X__Y__Z__MODEL".into(), "m".into()));
        assert_eq!(discover_scopes(v), ["EMBED", "LLM", "OTHER"]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any value for any known key either loads or fails with an error naming that
        /// key — never a panic, never a silent default.
        #[test]
        fn any_value_for_any_key_is_loaded_or_named(
            field_idx in 0usize..SOURCE_FIELDS.len(),
            scope_idx in 0usize..SCOPE_KEYS.len(),
            v1 in ".{0,12}",
            v2 in prop_oneof![Just("0".to_string()), Just("1.5".to_string()), "-?[0-9]{1,6}(\\.[0-9]{0,3})?", ".{0,8}"],
        ) {
            let field = SOURCE_FIELDS[field_idx];
            let (g, f) = SCOPE_KEYS[scope_idx];
            let skey = format!("LLM__DEEPSEEK__0__{field}");
            let gkey = if g.is_empty() { format!("LLM__{f}") } else { format!("LLM__{g}__{f}") };
            let mut vars = base();
            vars.retain(|(k, _)| k != &skey);
            vars.push((skey.clone(), v1.clone()));
            vars.push((gkey.clone(), v2.clone()));
            match load_scope(vars, "LLM", ScopeKind::Chat) {
                Ok(l) => {
                    prop_assert_eq!(l.settings.sources.len(), 2);
                }
                Err(e) => {
                    for one in e.all() {
                        let text = one.to_string();
                        prop_assert!(
                            text.contains(&skey) || text.contains(&gkey) || text.contains("LLM__"),
                            "error names no key: {}", text
                        );
                        prop_assert!(!text.contains("sk-secret-key"));
                    }
                }
            }
        }

        /// Integers round-trip through the loader.
        #[test]
        fn integers_round_trip(rpm in 0u32..=u32::MAX, tpm in 0u64..=u64::MAX, prio in 0u32..1000) {
            let rpm_s = rpm.to_string();
            let tpm_s = tpm.to_string();
            let prio_s = prio.to_string();
            let l = load(&[
                ("LLM__QWEN__1__RPM", rpm_s.as_str()),
                ("LLM__QWEN__1__TPM", tpm_s.as_str()),
                ("LLM__QWEN__1__PRIORITY", prio_s.as_str()),
            ]).unwrap();
            let q = &l.settings.sources[1];
            prop_assert_eq!((q.rpm, q.tpm, q.priority), (rpm, tpm, prio));
        }
    }
}
