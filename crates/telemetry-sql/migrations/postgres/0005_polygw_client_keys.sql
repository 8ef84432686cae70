-- polygw telemetry, PostgreSQL, migration 5: client keys (SPEC §21.1), the table behind
-- polygw_telemetry_sql::SqlKeyStore. A new table of polygw's own (`CREATE TABLE IF NOT
-- EXISTS polygw_*`), which the migration rule allows after the first migration. A key is
-- kept as the SHA-256 of its text (hash, lowercase hex), never in clear; prefix is its
-- first 10 characters, to recognise it. scopes and models are JSON arrays of names
-- (empty: all). Limits are 0 for unlimited; budgets are in nano-units of the prices'
-- currency (NULL: none). Times are Unix ms; revoked_at_ms NULL while the key is valid.
CREATE TABLE IF NOT EXISTS polygw_client_keys (
    id                 TEXT    NOT NULL PRIMARY KEY,
    name               TEXT    NOT NULL UNIQUE,
    hash               TEXT    NOT NULL UNIQUE,
    prefix             TEXT    NOT NULL,
    scopes             TEXT    NOT NULL,
    models             TEXT    NOT NULL,
    rpm                BIGINT  NOT NULL,
    tpm                BIGINT  NOT NULL,
    max_concurrency    BIGINT  NOT NULL,
    budget_day_nanos   BIGINT,
    budget_month_nanos BIGINT,
    created_at_ms      BIGINT  NOT NULL,
    updated_at_ms      BIGINT  NOT NULL,
    revoked_at_ms      BIGINT
);
