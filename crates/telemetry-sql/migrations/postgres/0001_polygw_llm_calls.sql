-- polygw telemetry, PostgreSQL, migration 1: the llm_calls table (SPEC §8).
-- Migrations are add-column-only: a later file may only ADD COLUMN (nullable or with a
-- default) or CREATE INDEX, so every older binary can still write to a newer database.
-- Same column names and meaning as the SQLite table; see docs/TELEMETRY.md.
CREATE TABLE IF NOT EXISTS llm_calls (
    call_id            TEXT             NOT NULL PRIMARY KEY,
    logical_call_id    TEXT             NOT NULL,
    scope              TEXT             NOT NULL,
    operation          TEXT             NOT NULL,
    kind               TEXT             NOT NULL,
    source             TEXT,
    provider           TEXT,
    model              TEXT,
    attempt_index      BIGINT,
    is_hedge           BOOLEAN          NOT NULL DEFAULT FALSE,
    stream             BOOLEAN          NOT NULL DEFAULT FALSE,
    ok                 BOOLEAN          NOT NULL DEFAULT FALSE,
    error              TEXT,
    error_detail       TEXT,
    http_status        BIGINT,
    prompt_tokens      BIGINT,
    completion_tokens  BIGINT,
    reasoning_tokens   BIGINT,
    usage_source       TEXT             NOT NULL,
    cost               DOUBLE PRECISION,
    latency_ms         BIGINT,
    ttft_ms            BIGINT,
    max_inter_token_ms BIGINT,
    stall_ms           BIGINT,
    stall_count        BIGINT,
    cache_hit          BOOLEAN          NOT NULL DEFAULT FALSE,
    created_at         TIMESTAMPTZ      NOT NULL
);
CREATE INDEX IF NOT EXISTS llm_calls_created_at ON llm_calls (created_at);
CREATE INDEX IF NOT EXISTS llm_calls_logical_call_id ON llm_calls (logical_call_id);
