-- polygw telemetry, SQLite, migration 2: resume legs (SPEC §13.5). Add-column-only.
-- resume_of: call_id of the attempt whose answer a resume leg continues;
-- resume_mode: 'prefill' or 'replay'; prefix_chars: characters the caller had.
ALTER TABLE llm_calls ADD COLUMN resume_of TEXT;
ALTER TABLE llm_calls ADD COLUMN resume_mode TEXT;
ALTER TABLE llm_calls ADD COLUMN prefix_chars INTEGER;
