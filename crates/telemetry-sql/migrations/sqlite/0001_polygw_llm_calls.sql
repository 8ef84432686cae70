-- polygw telemetry, SQLite, migration 1: the llm_calls table (SPEC §8).
-- Migrations are add-column-only: a later file may only ADD COLUMN (nullable or with a
-- default) or CREATE INDEX, so every older binary can still write to a newer database.
-- Booleans are INTEGER 0/1; created_at is ISO-8601 UTC text (2026-12-02T11:32:08.123Z),
-- fixed width, so text order is time order. See docs/TELEMETRY.md.
CREATE TABLE IF NOT EXISTS llm_calls (
    call_id            TEXT    NOT NULL PRIMARY KEY,
    logical_call_id    TEXT    NOT NULL,
    scope              TEXT    NOT NULL,
    operation          TEXT    NOT NULL,
    kind               TEXT    NOT NULL,
    source             TEXT,
    provider           TEXT,
    model              TEXT,
    attempt_index      INTEGER,
    is_hedge           INTEGER NOT NULL DEFAULT 0,
    stream             INTEGER NOT NULL DEFAULT 0,
    ok                 INTEGER NOT NULL DEFAULT 0,
    error              TEXT,
    error_detail       TEXT,
    http_status        INTEGER,
    prompt_tokens      INTEGER,
    completion_tokens  INTEGER,
    reasoning_tokens   INTEGER,
    usage_source       TEXT    NOT NULL,
    cost               REAL,
    latency_ms         INTEGER,
    ttft_ms            INTEGER,
    max_inter_token_ms INTEGER,
    stall_ms           INTEGER,
    stall_count        INTEGER,
    cache_hit          INTEGER NOT NULL DEFAULT 0,
    created_at         TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS llm_calls_created_at ON llm_calls (created_at);
CREATE INDEX IF NOT EXISTS llm_calls_logical_call_id ON llm_calls (logical_call_id);
