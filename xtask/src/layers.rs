//! `cargo xtask check-layers`: the architecture's dependency rules (SPEC §1), checked on
//! `cargo metadata`.
//!
//! 1. Every workspace crate has a layer; an unclassified crate is an error.
//! 2. Workspace edges follow the direction core ← adapters ← facade ← server ← binary
//!    (the server, `polygw-serve`, is the proxy as a library: it sees only the facade); no
//!    adapter depends on another adapter; the simulator and test support are only
//!    used where SPEC §1 allows; the top-level `tests/` package may use anything and
//!    nothing uses it.
//! 3. polygw-core's transitive normal dependencies stay inside an allow-list (no tokio
//!    net/fs/process, reqwest, hyper, redis, sqlx, axum), and the list has no stale
//!    entries.
//! 4. The I/O crates are direct dependencies only of their adapter (the same "wrappers"
//!    rule as deny.toml, enforced here so CI needs no extra tool).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// The layers of SPEC §1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layer {
    Core,
    Adapter,
    Facade,
    /// The wire formats clients speak (`polygw-dialects`): pure conversions between the
    /// APIs' requests, answers and events and core's types; on core only, used by the
    /// server and the suites.
    Dialect,
    /// The OpenAI-compatible proxy as a library (`polygw-serve`): on the facade and
    /// the dialects (core types through the facade's re-exports), used by the binary
    /// and the suites.
    Server,
    Binary,
    Simulator,
    Tooling,
    TestSupport,
    /// The top-level `tests/` package: cross-crate suites (SPEC §1: tests may depend on
    /// anything; nothing depends on them).
    Tests,
}

/// Layer of a workspace crate, by name.
pub fn layer_of(name: &str) -> Option<Layer> {
    Some(match name {
        "polygw-core" => Layer::Core,
        "polygw-transport-openai"
        | "polygw-limiter-memory"
        | "polygw-limiter-redis"
        | "polygw-telemetry-sql"
        | "polygw-otel" => Layer::Adapter,
        "polygw" => Layer::Facade,
        "polygw-dialects" => Layer::Dialect,
        "polygw-serve" => Layer::Server,
        "polygw-cli" => Layer::Binary,
        "polygw-mock-upstream" => Layer::Simulator,
        "xtask" => Layer::Tooling,
        "polygw-testkit" | "polygw-heap-meter" => Layer::TestSupport,
        "polygw-tests" => Layer::Tests,
        _ => return None,
    })
}

/// Dependency kind of an edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Normal,
    Dev,
    Build,
}

/// Whether `from` may depend on `to` with this kind.
pub fn edge_allowed(from: Layer, to: Layer, kind: Kind) -> bool {
    use Layer::*;
    if to == TestSupport && kind != Kind::Dev {
        return false; // test support is only ever a dev-dependency
    }
    if to == Tests {
        return false; // the suites are a leaf: nothing depends on them
    }
    match (from, kind) {
        (Tests, _) => to != Tooling,
        (Core, _) => false,
        (Tooling, _) => false,
        (Adapter, Kind::Dev) => matches!(to, Core | TestSupport | Simulator),
        (Adapter, _) => to == Core,
        (Simulator, Kind::Dev) => matches!(to, Core | TestSupport),
        (Simulator, _) => to == Core,
        (TestSupport, _) => matches!(to, Core | Simulator),
        (Facade, Kind::Dev) => matches!(to, Core | Adapter | TestSupport | Simulator),
        (Facade, _) => matches!(to, Core | Adapter),
        (Dialect, Kind::Dev) => matches!(to, Core | TestSupport),
        (Dialect, _) => to == Core,
        (Server, Kind::Dev) => matches!(to, Facade | Dialect | TestSupport | Simulator),
        (Server, _) => matches!(to, Facade | Dialect),
        (Binary, Kind::Dev) => to != Tooling && to != Binary,
        (Binary, _) => matches!(to, Server | Facade | Core | Simulator),
    }
}

/// Crates polygw-core may pull in (transitively, normal edges, this host).
pub const CORE_ALLOW: &[&str] = &[
    "async-trait",
    "block-buffer",
    "byteorder",
    "cfg-if",
    "cpufeatures",
    "crypto-common",
    "digest",
    "displaydoc",
    "form_urlencoded",
    "generic-array",
    "hdrhistogram",
    "icu_collections",
    "icu_locale_core",
    "icu_normalizer",
    "icu_normalizer_data",
    "icu_properties",
    "icu_properties_data",
    "icu_provider",
    "idna",
    "idna_adapter",
    "itoa",
    "litemap",
    "memchr",
    "num-traits",
    "once_cell",
    "percent-encoding",
    "pin-project-lite",
    "potential_utf",
    "proc-macro2",
    "quote",
    "serde",
    "serde_core",
    "serde_derive",
    "serde_json",
    "sha2",
    "smallvec",
    "stable_deref_trait",
    "syn",
    "synstructure",
    "thiserror",
    "thiserror-impl",
    "tinystr",
    "tracing",
    "tracing-core",
    "typenum",
    "unicode-ident",
    "url",
    "utf8_iter",
    "utf_types",
    "writeable",
    "yoke",
    "yoke-derive",
    "zerofrom",
    "zerofrom-derive",
    "zerotrie",
    "zerovec",
    "zerovec-derive",
    "zmij",
];

/// Crates core must never reach, whatever the allow-list says.
pub const CORE_BANNED: &[&str] = &[
    "reqwest",
    "hyper",
    "hyper-util",
    "redis",
    "sqlx",
    "sqlx-core",
    "axum",
    "mio",
    "socket2",
];

/// tokio features core must never enable (if tokio ever enters core).
pub const TOKIO_BANNED_FEATURES: &[&str] = &["net", "fs", "process"];

/// I/O crates and the only workspace crates that may depend on them directly
/// (normal or build edges; tests may use anything).
pub const WRAPPERS: &[(&str, &[&str])] = &[
    // The OTLP exporter's HTTP client is the workspace's reqwest (one TLS stack).
    ("reqwest", &["polygw-transport-openai", "polygw-otel"]),
    ("opentelemetry-otlp", &["polygw-otel"]),
    ("opentelemetry_sdk", &["polygw-otel"]),
    ("redis", &["polygw-limiter-redis"]),
    ("sqlx", &["polygw-telemetry-sql"]),
    ("axum", &["polygw-serve", "polygw-mock-upstream"]),
    ("hyper", &["polygw-serve", "polygw-mock-upstream"]),
];

/// One rule broken.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Violation(pub String);

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

struct Pkg {
    name: String,
    id: String,
    workspace: bool,
}

fn kind_of(v: &Value) -> Kind {
    match v.get("kind").and_then(Value::as_str) {
        Some("dev") => Kind::Dev,
        Some("build") => Kind::Build,
        _ => Kind::Normal,
    }
}

/// Checks a `cargo metadata --format-version 1` document.
///
/// `core_alone` is polygw-core's dependency set when built alone (`cargo tree -p
/// polygw-core -e normal`): the metadata's resolve unifies features over the whole
/// workspace (sqlx turns on `tracing/log`, `sha2/oid`, …), which says nothing about what
/// core itself needs, so the allow-list is checked on `core_alone` when given. Banned
/// crates are checked on both.
pub fn check(meta: &Value, core_alone: Option<&BTreeSet<String>>) -> Vec<Violation> {
    let mut out = BTreeSet::new();
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let pkgs: Vec<Pkg> = meta["packages"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| Pkg {
                    name: p["name"].as_str().unwrap_or_default().to_string(),
                    id: p["id"].as_str().unwrap_or_default().to_string(),
                    workspace: members.contains(p["id"].as_str().unwrap_or_default()),
                })
                .collect()
        })
        .unwrap_or_default();
    let name_of: BTreeMap<&str, &str> = pkgs
        .iter()
        .map(|p| (p.id.as_str(), p.name.as_str()))
        .collect();
    let ws_names: BTreeSet<&str> = pkgs
        .iter()
        .filter(|p| p.workspace)
        .map(|p| p.name.as_str())
        .collect();

    // 1. classification
    for p in pkgs.iter().filter(|p| p.workspace) {
        if layer_of(&p.name).is_none() {
            out.insert(Violation(format!(
                "crate `{}` has no layer: classify it in xtask/src/layers.rs (core / adapter / facade / server / binary / simulator / tooling / test-support)",
                p.name
            )));
        }
    }

    // 2 + 4: declared dependencies of workspace crates.
    for p in meta["packages"].as_array().into_iter().flatten() {
        let from = p["name"].as_str().unwrap_or_default();
        if !ws_names.contains(from) {
            continue;
        }
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let to = d["name"].as_str().unwrap_or_default();
            let kind = kind_of(d);
            if ws_names.contains(to) {
                if let (Some(fl), Some(tl)) = (layer_of(from), layer_of(to)) {
                    if !edge_allowed(fl, tl, kind) {
                        out.insert(Violation(format!(
                            "forbidden edge: {from} ({fl:?}) -> {to} ({tl:?}) as a {kind:?} dependency (SPEC §1)"
                        )));
                    }
                    if fl == Layer::Adapter && tl == Layer::Adapter {
                        out.insert(Violation(format!(
                            "forbidden edge: adapter {from} -> adapter {to}: adapters know only core"
                        )));
                    }
                }
            }
            if kind != Kind::Dev {
                if let Some((_, allowed)) = WRAPPERS.iter().find(|(c, _)| *c == to) {
                    if !allowed.contains(&from) {
                        out.insert(Violation(format!(
                            "{from} depends on `{to}` directly; only {allowed:?} may (deny.toml wrappers)"
                        )));
                    }
                }
            }
        }
    }

    // 3. core's transitive normal dependencies.
    let Some(core) = pkgs.iter().find(|p| p.name == "polygw-core" && p.workspace) else {
        out.insert(Violation("polygw-core is not in the workspace".into()));
        return out.into_iter().collect();
    };
    let nodes: BTreeMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| Some((n["id"].as_str()?, n)))
                .collect()
        })
        .unwrap_or_default();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut stack = vec![core.id.as_str()];
    while let Some(id) = stack.pop() {
        let Some(node) = nodes.get(id) else { continue };
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .map(|ks| ks.iter().any(|k| k["kind"].is_null()))
                .unwrap_or(true);
            if !normal {
                continue;
            }
            if let Some(did) = dep["pkg"].as_str() {
                if seen.insert(did) {
                    stack.push(did);
                }
            }
        }
    }
    let unified: BTreeSet<&str> = seen
        .iter()
        .filter_map(|id| name_of.get(id).copied())
        .collect();
    let reached: BTreeSet<&str> = match core_alone {
        Some(alone) => alone.iter().map(String::as_str).collect(),
        None => unified.clone(),
    };
    for name in unified.union(&reached) {
        if ws_names.contains(name) {
            out.insert(Violation(format!(
                "polygw-core depends on workspace crate {name}"
            )));
        } else if CORE_BANNED.contains(name) {
            out.insert(Violation(format!(
                "polygw-core reaches the I/O crate `{name}`: core is pure (SPEC §1)"
            )));
        } else if *name == "tokio" {
            let feats = seen
                .iter()
                .find(|id| name_of.get(*id) == Some(&"tokio"))
                .and_then(|id| nodes.get(id))
                .and_then(|n| n["features"].as_array())
                .map(|f| f.iter().filter_map(Value::as_str).collect::<Vec<_>>())
                .unwrap_or_default();
            for f in TOKIO_BANNED_FEATURES {
                if feats.contains(f) {
                    out.insert(Violation(format!(
                        "polygw-core reaches tokio with feature `{f}`: core does no I/O"
                    )));
                }
            }
        }
    }
    for name in &reached {
        if !ws_names.contains(name) && !CORE_BANNED.contains(name) && !CORE_ALLOW.contains(name) {
            out.insert(Violation(format!(
                "polygw-core reaches `{name}`, which is not in the allow-list (xtask/src/layers.rs CORE_ALLOW); review it and add it if it does no I/O"
            )));
        }
    }
    for allowed in CORE_ALLOW {
        if !reached.contains(allowed) {
            out.insert(Violation(format!(
                "stale allow-list entry `{allowed}`: polygw-core no longer reaches it; remove it from CORE_ALLOW"
            )));
        }
    }
    out.into_iter().collect()
}

/// polygw-core's normal dependencies when built alone (`cargo tree`).
pub fn core_alone() -> Result<BTreeSet<String>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("xtask has no parent dir")?
        .join("Cargo.toml");
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "-p",
            "polygw-core",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-f",
            "{p}",
            "--manifest-path",
        ])
        .arg(&root)
        .output()
        .map_err(|e| format!("cargo tree: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "polygw-core")
        .map(str::to_string)
        .collect())
}

/// Runs `cargo metadata` for this workspace (host platform only).
pub fn workspace_metadata() -> Result<Value, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let host = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| format!("rustc -vV: {e}"))?;
    let host = String::from_utf8_lossy(&host.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or("rustc -vV printed no host")?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("xtask has no parent dir")?
        .join("Cargo.toml");
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--filter-platform",
            &host,
            "--manifest-path",
        ])
        .arg(&root)
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The real tree passes.
    #[test]
    fn workspace_respects_the_layers() {
        let meta = workspace_metadata().expect("cargo metadata");
        let alone = core_alone().expect("cargo tree");
        let v = check(&meta, Some(&alone));
        assert!(
            v.is_empty(),
            "layer violations:\n{}",
            v.iter()
                .map(|v| v.0.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    fn pkg(name: &str, deps: &[(&str, Option<&str>)]) -> Value {
        json!({
            "name": name,
            "id": format!("{name} 0.1.0"),
            "dependencies": deps.iter().map(|(d, k)| json!({"name": d, "kind": k})).collect::<Vec<_>>(),
        })
    }

    fn synthetic(packages: Vec<Value>, members: &[&str], nodes: Vec<Value>) -> Value {
        json!({
            "packages": packages,
            "workspace_members": members.iter().map(|m| format!("{m} 0.1.0")).collect::<Vec<_>>(),
            "resolve": {"nodes": nodes},
        })
    }

    fn node(name: &str, deps: &[&str]) -> Value {
        json!({
            "id": format!("{name} 0.1.0"),
            "deps": deps.iter().map(|d| json!({"pkg": format!("{d} 0.1.0"), "dep_kinds": [{"kind": null}]})).collect::<Vec<_>>(),
            "features": [],
        })
    }

    fn texts(v: &[Violation]) -> String {
        v.iter().map(|v| v.0.clone()).collect::<Vec<_>>().join("\n")
    }

    #[test]
    fn forbidden_edges_are_reported() {
        let meta = synthetic(
            vec![
                pkg("polygw-core", &[("reqwest", None)]),
                pkg(
                    "polygw-limiter-redis",
                    &[("polygw-core", None), ("polygw-telemetry-sql", None)],
                ),
                pkg("polygw-telemetry-sql", &[("polygw-core", None)]),
                pkg("polygw-mock-upstream", &[("polygw", None)]),
                pkg("polygw", &[("polygw-core", None), ("polygw-testkit", None)]),
                pkg("polygw-testkit", &[("polygw-core", None)]),
                pkg("mystery", &[]),
                pkg("reqwest", &[]),
            ],
            &[
                "polygw-core",
                "polygw-limiter-redis",
                "polygw-telemetry-sql",
                "polygw-mock-upstream",
                "polygw",
                "polygw-testkit",
                "mystery",
            ],
            vec![node("polygw-core", &["reqwest"]), node("reqwest", &[])],
        );
        let t = texts(&check(&meta, None));
        assert!(
            t.contains("adapter polygw-limiter-redis -> adapter polygw-telemetry-sql"),
            "{t}"
        );
        assert!(
            t.contains("polygw-mock-upstream (Simulator) -> polygw (Facade)"),
            "{t}"
        );
        assert!(
            t.contains("polygw (Facade) -> polygw-testkit (TestSupport) as a Normal"),
            "{t}"
        );
        assert!(t.contains("crate `mystery` has no layer"), "{t}");
        assert!(
            t.contains("polygw-core reaches the I/O crate `reqwest`"),
            "{t}"
        );
        assert!(
            t.contains("polygw-core depends on workspace crate") || t.contains("forbidden edge"),
            "{t}"
        );
        assert!(t.contains("stale allow-list entry"), "{t}");
        assert!(
            t.contains("only [\"polygw-transport-openai\", \"polygw-otel\"] may"),
            "{t}"
        );
    }

    #[test]
    fn tokio_with_io_features_in_core_is_reported() {
        let mut tokio = node("tokio", &[]);
        tokio["features"] = json!(["rt", "net"]);
        let meta = synthetic(
            vec![pkg("polygw-core", &[("tokio", None)]), pkg("tokio", &[])],
            &["polygw-core"],
            vec![node("polygw-core", &["tokio"]), tokio],
        );
        let t = texts(&check(&meta, None));
        assert!(t.contains("tokio with feature `net`"), "{t}");
    }

    #[test]
    fn allowed_edges_pass() {
        use Layer::*;
        assert!(edge_allowed(Adapter, Core, Kind::Normal));
        assert!(edge_allowed(Facade, Adapter, Kind::Normal));
        assert!(edge_allowed(Binary, Simulator, Kind::Normal));
        assert!(edge_allowed(Adapter, Simulator, Kind::Dev));
        assert!(edge_allowed(Facade, TestSupport, Kind::Dev));
        assert!(!edge_allowed(Facade, TestSupport, Kind::Normal));
        assert!(!edge_allowed(Facade, Simulator, Kind::Normal));
        assert!(!edge_allowed(Adapter, Facade, Kind::Normal));
        assert!(!edge_allowed(Core, Core, Kind::Dev));
        assert!(!edge_allowed(Tooling, Core, Kind::Normal));
        assert!(edge_allowed(Tests, Binary, Kind::Normal));
        assert!(edge_allowed(Tests, Adapter, Kind::Dev));
        assert!(!edge_allowed(Tests, TestSupport, Kind::Normal));
        assert!(!edge_allowed(Binary, Tests, Kind::Dev));
        assert!(!edge_allowed(Tests, Tooling, Kind::Dev));
        assert!(edge_allowed(Server, Facade, Kind::Normal));
        assert!(!edge_allowed(Server, Core, Kind::Normal));
        assert!(!edge_allowed(Server, Adapter, Kind::Normal));
        assert!(edge_allowed(Binary, Server, Kind::Normal));
        assert!(!edge_allowed(Facade, Server, Kind::Normal));
        assert!(!edge_allowed(Adapter, Server, Kind::Dev));
        assert!(edge_allowed(Dialect, Core, Kind::Normal));
        assert!(!edge_allowed(Dialect, Facade, Kind::Normal));
        assert!(!edge_allowed(Dialect, Adapter, Kind::Normal));
        assert!(edge_allowed(Server, Dialect, Kind::Normal));
        assert!(!edge_allowed(Facade, Dialect, Kind::Normal));
        assert!(!edge_allowed(Adapter, Dialect, Kind::Normal));
    }
}
