//! The embedded, additive migrations of polygw's tables (`llm_calls`, and
//! `polygw_responses` since migration 4, `polygw_response_turns` since 7), one list per backend, run with sqlx's migrator
//! on connect.
//!
//! The SQL files live in `migrations/sqlite/` and `migrations/postgres/` and are embedded
//! with `include_str!` (no `sqlx::migrate!` macro: that would build a second copy of
//! sqlx and SQLite for the host just to read two files). They are fed to
//! [`sqlx::migrate::Migrator`] through its public [`MigrationSource`] trait, so the
//! bookkeeping (the `_sqlx_migrations` table, checksums, PostgreSQL's advisory lock) is
//! sqlx's own. A test checks the lists match the directories.
//!
//! Rules:
//! - additive only: a migration after the first may only `ALTER TABLE llm_calls ADD
//!   COLUMN` (nullable or with a default), `CREATE INDEX`, or create a new table of
//!   polygw's own with `CREATE TABLE IF NOT EXISTS polygw_…`; nothing is ever altered
//!   otherwise, renamed or dropped ([`is_additive_statement`], enforced by a test). The
//!   writer names its columns and an older binary ignores tables it does not know, so an
//!   older binary keeps working on a newer database;
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
    EmbeddedMigration {
        version: 3,
        description: "polygw revision3 columns",
        file: "0003_polygw_revision3_columns.sql",
        sql: include_str!("../migrations/sqlite/0003_polygw_revision3_columns.sql"),
    },
    EmbeddedMigration {
        version: 4,
        description: "polygw responses",
        file: "0004_polygw_responses.sql",
        sql: include_str!("../migrations/sqlite/0004_polygw_responses.sql"),
    },
    EmbeddedMigration {
        version: 5,
        description: "polygw client keys",
        file: "0005_polygw_client_keys.sql",
        sql: include_str!("../migrations/sqlite/0005_polygw_client_keys.sql"),
    },
    EmbeddedMigration {
        version: 6,
        description: "polygw attribution",
        file: "0006_polygw_attribution.sql",
        sql: include_str!("../migrations/sqlite/0006_polygw_attribution.sql"),
    },
    EmbeddedMigration {
        version: 7,
        description: "polygw response turns",
        file: "0007_polygw_response_turns.sql",
        sql: include_str!("../migrations/sqlite/0007_polygw_response_turns.sql"),
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
    EmbeddedMigration {
        version: 3,
        description: "polygw revision3 columns",
        file: "0003_polygw_revision3_columns.sql",
        sql: include_str!("../migrations/postgres/0003_polygw_revision3_columns.sql"),
    },
    EmbeddedMigration {
        version: 4,
        description: "polygw responses",
        file: "0004_polygw_responses.sql",
        sql: include_str!("../migrations/postgres/0004_polygw_responses.sql"),
    },
    EmbeddedMigration {
        version: 5,
        description: "polygw client keys",
        file: "0005_polygw_client_keys.sql",
        sql: include_str!("../migrations/postgres/0005_polygw_client_keys.sql"),
    },
    EmbeddedMigration {
        version: 6,
        description: "polygw attribution",
        file: "0006_polygw_attribution.sql",
        sql: include_str!("../migrations/postgres/0006_polygw_attribution.sql"),
    },
    EmbeddedMigration {
        version: 7,
        description: "polygw response turns",
        file: "0007_polygw_response_turns.sql",
        sql: include_str!("../migrations/postgres/0007_polygw_response_turns.sql"),
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
/// may have migrated the database first; additive migrations keep this binary's writes
/// valid).
pub async fn migrator(list: &'static [EmbeddedMigration]) -> Result<Migrator, BoxDynError> {
    let mut m = Migrator::new(Embedded(list)).await?;
    m.set_ignore_missing(true);
    Ok(m)
}

/// The prefix of every table polygw creates besides `llm_calls`.
pub const TABLE_PREFIX: &str = "polygw_";

/// Whether a statement is allowed in a migration after the first (additive only):
/// `ALTER TABLE llm_calls ADD COLUMN …`, `CREATE [UNIQUE] INDEX …`, or
/// `CREATE TABLE IF NOT EXISTS polygw_… (…)` — a new table of polygw's own, never an
/// existing one altered or dropped.
pub fn is_additive_statement(stmt: &str) -> bool {
    let words: Vec<String> = stmt
        .split_whitespace()
        .take(6)
        .map(|w| w.to_ascii_uppercase())
        .collect();
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    match w.as_slice() {
        ["ALTER", "TABLE", "LLM_CALLS", "ADD", "COLUMN", ..]
        | ["CREATE", "INDEX", ..]
        | ["CREATE", "UNIQUE", "INDEX", ..] => true,
        ["CREATE", "TABLE", "IF", "NOT", "EXISTS", name, ..] => {
            // The name may run into the column list: `polygw_x(`.
            let name = name.split('(').next().unwrap_or_default();
            let prefix = TABLE_PREFIX.to_ascii_uppercase();
            name.len() > prefix.len()
                && name.starts_with(&prefix)
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }
        _ => false,
    }
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
    fn later_migrations_are_additive_only() {
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
        // New tables of polygw's own, and only those, only if not there yet.
        assert!(is_additive_statement(
            "CREATE TABLE IF NOT EXISTS polygw_responses (id TEXT NOT NULL)"
        ));
        assert!(is_additive_statement(
            "create table if not exists polygw_keys(id TEXT)"
        ));
        assert!(!is_additive_statement(
            "CREATE TABLE polygw_responses (id TEXT)"
        ));
        assert!(!is_additive_statement(
            "CREATE TABLE IF NOT EXISTS users (id TEXT)"
        ));
        assert!(!is_additive_statement(
            "CREATE TABLE IF NOT EXISTS llm_calls (id TEXT)"
        ));
        assert!(!is_additive_statement(
            "CREATE TABLE IF NOT EXISTS polygw_ (id TEXT)"
        ));
        assert!(!is_additive_statement(
            "CREATE TABLE IF NOT EXISTS \"polygw_x\"; DROP TABLE llm_calls"
        ));
        assert!(!is_additive_statement("DROP TABLE polygw_responses"));
        assert!(!is_additive_statement(
            "ALTER TABLE polygw_responses DROP COLUMN id"
        ));
        assert!(!is_additive_statement(
            "ALTER TABLE polygw_responses RENAME TO llm_calls"
        ));

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
