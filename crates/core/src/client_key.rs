//! Client keys (SPEC §21.1): the record a key store keeps for each key a client of
//! `polygw serve` presents — never the key itself, only its hash — with what it may use
//! (scopes, models) and its limits and budgets; and the pure rules over it: reading a
//! budget (`25/day`, `100/month`), whether a key may call a scope and model, and what a
//! refusal of the key says.
//!
//! Money is in integer nano-units of the prices' currency (1.00 = 1 000 000 000), so sums
//! over many calls and processes are exact.

use serde::{Deserialize, Serialize};

/// Nano-units per currency unit.
pub const NANOS_PER_UNIT: u64 = 1_000_000_000;

/// The largest budget accepted (nanos): 9 000 000 currency units, below 2^53 so every
/// backend (Redis Lua numbers are doubles) sums it exactly.
pub const MAX_BUDGET_NANOS: u64 = 9_000_000 * NANOS_PER_UNIT;

/// What the store keeps of one client key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientKey {
    /// The key's public id (`key_…`): in telemetry (`client_key_id`), logs and the CLI.
    pub id: String,
    /// A name for people.
    pub name: String,
    /// The SHA-256 of the key, lowercase hex. The key itself is never stored.
    pub hash: String,
    /// The key's first characters (`pgw-ab12…`), to recognise it in a list.
    pub prefix: String,
    /// Scopes it may call (empty: every scope).
    pub scopes: Vec<String>,
    /// Models it may ask for (empty: every model of its scopes).
    pub models: Vec<String>,
    /// Limits and budgets.
    pub limits: KeyLimits,
    /// When it was created (Unix ms).
    pub created_at_ms: i64,
    /// When it was last changed (created, rotated, limits set, revoked; Unix ms).
    pub updated_at_ms: i64,
    /// When it was revoked (Unix ms); a revoked key is refused.
    pub revoked_at_ms: Option<i64>,
}

/// A key's limits (0 = unlimited) and budgets (None = none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeyLimits {
    /// Requests per minute (the client's requests to polygw).
    pub rpm: u32,
    /// Tokens per minute (all the calls' attempts).
    pub tpm: u64,
    /// Calls in flight.
    pub max_concurrency: u32,
    /// Spend per UTC day, nanos.
    pub budget_day_nanos: Option<u64>,
    /// Spend per UTC month, nanos.
    pub budget_month_nanos: Option<u64>,
}

impl KeyLimits {
    /// Whether any budget is set.
    pub fn has_budget(&self) -> bool {
        self.budget_day_nanos.is_some() || self.budget_month_nanos.is_some()
    }

    /// Whether nothing is limited (admission need not ask the governance backend).
    pub fn is_unlimited(&self) -> bool {
        self.rpm == 0 && self.tpm == 0 && self.max_concurrency == 0 && !self.has_budget()
    }
}

/// A budget's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPeriod {
    /// A UTC calendar day.
    Day,
    /// A UTC calendar month.
    Month,
}

impl BudgetPeriod {
    /// `day` or `month`.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetPeriod::Day => "day",
            BudgetPeriod::Month => "month",
        }
    }
}

/// Reads a budget `AMOUNT/PERIOD` (`25/day`, `100.50/month`; the amount in the prices'
/// currency, up to 9 decimals): its period and nanos. Errors name what is wrong.
pub fn parse_budget(text: &str) -> Result<(BudgetPeriod, u64), String> {
    let t = text.trim();
    let Some((amount, period)) = t.split_once('/') else {
        return Err(format!(
            "budget {t:?}: expected AMOUNT/day or AMOUNT/month (e.g. 25/day)"
        ));
    };
    let period = match period.trim().to_ascii_lowercase().as_str() {
        "day" | "d" => BudgetPeriod::Day,
        "month" | "m" | "mo" => BudgetPeriod::Month,
        other => {
            return Err(format!(
                "budget {t:?}: the period {other:?} is neither day nor month"
            ))
        }
    };
    let nanos = parse_amount(amount.trim()).map_err(|e| format!("budget {t:?}: {e}"))?;
    Ok((period, nanos))
}

/// A decimal amount (`25`, `0.5`, `100.000000001`) as nanos, exactly; at most
/// [`MAX_BUDGET_NANOS`].
pub fn parse_amount(a: &str) -> Result<u64, String> {
    let (int, frac) = a.split_once('.').unwrap_or((a, ""));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || (!frac.is_empty() && !digits(frac)) || (a.contains('.') && frac.is_empty()) {
        return Err(format!("the amount {a:?} is not a decimal number ≥ 0"));
    }
    if frac.len() > 9 {
        return Err(format!(
            "the amount {a:?} has more than 9 decimals (the unit is 10⁻⁹)"
        ));
    }
    let too_big = || format!("the amount {a:?} is above the largest budget, 9000000");
    let units: u64 = int.parse().map_err(|_| too_big())?;
    let frac_nanos: u64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().map_err(|_| too_big())?
    };
    let n = units
        .checked_mul(NANOS_PER_UNIT)
        .and_then(|n| n.checked_add(frac_nanos))
        .filter(|n| *n <= MAX_BUDGET_NANOS)
        .ok_or_else(too_big)?;
    Ok(n)
}

/// Nanos as a decimal amount, without trailing zeros (`25`, `0.5`, `0.000000027`).
pub fn format_nanos(n: u64) -> String {
    let units = n / NANOS_PER_UNIT;
    let frac = n % NANOS_PER_UNIT;
    if frac == 0 {
        return units.to_string();
    }
    let f = format!("{frac:09}");
    format!("{units}.{}", f.trim_end_matches('0'))
}

/// Why a key may not make a call (before any quota is asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyDenial {
    /// The key was revoked.
    Revoked,
    /// Its scopes do not include the scope.
    Scope(String),
    /// Its models do not include the model.
    Model(String),
}

impl KeyDenial {
    /// The client's error text (names the key by id, never by secret).
    pub fn message(&self, key_id: &str) -> String {
        match self {
            KeyDenial::Revoked => format!("client key {key_id} was revoked"),
            KeyDenial::Scope(s) => format!("client key {key_id} may not use scope {s:?}"),
            KeyDenial::Model(m) => format!("client key {key_id} may not use model {m:?}"),
        }
    }
}

/// Whether `key`'s scopes include `scope` (no scopes: every scope), ASCII
/// case-insensitive. Also what its stored responses may be read and deleted under
/// (issue 39: a key whose scopes changed no longer reaches another scope's responses).
pub fn may_use_scope(key: &ClientKey, scope: &str) -> bool {
    key.scopes.is_empty() || key.scopes.iter().any(|s| s.eq_ignore_ascii_case(scope))
}

/// Whether `key` may call `scope` for `model` (the name the client asked for, alias or
/// scope name). Revocation first, then scopes, then models.
pub fn check_access(key: &ClientKey, scope: &str, model: &str) -> Result<(), KeyDenial> {
    if key.revoked_at_ms.is_some() {
        return Err(KeyDenial::Revoked);
    }
    // ASCII case-insensitive, as the proxy resolves a model to its scope.
    let same = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    if !may_use_scope(key, scope) {
        return Err(KeyDenial::Scope(scope.to_string()));
    }
    if !key.models.is_empty() && !key.models.iter().any(|m| same(m, model) || same(m, scope)) {
        return Err(KeyDenial::Model(model.to_string()));
    }
    Ok(())
}

/// The shape of a client key: `pgw-` and 43 characters of URL-safe base64 (256 random
/// bits). Whether `text` has it (a malformed key is refused without a lookup).
pub fn looks_like_key(text: &str) -> bool {
    text.strip_prefix(KEY_PREFIX).is_some_and(|rest| {
        rest.len() == KEY_BODY_CHARS
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// What every client key starts with.
pub const KEY_PREFIX: &str = "pgw-";

/// Characters after the prefix (256 bits in unpadded URL-safe base64).
pub const KEY_BODY_CHARS: usize = 43;

/// Characters of a key kept as its `prefix` (the marker and 6 of the body: 36 bits, not
/// enough to help a guess).
pub const SHOWN_PREFIX_CHARS: usize = KEY_PREFIX.len() + 6;

/// The `prefix` kept of a key.
pub fn shown_prefix(key: &str) -> String {
    key.chars().take(SHOWN_PREFIX_CHARS).collect()
}

/// What the store keeps of a key: its SHA-256, lowercase hex. A key has 256 random bits,
/// so a plain hash is as strong as a slow one (nothing to guess by brute force) and a
/// lookup by hash leaks nothing about the key.
pub fn hash_key(key: &str) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(key.trim().as_bytes());
    let mut out = String::with_capacity(64);
    for b in d {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> ClientKey {
        ClientKey {
            id: "key_1".into(),
            name: "batch".into(),
            hash: "00".into(),
            prefix: "pgw-abcdef".into(),
            scopes: vec![],
            models: vec![],
            limits: KeyLimits::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            revoked_at_ms: None,
        }
    }

    #[test]
    fn budgets_read_exactly() {
        assert_eq!(
            parse_budget("25/day"),
            Ok((BudgetPeriod::Day, 25 * NANOS_PER_UNIT))
        );
        assert_eq!(
            parse_budget(" 100.5/month "),
            Ok((BudgetPeriod::Month, 100_500_000_000))
        );
        assert_eq!(parse_budget("0.000000001/d"), Ok((BudgetPeriod::Day, 1)));
        assert_eq!(
            parse_budget("1/MONTH"),
            Ok((BudgetPeriod::Month, NANOS_PER_UNIT))
        );
        for bad in [
            "25",
            "25/week",
            "/day",
            "-1/day",
            "1e3/day",
            "1./day",
            ".5/day",
            "1.0000000001/day",
            "9000001/day",
            "99999999999999999999/day",
            "a/day",
        ] {
            let e = parse_budget(bad).unwrap_err();
            assert!(e.contains(bad.trim()), "{bad}: {e}");
        }
        assert_eq!(parse_amount("9000000"), Ok(MAX_BUDGET_NANOS));
    }

    #[test]
    fn nanos_format_without_trailing_zeros() {
        assert_eq!(format_nanos(0), "0");
        assert_eq!(format_nanos(25 * NANOS_PER_UNIT), "25");
        assert_eq!(format_nanos(500_000_000), "0.5");
        assert_eq!(format_nanos(27), "0.000000027");
    }

    proptest! {
        /// Formatting then reading gives the nanos back.
        #[test]
        fn amounts_round_trip(n in 0..=MAX_BUDGET_NANOS) {
            prop_assert_eq!(parse_amount(&format_nanos(n)), Ok(n));
        }
    }

    #[test]
    fn access_checks_revocation_scope_and_model() {
        let mut k = key();
        assert_eq!(check_access(&k, "LLM", "gpt"), Ok(()));
        k.scopes = vec!["LLM".into()];
        assert_eq!(check_access(&k, "LLM", "gpt"), Ok(()));
        assert_eq!(
            check_access(&k, "EMB", "e"),
            Err(KeyDenial::Scope("EMB".into()))
        );
        k.models = vec!["gpt".into()];
        assert_eq!(check_access(&k, "LLM", "gpt"), Ok(()));
        assert_eq!(
            check_access(&k, "llm", "GPT"),
            Ok(()),
            "names compare as the proxy routes them: ASCII case-insensitive"
        );
        assert_eq!(
            check_access(&k, "LLM", "other"),
            Err(KeyDenial::Model("other".into()))
        );
        k.models = vec!["LLM".into()];
        assert_eq!(
            check_access(&k, "LLM", "any-alias"),
            Ok(()),
            "the scope's name allows its aliases"
        );
        k.revoked_at_ms = Some(1);
        assert_eq!(check_access(&k, "LLM", "gpt"), Err(KeyDenial::Revoked));
        assert!(KeyDenial::Revoked.message("key_1").contains("key_1"));
    }

    #[test]
    fn keys_are_kept_as_sha256() {
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hash_key(" abc\n"), hash_key("abc"), "as presented, trimmed");
    }

    #[test]
    fn key_shape() {
        let k = format!("pgw-{}", "A".repeat(43));
        assert!(looks_like_key(&k));
        assert!(!looks_like_key(&format!("pgw-{}", "A".repeat(42))));
        assert!(!looks_like_key(&format!("sk-{}", "A".repeat(43))));
        assert!(!looks_like_key(&format!("pgw-{}=", "A".repeat(42))));
        assert_eq!(shown_prefix(&k), "pgw-AAAAAA");
        // URL-safe base64 has `-` and `_`.
        let k = format!("pgw-{}-_{}", "a".repeat(20), "9".repeat(21));
        assert!(looks_like_key(&k));
        assert!(!looks_like_key(&format!("pgw-{}+", "a".repeat(42))));
    }

    /// Only the limits that are set limit: an unlimited key needs no governance call.
    #[test]
    fn limits_and_budgets_are_what_is_set() {
        let none = KeyLimits::default();
        assert!(none.is_unlimited() && !none.has_budget());
        let each = [
            KeyLimits { rpm: 1, ..none },
            KeyLimits { tpm: 1, ..none },
            KeyLimits {
                max_concurrency: 1,
                ..none
            },
            KeyLimits {
                budget_day_nanos: Some(0),
                ..none
            },
            KeyLimits {
                budget_month_nanos: Some(5),
                ..none
            },
        ];
        for (i, l) in each.iter().enumerate() {
            assert!(!l.is_unlimited(), "{l:?}");
            assert_eq!(l.has_budget(), i >= 3, "{l:?}");
        }
        assert_eq!(BudgetPeriod::Day.as_str(), "day");
        assert_eq!(BudgetPeriod::Month.as_str(), "month");
    }

    /// What is not a decimal number is named so (not mistaken for a number too big).
    #[test]
    fn an_amount_that_is_no_number_says_so() {
        for bad in ["a", "", ".5", "1.", "1.x", "x.5", "-1"] {
            let e = parse_amount(bad).unwrap_err();
            assert!(e.contains("not a decimal number"), "{bad:?}: {e}");
        }
        assert_eq!(parse_amount("25"), Ok(25 * NANOS_PER_UNIT));
    }
}
