//! The process environment as configuration pairs. `std::env::vars()` panics on the
//! first variable whose name or value is not UTF-8 (any process may inherit one); this
//! reads `vars_os()` instead, skips such variables, and reports them only when they
//! belong to the scope being loaded (a key starting with `{SCOPE}__`).

use std::ffi::OsString;

use polygw_core::ConfigError;

/// Every UTF-8 variable of the process, as `(key, value)` pairs. Variables that are not
/// UTF-8 are skipped, unless their key (read lossily) starts with `{scope}__`: those
/// are configuration errors naming the key.
pub fn process_vars(scope: Option<&str>) -> Result<Vec<(String, String)>, ConfigError> {
    utf8_vars(std::env::vars_os(), scope)
}

/// [`process_vars`] over any list of OS strings (tests).
pub fn utf8_vars(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    scope: Option<&str>,
) -> Result<Vec<(String, String)>, ConfigError> {
    let prefix = scope.map(|s| format!("{}__", s.to_uppercase()));
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (k, v) in vars {
        match (k.into_string(), v.into_string()) {
            (Ok(k), Ok(v)) => out.push((k, v)),
            (k, _) => {
                let key = match k {
                    Ok(k) => k,
                    Err(raw) => raw.to_string_lossy().into_owned(),
                };
                if prefix.as_deref().is_some_and(|p| key.starts_with(p)) {
                    errors.push(ConfigError::Invalid {
                        key,
                        value: "<not UTF-8>".into(),
                        expected: "UTF-8 text (the process environment holds bytes that are not)"
                            .into(),
                    });
                }
            }
        }
    }
    ConfigError::from_list(errors)?;
    Ok(out)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn os(s: &str) -> OsString {
        OsString::from(s)
    }

    fn bad(b: &[u8]) -> OsString {
        OsString::from_vec(b.to_vec())
    }

    #[test]
    fn foreign_non_utf8_variables_are_skipped() {
        let vars = vec![
            (os("LLM__S__0__MODEL"), os("m")),
            (os("JUNK"), bad(b"\xff\xfe")),
            (bad(b"K\xff"), os("v")),
        ];
        let got = utf8_vars(vars, Some("llm")).unwrap();
        assert_eq!(got, [("LLM__S__0__MODEL".to_string(), "m".to_string())]);
    }

    #[test]
    fn a_non_utf8_variable_of_the_scope_is_an_error_naming_it() {
        let vars = vec![
            (os("LLM__S__0__API_KEY"), bad(b"sk-\xff")),
            (bad(b"LLM__S__0__MO\xffDEL"), os("m")),
            (os("OTHER__S__0__MODEL"), bad(b"\xff")),
        ];
        let e = utf8_vars(vars, Some("LLM")).unwrap_err();
        let all: Vec<String> = e.all().iter().map(|e| e.to_string()).collect();
        assert_eq!(all.len(), 2, "{all:?}");
        assert!(all[0].contains("LLM__S__0__API_KEY") && all[0].contains("UTF-8"));
        assert!(!all[0].contains("sk-"), "the value is never shown: {all:?}");
        assert!(all[1].contains("LLM__S__0__MO"));
        // Discovery (no scope) skips everything that is not UTF-8.
        let vars = vec![(os("LLM__S__0__API_KEY"), bad(b"\xff"))];
        assert!(utf8_vars(vars, None).unwrap().is_empty());
    }
}

/// The variables of an env file (dotenv syntax: `KEY=VALUE` lines, `#` comments,
/// optional `export `, single or double quotes), in file order. An unreadable file or a
/// line that does not parse is an error naming the file (never a value: the file may
/// hold keys).
pub fn env_file_vars(path: &std::path::Path) -> Result<Vec<(String, String)>, ConfigError> {
    let bad = |e: dotenvy::Error| ConfigError::Invalid {
        key: "env file".into(),
        value: path.display().to_string(),
        expected: format!("a readable file of KEY=VALUE lines ({})", redact_dotenv(&e)),
    };
    let mut out = Vec::new();
    for item in dotenvy::from_path_iter(path).map_err(bad)? {
        out.push(item.map_err(bad)?);
    }
    Ok(out)
}

/// A dotenv error without the text of the line it could not parse.
fn redact_dotenv(e: &dotenvy::Error) -> String {
    match e {
        dotenvy::Error::LineParse(_, index) => format!("line parse error at byte {index}"),
        dotenvy::Error::Io(io) => io.to_string(),
        other => other.to_string(),
    }
}

/// `base` with `file`'s variables over it: a variable the file sets wins; with `scope`,
/// only the file's variables of that scope (`{SCOPE}__…`) are added.
pub fn overlay(
    base: Vec<(String, String)>,
    file: &[(String, String)],
    scope: Option<&str>,
) -> Vec<(String, String)> {
    let prefix = scope.map(|s| format!("{}__", s.to_uppercase()));
    let mine = |k: &str| prefix.as_deref().is_none_or(|p| k.starts_with(p));
    let mut out: Vec<(String, String)> = base
        .into_iter()
        .filter(|(k, _)| !file.iter().any(|(f, _)| f == k))
        .collect();
    out.extend(file.iter().filter(|(k, _)| mine(k)).cloned());
    out
}
