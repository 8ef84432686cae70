//! The program started with variables that are not UTF-8 in its environment (any
//! process may inherit one): `std::env::vars()` would panic; polygw skips foreign ones
//! and names its own.

#![cfg(unix)]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_polygw-under-test");

fn config_check(extra: &[(&str, OsString)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(["config", "check", "--scope", "LLM"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LLM__S__0__BASE_URL", "http://127.0.0.1:9/v1")
        .env("LLM__S__0__API_KEY", "")
        .env("LLM__S__0__MODEL", "m");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.output().expect("the program runs")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_foreign_non_utf8_variable_is_ignored() {
    let o = config_check(&[("JUNK", OsString::from_vec(b"caf\xe9".to_vec()))]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("# scope LLM (chat): ok"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
}

#[test]
fn a_non_utf8_variable_of_the_scope_is_named() {
    let o = config_check(&[(
        "LLM__S__0__API_KEY",
        OsString::from_vec(b"sk-\xffsecret".to_vec()),
    )]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("LLM__S__0__API_KEY") && t.contains("not UTF-8"),
        "{t}"
    );
    assert!(!t.contains("secret"), "the value is never shown: {t}");
    assert!(!t.contains("panicked"), "{t}");
}
