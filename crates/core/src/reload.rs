//! What a configuration reload carries over (SPEC §26.2), as a pure function of the
//! running and the new settings: a source keeps its state (breaker, drain, quotas,
//! latency evidence) while it is the same upstream — same name (so same provider),
//! same API, base URL and model; a source whose upstream changed under its name starts
//! with a closed breaker; a new scope or source starts fresh.

use crate::settings::ScopeSettings;
use crate::source::SourceConfig;

/// What happens to one source of the new settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceFate {
    /// The same upstream as before: its state carries over.
    Kept,
    /// Its name was served before for another upstream (API, base URL or model
    /// changed): its breaker is reset, so the old upstream's failures do not hold the new
    /// one out.
    Changed,
    /// Not served before.
    New,
}

/// One scope's changes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScopeChanges {
    /// Each new source's name and fate, in the new settings' order.
    pub sources: Vec<(String, SourceFate)>,
    /// Sources served before and not now (calls in flight on them finish).
    pub removed: Vec<String>,
    /// Whether anything of the scope's settings differs (a price, a limit, a key, …).
    pub settings_changed: bool,
}

/// Whether two sources are the same upstream.
fn same_upstream(a: &SourceConfig, b: &SourceConfig) -> bool {
    a.api == b.api && a.base_url == b.base_url && a.model == b.model
}

/// What reloading `old` (the running settings of a scope, `None` when the scope is new)
/// into `new` changes.
pub fn scope_changes(old: Option<&ScopeSettings>, new: &ScopeSettings) -> ScopeChanges {
    let before = old.map_or(&[][..], |o| o.sources.as_slice());
    let sources = new
        .sources
        .iter()
        .map(|s| {
            let fate = match before.iter().find(|o| o.name == s.name) {
                Some(o) if same_upstream(o, s) => SourceFate::Kept,
                Some(_) => SourceFate::Changed,
                None => SourceFate::New,
            };
            (s.name.clone(), fate)
        })
        .collect();
    let removed = before
        .iter()
        .filter(|o| !new.sources.iter().any(|s| s.name == o.name))
        .map(|o| o.name.clone())
        .collect();
    ScopeChanges {
        sources,
        removed,
        settings_changed: old != Some(new),
    }
}

impl ScopeChanges {
    /// The sources whose breaker a reload resets.
    pub fn to_reset(&self) -> impl Iterator<Item = &str> {
        self.sources
            .iter()
            .filter(|(_, f)| *f == SourceFate::Changed)
            .map(|(n, _)| n.as_str())
    }

    /// One line for the log: `kept a, b; changed c; new d; removed e` (empty parts left
    /// out; `unchanged` when nothing differs).
    pub fn summary(&self) -> String {
        if !self.settings_changed {
            return "unchanged".into();
        }
        let names = |fate: SourceFate| {
            self.sources
                .iter()
                .filter(|(_, f)| *f == fate)
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
        };
        let mut parts = Vec::new();
        for (label, list) in [
            ("kept", names(SourceFate::Kept)),
            ("upstream changed", names(SourceFate::Changed)),
            ("new", names(SourceFate::New)),
            ("removed", self.removed.iter().map(String::as_str).collect()),
        ] {
            if !list.is_empty() {
                parts.push(format!("{label} {}", list.join(", ")));
            }
        }
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(provider: &str, i: u32, base: &str, model: &str) -> SourceConfig {
        SourceConfig::new(provider, i, base, "sk-x", model)
    }

    fn scope(sources: Vec<SourceConfig>) -> ScopeSettings {
        ScopeSettings::new("LLM", sources)
    }

    #[test]
    fn a_source_keeps_its_state_while_its_upstream_is_the_same() {
        let old = scope(vec![
            src("a", 0, "http://a/v1", "m"),
            src("b", 0, "http://b/v1", "m"),
            src("c", 0, "http://c/v1", "m"),
        ]);
        // a: a new price and key, same upstream; b: another model; c: gone; d: new.
        let mut a = src("a", 0, "http://a/v1", "m").with_prices(1.0, 2.0);
        a.api_key = crate::Secret::new("sk-rotated");
        let new = scope(vec![
            a,
            src("b", 0, "http://b/v1", "m2"),
            src("d", 0, "http://d/v1", "m"),
        ]);
        let c = scope_changes(Some(&old), &new);
        let names: Vec<String> = new.sources.iter().map(|s| s.name.clone()).collect();
        assert_eq!(
            c.sources,
            vec![
                (names[0].clone(), SourceFate::Kept),
                (names[1].clone(), SourceFate::Changed),
                (names[2].clone(), SourceFate::New),
            ]
        );
        assert_eq!(c.removed, vec![old.sources[2].name.clone()]);
        assert!(c.settings_changed);
        assert_eq!(c.to_reset().collect::<Vec<_>>(), [names[1].as_str()]);
        let line = c.summary();
        assert!(line.contains("kept") && line.contains("removed"), "{line}");
        assert!(!line.contains("sk-"), "no key in the log line: {line}");
    }

    #[test]
    fn another_api_is_another_upstream_and_a_new_scope_is_all_new() {
        let old = scope(vec![src("a", 0, "http://a/v1", "m")]);
        let mut new = old.clone();
        new.sources[0].api = crate::source::SourceApi::Messages;
        assert_eq!(
            scope_changes(Some(&old), &new).sources[0].1,
            SourceFate::Changed
        );
        let fresh = scope_changes(None, &old);
        assert!(fresh.sources.iter().all(|(_, f)| *f == SourceFate::New));
        assert!(fresh.settings_changed);
        let same = scope_changes(Some(&old), &old);
        assert!(!same.settings_changed);
        assert_eq!(same.summary(), "unchanged");
        assert_eq!(same.to_reset().count(), 0);
    }
}
