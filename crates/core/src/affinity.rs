//! Prompt-cache affinity (SPEC §20.2), pure: a call's affinity key, and where the source
//! that last served the key goes in the candidate order.
//!
//! A provider's prompt cache lives on the source that saw the prefix: sending a session's
//! next turn to the same source reads it back (cheaper input, faster first token). So a
//! key — the client's `prompt_cache_key`, a session id, the user, or a hash of the system
//! prompt and the first user message — *sticks* to the source that last served it, for
//! `AFFINITY__TTL_S`, **while that source is admissible**. Affinity is only an order: the
//! sticky source is tried first *within its own group* of the normal order (sources not
//! failed in the call, then priority tier), and the engine asks the breaker store and the
//! limiter about it exactly as about any candidate. A refused sticky source (open breaker,
//! cooldown, dead, over a quota) is passed over like any refused candidate, and the pick is
//! the one the normal order gives; the winner's source becomes the key's source (the key
//! moves). Invariants (property-tested below):
//!
//! 1. the pick is admissible, and there is one whenever some candidate is;
//! 2. the affinity order is a permutation of the normal order (no candidate gained or lost);
//! 3. when the sticky source is absent, not a candidate, failed in the call or
//!    inadmissible, the pick is the normal order's pick — affinity never overrides a quota,
//!    a breaker, a cooldown or a failure;
//! 4. the pick is never in a worse group (failed in the call, or a lower-preference
//!    priority tier) than the normal order's pick — affinity never overrides `PRIORITY`;
//! 5. when the sticky source is an admissible candidate and the normal pick is in its group
//!    (or a worse one), the pick is the sticky source.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::request::ChatRequest;
use crate::source::SourceConfig;

/// `{S}__AFFINITY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityMode {
    /// No affinity: every call takes the normal order.
    Off,
    /// A session's calls stick to the source that last served it (the default).
    #[default]
    Session,
}

impl std::str::FromStr for AffinityMode {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(AffinityMode::Off),
            "session" => Ok(AffinityMode::Session),
            _ => Err(()),
        }
    }
}

impl std::fmt::Display for AffinityMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AffinityMode::Off => "off",
            AffinityMode::Session => "session",
        })
    }
}

/// The default `{S}__AFFINITY__TTL_S`: 300 s (OpenAI's and Anthropic's default cache
/// lifetimes are 5 to 10 minutes: a key kept longer points at a cache that is gone).
pub const DEFAULT_AFFINITY_TTL: Duration = Duration::from_secs(300);

/// `{S}__AFFINITY*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AffinitySettings {
    /// `off` or `session`.
    pub mode: AffinityMode,
    /// How long a key sticks to its source after the source last served it.
    #[serde(with = "crate::durations::secs")]
    pub ttl: Duration,
}

impl Default for AffinitySettings {
    fn default() -> Self {
        AffinitySettings {
            mode: AffinityMode::Session,
            ttl: DEFAULT_AFFINITY_TTL,
        }
    }
}

impl AffinitySettings {
    /// Whether a scope of `sources` sources keeps affinity at all: `session`, and more
    /// than one source (with one, every call goes there anyway: no store is asked).
    pub fn applies(&self, sources: usize) -> bool {
        self.mode == AffinityMode::Session && sources > 1
    }
}

/// A call's affinity key as stored: a digest of where it came from (the client's key or
/// the prompt) — 32 hex characters, whatever the client sent, so a store holds one small
/// key per session and never the client's text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityKey(String);

impl AffinityKey {
    /// The key of a client-given value (`prompt_cache_key`, session id, user).
    pub fn given(raw: &str) -> Self {
        Self::digest(b"k", raw.as_bytes())
    }

    fn digest(kind: &[u8], bytes: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(b"polygw-affinity-v1\0");
        h.update(kind);
        h.update(b"\0");
        h.update(bytes);
        AffinityKey(
            h.finalize()[..16]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
        )
    }

    /// The 32 hex characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for AffinityKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a client's explicit affinity key may come from, in the order SPEC §20.2 ranks
/// them: `prompt_cache_key`, then an `x-session-id` / `session_id` header, then
/// `metadata.session_id`, then `user`. Empty values count as absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeySources<'a> {
    /// The client's `prompt_cache_key`.
    pub prompt_cache_key: Option<&'a str>,
    /// An `x-session-id` or `session_id` header (the proxy).
    pub session_header: Option<&'a str>,
    /// `metadata.session_id`.
    pub metadata_session: Option<&'a str>,
    /// `user` (Anthropic's `metadata.user_id` too).
    pub user: Option<&'a str>,
}

impl<'a> KeySources<'a> {
    /// The sources a chat-completions body carries (in `overlay`: every field polygw does
    /// not read itself): `prompt_cache_key`, `metadata.session_id`, `user`.
    pub fn of_request(req: &'a ChatRequest) -> Self {
        let o = req.overlay.as_ref();
        let s = |k: &str| o.and_then(|o| o.get(k)).and_then(Value::as_str);
        KeySources {
            prompt_cache_key: s("prompt_cache_key"),
            session_header: None,
            metadata_session: o
                .and_then(|o| o.get("metadata"))
                .and_then(|m| m.get("session_id"))
                .and_then(Value::as_str),
            user: s("user"),
        }
    }

    /// The first non-empty source in SPEC §20.2's order.
    pub fn explicit(&self) -> Option<&'a str> {
        [
            self.prompt_cache_key,
            self.session_header,
            self.metadata_session,
            self.user,
        ]
        .into_iter()
        .flatten()
        .find(|s| !s.trim().is_empty())
    }
}

/// The key of a conversation without an explicit one: a digest of its system prompt
/// (every `system` / `developer` message before the first `user` message) and its first
/// `user` message — what stays the same over the turns of a session. `None` when the
/// request has neither.
pub fn prompt_key(req: &ChatRequest) -> Option<AffinityKey> {
    let mut canon = String::new();
    let mut any = false;
    for m in &req.messages {
        let role = m.role.as_str();
        if role == "system" || role == "developer" || role == "user" {
            canon.push_str(role);
            canon.push('\0');
            if let Some(c) = &m.content {
                crate::cache_key::canonical_json(c, &mut canon);
            }
            canon.push('\0');
            any = true;
            if role == "user" {
                break;
            }
        }
    }
    any.then(|| AffinityKey::digest(b"p", canon.as_bytes()))
}

/// A call's affinity key: the one the caller gives (`CallOptions::affinity_key`: the
/// proxy passes what the request and its headers carry), else the request's own explicit
/// sources ([`KeySources::of_request`]), else [`prompt_key`].
pub fn call_key(given: Option<&str>, req: &ChatRequest) -> Option<AffinityKey> {
    given
        .filter(|g| !g.trim().is_empty())
        .or_else(|| KeySources::of_request(req).explicit())
        .map(AffinityKey::given)
        .or_else(|| prompt_key(req))
}

/// The group of a candidate in the normal order ([`crate::admission::order_candidates`]):
/// failed in the call or not, then priority tier. Lower is preferred.
fn group(sources: &[SourceConfig], failed: &BTreeSet<String>, i: usize) -> (bool, u32) {
    (failed.contains(&sources[i].name), sources[i].priority)
}

/// The candidate order with affinity: `order` (the normal order, over the preferred-only
/// case of [`crate::admission::order_candidates`]) with `sticky` moved to the front of its
/// own group — before the other sources of its priority tier, never before a better tier.
/// Unchanged when `sticky` is none, not in `order`, or failed in this call (a retry round
/// prefers the others, SPEC §4.1).
pub fn affinity_order(
    mut order: Vec<usize>,
    sources: &[SourceConfig],
    failed_in_call: &BTreeSet<String>,
    sticky: Option<usize>,
) -> Vec<usize> {
    let Some(s) = sticky else { return order };
    let Some(at) = order.iter().position(|&i| i == s) else {
        return order;
    };
    if s >= sources.len() || failed_in_call.contains(&sources[s].name) {
        return order;
    }
    let g = group(sources, failed_in_call, s);
    // Groups are contiguous in the normal order: the first member of the sticky source's.
    let front = order[..at]
        .iter()
        .position(|&i| group(sources, failed_in_call, i) == g)
        .unwrap_or(at);
    order[front..=at].rotate_right(1);
    order
}

/// The pick, as the engine makes it: the first candidate of the affinity order that is
/// admissible (the engine asks the breaker store, then the limiter, in this order and
/// stops at the first admission). The reference model the invariants are stated on.
pub fn choose(
    order: Vec<usize>,
    sources: &[SourceConfig],
    failed_in_call: &BTreeSet<String>,
    sticky: Option<usize>,
    admissible: &dyn Fn(usize) -> bool,
) -> Option<usize> {
    affinity_order(order, sources, failed_in_call, sticky)
        .into_iter()
        .find(|&i| admissible(i))
}

/// What affinity did for a call that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityOutcome {
    /// The key's source served it again.
    Hit,
    /// The key had no source (new, or expired): the normal order served it.
    Miss,
    /// The key had a source, another one served it (the first was refused or failed, or
    /// a hedge leg won): the key moved.
    Moved,
}

impl AffinityOutcome {
    /// Every outcome, in the order metrics list them.
    pub const ALL: [AffinityOutcome; 3] = [
        AffinityOutcome::Hit,
        AffinityOutcome::Miss,
        AffinityOutcome::Moved,
    ];

    /// `hit`, `miss`, `moved`.
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityOutcome::Hit => "hit",
            AffinityOutcome::Miss => "miss",
            AffinityOutcome::Moved => "moved",
        }
    }

    /// The outcome of a call whose key had `stored` as its source and `winner` served.
    pub fn of(stored: Option<&str>, winner: &str) -> Self {
        match stored {
            None => AffinityOutcome::Miss,
            Some(s) if s == winner => AffinityOutcome::Hit,
            Some(_) => AffinityOutcome::Moved,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::order_candidates;
    use crate::ports::SplitMix64;
    use crate::request::Message;
    use crate::secret::Secret;
    use proptest::prelude::*;
    use serde_json::json;

    fn src(i: usize, priority: u32, weight: u32) -> SourceConfig {
        let mut s = SourceConfig::new("p", i as u32, "http://x/v1", Secret::new("k"), "m");
        s.priority = priority;
        s.weight = weight;
        s
    }

    fn names(sources: &[SourceConfig], set: &[usize]) -> BTreeSet<String> {
        set.iter().map(|&i| sources[i].name.clone()).collect()
    }

    #[test]
    fn modes_parse_and_default_to_session() {
        assert_eq!("off".parse::<AffinityMode>(), Ok(AffinityMode::Off));
        assert_eq!(
            " Session ".parse::<AffinityMode>(),
            Ok(AffinityMode::Session)
        );
        assert!("sticky".parse::<AffinityMode>().is_err());
        let d = AffinitySettings::default();
        assert_eq!(
            (d.mode, d.ttl),
            (AffinityMode::Session, Duration::from_secs(300))
        );
        assert!(d.applies(2) && !d.applies(1));
        let off = AffinitySettings {
            mode: AffinityMode::Off,
            ..d
        };
        assert!(!off.applies(3));
    }

    #[test]
    fn key_sources_rank_as_the_spec_says() {
        let all = KeySources {
            prompt_cache_key: Some("pck"),
            session_header: Some("hdr"),
            metadata_session: Some("meta"),
            user: Some("u"),
        };
        assert_eq!(all.explicit(), Some("pck"));
        let no_pck = KeySources {
            prompt_cache_key: Some(" "),
            ..all
        };
        assert_eq!(no_pck.explicit(), Some("hdr"));
        let meta = KeySources {
            prompt_cache_key: None,
            session_header: None,
            ..all
        };
        assert_eq!(meta.explicit(), Some("meta"));
        let user = KeySources {
            user: Some("u"),
            ..KeySources::default()
        };
        assert_eq!(user.explicit(), Some("u"));
        assert_eq!(KeySources::default().explicit(), None);
    }

    #[test]
    fn a_chat_body_carries_its_key_sources_in_the_overlay() {
        let mut r = ChatRequest::user("hi");
        r.overlay = Some(
            json!({"user": "u1", "metadata": {"session_id": "s1"}, "prompt_cache_key": "p1"})
                .as_object()
                .unwrap()
                .clone(),
        );
        let k = KeySources::of_request(&r);
        assert_eq!(
            (k.prompt_cache_key, k.metadata_session, k.user),
            (Some("p1"), Some("s1"), Some("u1"))
        );
        assert_eq!(call_key(None, &r), Some(AffinityKey::given("p1")));
        // What the caller gives wins (the proxy ranked the headers in already).
        assert_eq!(call_key(Some("g"), &r), Some(AffinityKey::given("g")));
        assert_eq!(call_key(Some(""), &r), Some(AffinityKey::given("p1")));
    }

    #[test]
    fn the_prompt_key_is_the_system_prompt_and_the_first_user_message() {
        let turn1 = ChatRequest::new(vec![Message::system("sys"), Message::user("q1")]);
        let turn2 = ChatRequest::new(vec![
            Message::system("sys"),
            Message::user("q1"),
            Message::assistant("a1"),
            Message::user("q2"),
        ]);
        let other = ChatRequest::new(vec![Message::system("sys"), Message::user("q9")]);
        let k1 = call_key(None, &turn1).unwrap();
        assert_eq!(Some(&k1), call_key(None, &turn2).as_ref(), "one session");
        assert_ne!(Some(&k1), call_key(None, &other).as_ref());
        assert_eq!(k1.as_str().len(), 32);
        assert!(k1.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        // A client key never equals a prompt digest of the same text.
        assert_ne!(AffinityKey::given("sys"), k1);
        // Nothing to key on.
        let none = ChatRequest::new(vec![Message::assistant("a")]);
        assert_eq!(call_key(None, &none), None);
        // The system and developer prompts are part of the key; a conversation that
        // has only one of them is keyed on it.
        let other_sys = ChatRequest::new(vec![Message::system("sys 2"), Message::user("q1")]);
        assert_ne!(Some(&k1), call_key(None, &other_sys).as_ref());
        let dev =
            |t: &str| ChatRequest::new(vec![Message::new("developer", t), Message::user("q1")]);
        assert_ne!(call_key(None, &dev("d1")), call_key(None, &dev("d2")));
        let only_sys = ChatRequest::new(vec![Message::system("sys")]);
        assert!(call_key(None, &only_sys).is_some());
        // The keys and modes print as they are written.
        assert_eq!(k1.to_string(), k1.as_str());
        assert_eq!(AffinityMode::Session.to_string(), "session");
        assert_eq!(AffinityMode::Off.to_string(), "off");
    }

    #[test]
    fn the_sticky_source_leads_its_tier_only() {
        // Tier 0: 0, 1; tier 1: 2, 3.
        let s = vec![src(0, 0, 1), src(1, 0, 1), src(2, 1, 1), src(3, 1, 1)];
        let none = BTreeSet::new();
        assert_eq!(
            affinity_order(vec![0, 1, 2, 3], &s, &none, Some(1)),
            [1, 0, 2, 3]
        );
        assert_eq!(
            affinity_order(vec![1, 0, 3, 2], &s, &none, Some(2)),
            [1, 0, 2, 3]
        );
        assert_eq!(
            affinity_order(vec![0, 1, 2, 3], &s, &none, None),
            [0, 1, 2, 3]
        );
        // Not a candidate (excluded): unchanged.
        assert_eq!(affinity_order(vec![0, 2, 3], &s, &none, Some(1)), [0, 2, 3]);
        // Failed in the call: unchanged (the others first).
        let failed = names(&s, &[1]);
        assert_eq!(
            affinity_order(vec![0, 2, 3, 1], &s, &failed, Some(1)),
            [0, 2, 3, 1]
        );
        // A refused sticky source is passed over: the normal pick.
        let pick = choose(vec![0, 1, 2, 3], &s, &none, Some(1), &|i| i != 1);
        assert_eq!(pick, Some(0));
    }

    #[test]
    fn outcomes() {
        assert_eq!(AffinityOutcome::of(None, "a"), AffinityOutcome::Miss);
        assert_eq!(AffinityOutcome::of(Some("a"), "a"), AffinityOutcome::Hit);
        assert_eq!(AffinityOutcome::of(Some("b"), "a"), AffinityOutcome::Moved);
        let names: Vec<&str> = AffinityOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(names, ["hit", "miss", "moved"]);
    }

    /// A scope, the call's exclusions and failures, the sticky source and which
    /// candidates the breaker store and the limiter would admit.
    #[derive(Debug, Clone)]
    struct Case {
        sources: Vec<SourceConfig>,
        excluded: Vec<usize>,
        failed: Vec<usize>,
        sticky: Option<usize>,
        admissible: Vec<bool>,
        seed: u64,
    }

    fn case() -> impl Strategy<Value = Case> {
        (1usize..7)
            .prop_flat_map(|n| {
                (
                    prop::collection::vec((0u32..3, 1u32..4), n),
                    prop::collection::vec(any::<bool>(), n),
                    prop::collection::vec(any::<bool>(), n),
                    prop::option::of(0..n + 1),
                    prop::collection::vec(any::<bool>(), n),
                    any::<u64>(),
                )
            })
            .prop_map(|(shape, excl, fail, sticky, admissible, seed)| {
                let sources: Vec<SourceConfig> = shape
                    .iter()
                    .enumerate()
                    .map(|(i, &(p, w))| src(i, p, w))
                    .collect();
                let pick = |v: &[bool]| {
                    v.iter()
                        .enumerate()
                        .filter(|(_, b)| **b)
                        .map(|(i, _)| i)
                        .collect()
                };
                Case {
                    excluded: pick(&excl),
                    failed: pick(&fail),
                    // `n` itself: a source the scope no longer has (configuration changed).
                    sticky,
                    admissible,
                    sources,
                    seed,
                }
            })
    }

    impl Case {
        fn order(&self) -> Vec<usize> {
            order_candidates(
                &self.sources,
                &names(&self.sources, &self.excluded),
                &names(&self.sources, &self.failed),
                &SplitMix64::new(self.seed),
            )
        }
        fn failed(&self) -> BTreeSet<String> {
            names(&self.sources, &self.failed)
        }
        fn admissible(&self) -> impl Fn(usize) -> bool + '_ {
            |i| self.admissible[i]
        }
        fn group(&self, i: usize) -> (bool, u32) {
            group(&self.sources, &self.failed(), i)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Invariants 1–5 of the module documentation.
        #[test]
        fn affinity_never_overrides_admission_priority_or_failures(c in case()) {
            let order = c.order();
            let failed = c.failed();
            let adm = c.admissible();
            let base = order.iter().copied().find(|&i| adm(i));
            let with = affinity_order(order.clone(), &c.sources, &failed, c.sticky);
            let pick = choose(order.clone(), &c.sources, &failed, c.sticky, &adm);

            // 2. A permutation of the normal order.
            let (mut a, mut b) = (order.clone(), with.clone());
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);

            // 1. Admissible, and found whenever some candidate is.
            prop_assert_eq!(pick.is_some(), base.is_some());
            if let Some(p) = pick {
                prop_assert!(adm(p), "picked an inadmissible source {}", p);
            }

            let sticky_live = c.sticky.filter(|&s| {
                order.contains(&s) && !failed.contains(&c.sources[s].name) && adm(s)
            });
            match sticky_live {
                // 3. Without a live sticky source, the normal pick.
                None => prop_assert_eq!(pick, base),
                Some(s) => {
                    let base = base.expect("the sticky source is admissible");
                    // 4. Never a worse group than the normal pick.
                    prop_assert_eq!(c.group(pick.unwrap()), c.group(base));
                    // 5. The sticky source whenever the normal pick is in its group.
                    if c.group(base) >= c.group(s) {
                        prop_assert_eq!(pick, Some(s));
                    } else {
                        prop_assert_eq!(pick, Some(base));
                    }
                }
            }
        }
    }
}
