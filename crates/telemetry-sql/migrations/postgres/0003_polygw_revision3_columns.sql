-- polygw telemetry, PostgreSQL, migration 3: revision 3 columns. Add-column-only; every
-- column is nullable, so rows written before read them as NULL. See docs/TELEMETRY.md.
-- api: the route a call came by (chat, responses, messages, embeddings; NULL for library
-- calls, SPEC §18.4); cached_prompt_tokens / cache_write_tokens: prompt tokens read from
-- and written to the provider's prompt cache (SPEC §20.1); est_prompt_tokens /
-- est_received_tokens: the gateway's estimates on rows whose usage is unavailable
-- (SPEC §20.4); client_key_id: the client key the call came with (SPEC §21.1); trace:
-- the call's decision trace, compact JSON, on its last row (SPEC §19.4).
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS api TEXT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cached_prompt_tokens BIGINT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cache_write_tokens BIGINT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS est_prompt_tokens BIGINT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS est_received_tokens BIGINT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS client_key_id TEXT;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS trace TEXT;
