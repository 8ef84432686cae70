-- polygw telemetry, SQLite, migration 4: stored OpenAI Responses (SPEC §18.1), the
-- table behind polygw_telemetry_sql::SqlResponseStore. A new table of polygw's own
-- (`CREATE TABLE IF NOT EXISTS polygw_*`), which the migration rule allows after the
-- first migration; llm_calls is untouched. response and input_items are JSON text (the
-- `response` object and the JSON array of input items, as given); times are Unix ms.
-- A row whose expires_at_ms has passed is never returned and is purged on later puts.
CREATE TABLE IF NOT EXISTS polygw_responses (
    id            TEXT    NOT NULL,
    scope         TEXT    NOT NULL,
    response      TEXT    NOT NULL,
    input_items   TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    PRIMARY KEY (scope, id)
);
CREATE INDEX IF NOT EXISTS polygw_responses_expires_at_ms ON polygw_responses (expires_at_ms);
