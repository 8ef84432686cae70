//! The process environment as polygw configuration: scope discovery and loading; with
//! `--env-file` (`polygw serve`), the variables of a file over the process's.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use polygw::core::config::{discover_scopes, load_scope};
use polygw::core::LoadedScope;
use polygw::ScopeKind;

/// Where the configuration comes from: the process environment, and the variables of an
/// env file over it (a variable the file sets wins; one it leaves out comes from the
/// process).
#[derive(Debug, Clone, Default)]
pub struct Env {
    /// The file's path and its variables, as read.
    file: Option<(PathBuf, Vec<(String, String)>)>,
}

impl Env {
    /// The process environment alone.
    pub fn process() -> Env {
        Env::default()
    }

    /// The process environment with `path`'s variables over it: `KEY=VALUE` lines,
    /// `#` comments, optional `export `, single or double quotes (dotenv syntax). An
    /// unreadable file, or a line that does not parse, is an error naming it.
    pub fn with_file(path: &Path) -> Result<Env> {
        let vars = polygw::env::env_file_vars(path)?;
        Ok(Env {
            file: Some((path.to_path_buf(), vars)),
        })
    }

    /// Every UTF-8 variable (others are skipped: discovery only).
    pub fn vars(&self) -> Vec<(String, String)> {
        self.overlay(polygw::process_vars(None).unwrap_or_default(), None)
    }

    /// `base` with the file's variables (of `scope`, when given) over it.
    fn overlay(&self, base: Vec<(String, String)>, scope: Option<&str>) -> Vec<(String, String)> {
        match &self.file {
            Some((_, file)) => polygw::env::overlay(base, file, scope),
            None => base,
        }
    }

    /// The scopes to use: those named (upper-cased), else every scope with a source key.
    pub fn scopes(&self, named: &[String]) -> Result<Vec<String>> {
        if !named.is_empty() {
            return Ok(named.iter().map(|s| s.to_uppercase()).collect());
        }
        let found = discover_scopes(self.vars());
        if found.is_empty() {
            bail!(
                "no scope is configured: set e.g. LLM__<PROVIDER>__0__BASE_URL, __API_KEY and \
                 __MODEL (see docs/CONFIGURATION.md), or run `polygw demo`"
            );
        }
        Ok(found)
    }

    /// The kind a scope declares (`{S}__KIND`: chat by default).
    pub fn kind_of(&self, scope: &str) -> Result<ScopeKind, polygw::ConfigError> {
        polygw::core::config::scope_kind(self.vars(), scope)
    }

    /// Loads and guards one scope. A variable of the scope that is not UTF-8 is an error
    /// naming its key.
    pub fn load(&self, scope: &str, kind: ScopeKind) -> Result<LoadedScope, polygw::ConfigError> {
        let vars = self.overlay(polygw::process_vars(Some(scope))?, Some(scope));
        load_scope(vars, scope, kind)
    }
}

/// [`Env::scopes`] of the process environment.
pub fn scopes(named: &[String]) -> Result<Vec<String>> {
    Env::process().scopes(named)
}

/// [`Env::kind_of`] of the process environment.
pub fn kind_of(scope: &str) -> Result<ScopeKind, polygw::ConfigError> {
    Env::process().kind_of(scope)
}

/// [`Env::load`] of the process environment.
pub fn load(scope: &str, kind: ScopeKind) -> Result<LoadedScope, polygw::ConfigError> {
    Env::process().load(scope, kind)
}

/// Prints configuration warnings to stderr.
pub fn print_warnings(scope: &str, warnings: &[polygw::ConfigWarning]) {
    for w in warnings {
        eprintln!("warning: {scope}: {w}");
    }
}
