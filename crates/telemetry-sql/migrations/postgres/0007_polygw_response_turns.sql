-- polygw telemetry, PostgreSQL, migration 7: stored OpenAI Responses by turn (SPEC §24.5),
-- the table polygw_telemetry_sql::SqlResponseStore writes since this migration. A new
-- table of polygw's own (`CREATE TABLE IF NOT EXISTS polygw_*`). Each row is one turn:
-- its own input items (JSON text), its response, and previous_id, the turn it
-- continues in the same scope (NULL: it continues nothing). bytes is what the row
-- counts against its owner's RESPONSES__MAX_BYTES_PER_KEY; the (scope, expires_at_ms)
-- index is the owner's eviction order. Rows of polygw_responses (migration 4, each
-- holding its whole conversation) are still read, deleted and purged, never written:
-- an older binary does not see the new rows (a 404, never a shortened conversation).
CREATE TABLE IF NOT EXISTS polygw_response_turns (
    id            TEXT    NOT NULL,
    scope         TEXT    NOT NULL,
    response      TEXT    NOT NULL,
    input_items   TEXT    NOT NULL,
    previous_id   TEXT,
    bytes         BIGINT  NOT NULL,
    created_at_ms BIGINT  NOT NULL,
    expires_at_ms BIGINT  NOT NULL,
    PRIMARY KEY (scope, id)
);
CREATE INDEX IF NOT EXISTS polygw_response_turns_expires_at_ms ON polygw_response_turns (expires_at_ms);
CREATE INDEX IF NOT EXISTS polygw_response_turns_scope_expires ON polygw_response_turns (scope, expires_at_ms);
