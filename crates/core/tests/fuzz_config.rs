//! Fuzzing the environment configuration loader (issue 10): arbitrary sets of keys and
//! values — well-formed, near-miss and junk — through `load_scope` (every scope kind)
//! and `discover_scopes`. No input may panic; every error names a key of the scope; no
//! secret (an `API_KEY` value, a password in a URL-valued key, the text of an
//! `EXTRA_BODY`) ever appears in an error or a warning, in `Display` or `Debug`.
//!
//! Case counts: moderate by default; `POLYGW_FUZZ_CASES=N` runs N cases per property,
//! see docs/CHAOS.md.

use std::collections::BTreeSet;

use polygw_core::config::{
    discover_scopes, load_scope, RESERVED_SEGMENTS, SCOPE_KEYS, SOURCE_FIELDS,
};
use polygw_core::{ConfigError, ScopeKind};
use proptest::prelude::*;

/// Cases per property: `POLYGW_FUZZ_CASES` when set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("POLYGW_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n: &u32| *n > 0)
        .unwrap_or(default)
}

fn config(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default),
        max_shrink_iters: 4_000,
        // Failures print their minimal input; nothing is written into the source tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Every generated secret contains this.
const MARKER: &str = "sk-Zq";

/// A secret token: distinctive, so finding it in a text is never a coincidence.
fn secret() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9]{12}".prop_map(|s| format!("{MARKER}{s}")),
        // Keys with characters that need care anywhere they could be echoed.
        1 => "[ -~]{4,10}".prop_map(|s| format!("{MARKER}{s}")),
    ]
}

/// A provider segment: usual, reserved, near-miss or junk.
fn provider() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop_oneof![Just("DEEPSEEK"), Just("QWEN"), Just("A"), Just("OPEN_AI"), Just("V2")]
            .prop_map(str::to_string),
        1 => prop::sample::select(RESERVED_SEGMENTS.to_vec()).prop_map(str::to_string),
        1 => "[A-Z][A-Z0-9_]{0,6}",
        1 => prop_oneof![Just(""), Just("deepseek"), Just("_A"), Just("A_"), Just("Ü"), Just("A-B")]
            .prop_map(str::to_string),
    ]
}

/// A source index: usual, overflowing or not a number.
fn index() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop_oneof![Just("0"), Just("1"), Just("2")].prop_map(str::to_string),
        1 => prop_oneof![Just("00"), Just("4294967295"), Just("4294967296"), Just("-1"), Just("+1"), Just("x"), Just(""), Just("٣")]
            .prop_map(str::to_string),
    ]
}

/// A source field: known, or a near miss.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => prop::sample::select(SOURCE_FIELDS.to_vec()).prop_map(str::to_string),
        1 => prop_oneof![Just("BASEURL"), Just("api_key"), Just("RPM "), Just(""), Just("TIMEOUT")]
            .prop_map(str::to_string),
    ]
}

/// One key of scope `s`: a source key, a scope key, or junk.
fn key(s: String) -> impl Strategy<Value = String> {
    let scope_key = prop::sample::select(SCOPE_KEYS.to_vec()).prop_map(|(g, f)| {
        if g.is_empty() {
            f.to_string()
        } else {
            format!("{g}__{f}")
        }
    });
    let near_scope = prop_oneof![
        Just("OCR__PROMPT".to_string()),
        Just("RETRY__MAX_ATTEMPT".to_string()),
        Just("HEDGE".to_string()),
        Just("HEDGE__AFTER_S__X".to_string()),
        Just("CALL_DEADLINE".to_string()),
    ];
    let other_scope =
        prop_oneof![Just("EMBED"), Just("OTHER"), Just("llm")].prop_map(str::to_string);
    let junk_seg = "[A-Za-z0-9_]{0,6}";
    prop_oneof![
        10 => (provider(), index(), field()).prop_map({
            let s = s.clone();
            move |(p, n, f)| format!("{s}__{p}__{n}__{f}")
        }),
        4 => scope_key.prop_map({
            let s = s.clone();
            move |k| format!("{s}__{k}")
        }),
        1 => near_scope.prop_map({
            let s = s.clone();
            move |k| format!("{s}__{k}")
        }),
        1 => (other_scope, provider(), index(), field())
            .prop_map(|(o, p, n, f)| format!("{o}__{p}__{n}__{f}")),
        1 => prop::collection::vec(junk_seg, 1..6).prop_map({
            let s = s.clone();
            move |segs| format!("{s}__{}", segs.join("__"))
        }),
        1 => ".{0,24}",
    ]
}

/// A value, and whether it carries a secret (and which).
#[derive(Debug, Clone)]
struct Val {
    text: String,
    /// The secret inside `text`, when `text` puts it where a secret lives (a URL's
    /// password, an `EXTRA_BODY` body); only a secret for the matching keys.
    hidden: Option<String>,
}

fn value() -> impl Strategy<Value = Val> {
    let plain = |s: &'static str| Val {
        text: s.to_string(),
        hidden: None,
    };
    let numbers = prop_oneof![
        Just("0"),
        Just("1"),
        Just("-1"),
        Just("2.5"),
        Just("0.2"),
        Just("60"),
        Just("NaN"),
        Just("inf"),
        Just("-inf"),
        Just("1e309"),
        Just("86401"),
        Just("4294967296"),
        Just("18446744073709551616"),
        Just(" 7 "),
        Just("0x10"),
        Just(""),
        Just("wait"),
        Just("FAIL"),
        Just("a,,b"),
        Just("gpt-4o, chat"),
        Just("{}"),
        Just("[1]"),
        Just("{\"top_p\": 0.9}"),
        Just("null"),
        Just("http://127.0.0.1:8000/v1"),
        Just("https://api.example.com/v1/"),
        Just("ftp://x"),
        Just("http://"),
        Just("sqlite://t.db"),
        Just("sqlite:"),
        Just("redis://127.0.0.1:6379"),
        Just("redis://"),
        Just("not a url"),
    ]
    .prop_map(plain);
    let numeric =
        "-?[0-9]{1,22}(\\.[0-9]{0,4})?(e-?[0-9]{1,3})?".prop_map(|text| Val { text, hidden: None });
    let with_secret = (
        secret(),
        prop_oneof![
            Just("http://u:{}@127.0.0.1/v1"),
            Just("https://:{}@h/v1"),
            Just("redis://:{}@127.0.0.1:6379/0"),
            Just("rediss://user:{}@h"),
            Just("postgres://u:{}@h/db"),
            Just("mysql://u:{}@h/db"),
            Just("sqlite://u:{}@x"),
            Just("redis://h/?password={}"),
            Just("http://h/v1?key={}"),
            Just("{\"api_key\": \"{}\""),
            Just("{\"api_key\": \"{}\"}"),
            Just("[\"{}\"]"),
            Just("::{}::"),
        ],
    )
        .prop_map(|(s, pat)| Val {
            text: pat.replace("{}", &s),
            hidden: Some(s),
        });
    let text = ".{0,16}".prop_map(|text| Val { text, hidden: None });
    prop_oneof![5 => numbers, 2 => numeric, 2 => with_secret, 2 => text]
}

/// A scope name: usual ones, odd but valid ones, lower case.
fn scope() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => Just("LLM".to_string()),
        1 => Just("EMBED".to_string()),
        1 => Just("OCR".to_string()),
        1 => "[A-Z][A-Z0-9]{0,4}(_[A-Z0-9]{1,3})?",
        1 => Just("llm".to_string()),
    ]
}

/// A valid base for scope `s`: two sources with secret keys.
fn base(s: &str, k0: &str, k1: &str) -> Vec<(String, Val)> {
    let v = |t: &str| Val {
        text: t.to_string(),
        hidden: None,
    };
    vec![
        (
            format!("{s}__DEEPSEEK__0__BASE_URL"),
            v("https://api.deepseek.com/v1/"),
        ),
        (format!("{s}__DEEPSEEK__0__API_KEY"), v(k0)),
        (format!("{s}__DEEPSEEK__0__MODEL"), v("deepseek-chat")),
        (
            format!("{s}__QWEN__1__BASE_URL"),
            v("http://127.0.0.1:8000/v1"),
        ),
        (format!("{s}__QWEN__1__API_KEY"), v(k1)),
        (format!("{s}__QWEN__1__MODEL"), v("qwen")),
    ]
}

/// The secrets of a set of variables, and the texts in which a secret would not be a
/// leak (keys, and the values of fields that are not secret).
fn secrets_of(vars: &[(String, Val)]) -> (Vec<String>, Vec<String>) {
    secrets_where(vars, |_| true)
}

/// The secrets whose `Debug` of the loaded settings must hide: every one (API keys,
/// telemetry and Redis URLs, a token in a `BASE_URL` query, an `EXTRA_BODY` body —
/// FINDING CFG-1, fixed).
fn secret_typed(vars: &[(String, Val)]) -> (Vec<String>, Vec<String>) {
    secrets_of(vars)
}

fn secrets_where(
    vars: &[(String, Val)],
    keep: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    let mut secrets = Vec::new();
    let mut public = Vec::new();
    for (k, v) in vars {
        public.push(k.clone());
        let urlish = [
            "__BASE_URL",
            "__TELEMETRY__URL",
            "__REDIS__URL",
            "__EXTRA_BODY",
        ]
        .iter()
        .any(|f| k.ends_with(f));
        if k.ends_with("__API_KEY") {
            // Generated keys carry a marker; other values (`redis://`, `0`) may appear in
            // fixed help texts, which is not a leak.
            if v.text.contains(MARKER) {
                secrets.push(v.text.trim().to_string());
            }
            if let Some(h) = &v.hidden {
                secrets.push(h.clone());
            }
        } else if urlish && v.hidden.is_some() {
            if keep(k) {
                secrets.extend(v.hidden.clone());
            }
        } else {
            public.push(v.text.clone());
        }
    }
    (secrets, public)
}

/// The first secret found in `text` that no public text explains.
fn leak(text: &str, secrets: &[String], public: &[String]) -> Option<String> {
    secrets
        .iter()
        .find(|s| text.contains(s.as_str()) && !public.iter().any(|p| p.contains(s.as_str())))
        .cloned()
}

/// Every text a caller could print of a load result.
fn texts_of(e: &ConfigError) -> Vec<String> {
    let mut out = vec![e.to_string(), format!("{e:?}")];
    for one in e.all() {
        out.push(one.to_string());
        out.push(format!("{one:?}"));
    }
    out
}

fn key_of(e: &ConfigError) -> Option<&str> {
    match e {
        ConfigError::Invalid { key, .. }
        | ConfigError::Missing { key, .. }
        | ConfigError::UnknownKey { key, .. }
        | ConfigError::ReservedProvider { key, .. }
        | ConfigError::Guard { key, .. } => Some(key),
        _ => None,
    }
}

/// The checks every load result passes.
fn check_load(vars: &[(String, Val)], scope: &str, kind: ScopeKind) -> Result<bool, TestCaseError> {
    let pairs: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.text.clone()))
        .collect();
    let upper = scope.to_uppercase();
    let prefix = format!("{upper}__");
    let (secrets, public) = secrets_of(vars);
    let leaks = |text: &str| leak(text, &secrets, &public);
    let (typed, typed_public) = secret_typed(vars);
    match load_scope(pairs, scope, kind) {
        Ok(loaded) => {
            prop_assert!(!loaded.settings.sources.is_empty());
            for w in &loaded.warnings {
                prop_assert!(
                    w.key.starts_with(&prefix),
                    "warning names no key of {}: {}",
                    upper,
                    w
                );
                let text = format!("{w} {w:?}");
                prop_assert!(leaks(&text).is_none(), "secret in a warning: {}", text);
            }
            // FINDING CFG-1 (fixed): `SourceConfig`'s Debug hides a `BASE_URL` query and
            // the values of `EXTRA_BODY`, so every secret is checked in the settings' Debug.
            let debug = format!("{:?}", loaded.settings);
            let found = leak(&debug, &typed, &typed_public);
            prop_assert!(
                found.is_none(),
                "secret {:?} in the settings' Debug: {}",
                found,
                debug
            );
            Ok(true)
        }
        Err(e) => {
            for one in e.all() {
                let text = one.to_string();
                match key_of(one) {
                    Some(k) => {
                        prop_assert!(
                            k.starts_with(&prefix),
                            "error key {} is not under {}: {}",
                            k,
                            prefix,
                            text
                        );
                        prop_assert!(
                            text.contains(k),
                            "error does not name its key {}: {}",
                            k,
                            text
                        );
                    }
                    None if matches!(one, ConfigError::DuplicateSource { .. }) => {
                        prop_assert!(text.contains(&upper), "{}", text);
                    }
                    None => prop_assert!(
                        text.contains(&prefix),
                        "error names no key of {}: {}",
                        upper,
                        text
                    ),
                }
            }
            for text in texts_of(&e) {
                prop_assert!(
                    leaks(&text).is_none(),
                    "secret {:?} in an error: {}",
                    leaks(&text),
                    text
                );
            }
            Ok(false)
        }
    }
}

fn scope_kind() -> impl Strategy<Value = ScopeKind> {
    prop_oneof![4 => Just(ScopeKind::Chat), 1 => Just(ScopeKind::Embedding), 1 => Just(ScopeKind::Ocr)]
}

/// Arbitrary variables for a scope, on top of a valid base or not.
fn vars() -> impl Strategy<Value = (String, Vec<(String, Val)>)> {
    (scope(), any::<bool>(), secret(), secret())
        .prop_flat_map(|(s, with_base, k0, k1)| {
            let upper = s.to_uppercase();
            let extra = prop::collection::vec(
                (key(upper.clone()), value(), secret(), any::<bool>()),
                0..10,
            )
            .prop_map(|entries| {
                entries
                    .into_iter()
                    .map(|(k, v, s, use_secret)| {
                        if k.ends_with("__API_KEY") && use_secret {
                            (
                                k,
                                Val {
                                    text: s,
                                    hidden: None,
                                },
                            )
                        } else {
                            (k, v)
                        }
                    })
                    .collect::<Vec<_>>()
            });
            (Just(s), Just(with_base), Just(k0), Just(k1), extra)
        })
        .prop_map(|(s, with_base, k0, k1, extra)| {
            let upper = s.to_uppercase();
            let mut v = if with_base {
                base(&upper, &k0, &k1)
            } else {
                Vec::new()
            };
            v.extend(extra);
            (s, v)
        })
}

proptest! {
    #![proptest_config(config(2_000))]

    /// Any variables: no panic, every error names a key of the scope, no secret leaks,
    /// whichever scope kind is loaded.
    #[test]
    fn any_variables_load_or_fail_naming_a_key_without_secrets(
        (scope, vars) in vars(),
        kind in scope_kind(),
    ) {
        check_load(&vars, &scope, kind)?;
    }

    /// A valid base with one key overridden by any value (the key of a secret field
    /// gets a secret): loads, or fails naming that key — never a panic, never a leak.
    #[test]
    fn one_bad_value_is_named(
        k0 in secret(),
        k1 in secret(),
        key in key("LLM".to_string()),
        val in value(),
        secret_val in secret(),
    ) {
        let mut vars = base("LLM", &k0, &k1);
        let val = if key.ends_with("__API_KEY") {
            Val { text: secret_val, hidden: None }
        } else {
            val
        };
        vars.retain(|(k, _)| k != &key);
        vars.push((key, val));
        check_load(&vars, "LLM", ScopeKind::Chat)?;
    }

    /// `discover_scopes` agrees with `load_scope`: a scope that loads is discovered,
    /// and a discovered scope never fails for want of a source.
    #[test]
    fn discovery_agrees_with_loading((scope, vars) in vars()) {
        let pairs: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.clone(), v.text.clone())).collect();
        let found: BTreeSet<String> = discover_scopes(pairs.clone()).into_iter().collect();
        for s in &found {
            prop_assert!(!s.is_empty() && s.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'), "{}", s);
            if let Err(e) = load_scope(pairs.clone(), s, ScopeKind::Chat) {
                prop_assert!(
                    !e.all().iter().any(|one| matches!(one, ConfigError::NoSources { .. })),
                    "discovered scope {} has no source: {}", s, e
                );
            }
        }
        // Scope names of the documented shape (upper-case letters, digits, `_`).
        let upper = scope.to_uppercase();
        if load_scope(pairs, &scope, ScopeKind::Chat).is_ok() {
            prop_assert!(found.contains(&upper), "{} loads but is not discovered: {:?}", upper, found);
        }
    }
}

#[test]
fn a_secret_everywhere_at_once_never_leaks() {
    let pw = "sk-ZqEverywhere01";
    let vars = vec![
        ("LLM__A__0__BASE_URL", format!("http://u:{pw}@h/v1")),
        ("LLM__A__0__API_KEY", pw.to_string()),
        ("LLM__A__0__MODEL", "m".to_string()),
        ("LLM__A__0__EXTRA_BODY", format!("{{\"k\": \"{pw}\"")),
        ("LLM__A__0__RPM", "x".to_string()),
        ("LLM__TELEMETRY__URL", format!("mysql://u:{pw}@h/db")),
        ("LLM__REDIS__URL", format!("http://:{pw}@h")),
    ];
    let e = load_scope(vars, "LLM", ScopeKind::Chat).unwrap_err();
    assert!(e.all().len() >= 4, "{e}");
    for text in texts_of(&e) {
        assert!(!text.contains(pw), "{text}");
    }
}
