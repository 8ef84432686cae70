//! The embedded, add-column-only migrations of `llm_calls`, one list per backend, run
//! with sqlx's migrator on connect.
//!
//! The SQL files live in `migrations/sqlite/` and `migrations/postgres/` and are embedded
//! with `include_str!` (no `sqlx::migrate!` macro: that would build a second copy of
//! sqlx and SQLite for the host just to read two files). They are fed to
//! [`sqlx::migrate::Migrator`] through its public [`MigrationSource`] trait, so the
//! bookkeeping (the `_sqlx_migrations` table, checksums, PostgreSQL's advisory lock) is
//! sqlx's own. A test checks the lists match the directories.
//!
//! Rules:
//! - add-column-only: a migration after the first may only `ALTER TABLE llm_calls ADD
//!   COLUMN` (nullable or with a default) or `CREATE INDEX`; the writer names its columns,
//!   so an older binary keeps writing to a newer database;
//! - the migrator ignores applied versions it does not know (a newer binary migrated the
//!   database first), for the same reason;
//! - polygw refuses a `_sqlx_migrations` table that holds another application's
//!   migrations: give telemetry its own SQLite file, or its own PostgreSQL database or
//!   schema (`?options[search_path]=polygw`).

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};

/// One embedded migration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddedMigration {
    /// The version (the file name's number).
    pub version: i64,
    /// The description (the file name's rest, `_` as spaces), as sqlx would derive it.
    pub description: &'static str,
    /// The file name, relative to the backend's directory.
    pub file: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

/// Every description of a polygw migration starts with this, which is how a foreign
/// `_sqlx_migrations` table is recognised.
pub const DESCRIPTION_PREFIX: &str = "polygw ";

/// SQLite migrations, in order.
pub const SQLITE: &[EmbeddedMigration] = &[
    EmbeddedMigration {
        version: 1,
        description: "polygw llm calls",
        file: "0001_polygw_llm_calls.sql",
        sql: include_str!("../migrations/sqlite/0001_polygw_llm_calls.sql"),
    },
    EmbeddedMigration {
        version: 2,
        description: "polygw resume columns",
        file: "0002_polygw_resume_columns.sql",
        sql: include_str!("../migrations/sqlite/0002_polygw_resume_columns.sql"),
    },
];

/// PostgreSQL migrations, in order (same versions and descriptions as [`SQLITE`]).
pub const POSTGRES: &[EmbeddedMigration] = &[
    EmbeddedMigration {
        version: 1,
        description: "polygw llm calls",
        file: "0001_polygw_llm_calls.sql",
        sql: include_str!("../migrations/postgres/0001_polygw_llm_calls.sql"),
    },
    EmbeddedMigration {
        version: 2,
        description: "polygw resume columns",
        file: "0002_polygw_resume_columns.sql",
        sql: include_str!("../migrations/postgres/0002_polygw_resume_columns.sql"),
    },
];

/// A list of embedded migrations as a sqlx [`MigrationSource`].
#[derive(Debug, Clone, Copy)]
pub struct Embedded(pub &'static [EmbeddedMigration]);

type Resolved = Pin<Box<dyn Future<Output = Result<Vec<Migration>, BoxDynError>> + Send>>;

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> Resolved {
        let list = self
            .0
            .iter()
            .map(|m| {
                Migration::new(
                    m.version,
                    Cow::Borrowed(m.description),
                    MigrationType::Simple,
                    Cow::Borrowed(m.sql),
                    false,
                )
            })
            .collect();
        Box::pin(async move { Ok(list) })
    }
}

/// The migrator for a list: sqlx's, ignoring versions it does not know (a newer polygw
/// may have migrated the database first; add-column-only keeps this binary's writes valid).
pub async fn migrator(list: &'static [EmbeddedMigration]) -> Result<Migrator, BoxDynError> {
    let mut m = Migrator::new(Embedded(list)).await?;
    m.set_ignore_missing(true);
    Ok(m)
}

/// Whether a statement is allowed in a migration after the first (add-column-only).
pub fn is_additive_statement(stmt: &str) -> bool {
    let words: Vec<String> = stmt
        .split_whitespace()
        .take(6)
        .map(|w| w.to_ascii_uppercase())
        .collect();
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    matches!(
        w.as_slice(),
        ["ALTER", "TABLE", "LLM_CALLS", "ADD", "COLUMN", ..]
            | ["CREATE", "INDEX", ..]
            | ["CREATE", "UNIQUE", "INDEX", ..]
    )
}

/// The SQL statements of a file, comments removed (split on `;`; the migrations hold no
/// string literal with a `;`).
pub fn statements(sql: &str) -> Vec<String> {
    let without_comments: String = sql
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    without_comments
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_files(backend: &str) -> Vec<String> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(backend);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn embedded_lists_match_the_directories() {
        for (backend, list) in [("sqlite", SQLITE), ("postgres", POSTGRES)] {
            let files = dir_files(backend);
            let listed: Vec<String> = list.iter().map(|m| m.file.to_string()).collect();
            assert_eq!(
                files, listed,
                "{backend}: embed every migration file, in order"
            );
            for m in list {
                let (num, rest) = m.file.split_once('_').unwrap();
                assert_eq!(num.parse::<i64>().unwrap(), m.version, "{}", m.file);
                let desc = rest.trim_end_matches(".sql").replace('_', " ");
                assert_eq!(desc, m.description, "{}", m.file);
                assert!(m.description.starts_with(DESCRIPTION_PREFIX), "{}", m.file);
            }
        }
    }

    #[test]
    fn both_backends_have_the_same_versions() {
        let v = |l: &[EmbeddedMigration]| -> Vec<(i64, &str)> {
            l.iter().map(|m| (m.version, m.description)).collect()
        };
        assert_eq!(v(SQLITE), v(POSTGRES));
        let versions: Vec<i64> = SQLITE.iter().map(|m| m.version).collect();
        let mut sorted = versions.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(versions, sorted, "versions strictly increase");
    }

    #[test]
    fn later_migrations_are_add_column_only() {
        // The first migration creates the table; every later one may only add.
        assert!(is_additive_statement(
            "ALTER TABLE llm_calls ADD COLUMN x BIGINT"
        ));
        assert!(is_additive_statement(
            "create index if not exists i on llm_calls (x)"
        ));
        assert!(!is_additive_statement(
            "ALTER TABLE llm_calls DROP COLUMN x"
        ));
        assert!(!is_additive_statement(
            "ALTER TABLE llm_calls RENAME COLUMN x TO y"
        ));
        assert!(!is_additive_statement("DROP TABLE llm_calls"));
        for list in [SQLITE, POSTGRES] {
            let first = statements(list[0].sql);
            assert!(first[0].starts_with("CREATE TABLE IF NOT EXISTS llm_calls"));
            for m in &list[1..] {
                for s in statements(m.sql) {
                    assert!(is_additive_statement(&s), "{}: {s}", m.file);
                }
            }
        }
    }
}
