-- polygw telemetry, SQLite, migration 6: attribution (SPEC §24.6). Add-column-only;
-- every column is nullable, so rows written before read them as NULL. agent_session_id:
-- the agent session a call belongs to, as its client named it (Claude Code's
-- x-claude-code-session-id, Codex's session_id, a prompt_cache_key); agent_id /
-- parent_agent_id: the sub-agent that made the call and the agent that started it
-- (x-claude-code-agent-id, x-claude-code-parent-agent-id). See docs/TELEMETRY.md.
ALTER TABLE llm_calls ADD COLUMN agent_session_id TEXT;
ALTER TABLE llm_calls ADD COLUMN agent_id TEXT;
ALTER TABLE llm_calls ADD COLUMN parent_agent_id TEXT;
CREATE INDEX IF NOT EXISTS llm_calls_agent_session_id ON llm_calls (agent_session_id);
