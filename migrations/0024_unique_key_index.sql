-- pgskip: compatible-with 0019
-- 0024_unique_key_index: a queue's pending, scheduled and running messages hold distinct
-- unique keys.
--
-- The index holds only messages that carry a key (migration 0023) and are pending, scheduled
-- or running: the messages of a publish that did not ask for a key add nothing to it, and a
-- message that finishes leaves it. A publish whose key is held writes nothing
-- (INSERT ... ON CONFLICT DO NOTHING, sql/publish.sql). Built concurrently: inserts go on
-- while it is built.
-- pgskip: concurrently
CREATE UNIQUE INDEX jobs_unique_key ON jobs (queue, unique_key)
    WHERE unique_key IS NOT NULL AND status IN ('pending', 'scheduled', 'running');
