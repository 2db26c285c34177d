-- pgskip: compatible-with 0019
-- 0026_unique_key_claims: a queue's unique keys are claimed in a table of their own, not
-- enforced by a unique index of jobs.
--
-- A unique index of a partitioned table must contain its partition key, which (queue,
-- unique_key) does not: the keys need a place of their own for jobs to be partitioned. Each row
-- of unique_keys says which message last claimed a key of a queue. The truth stays in jobs: a
-- key is held while the message of that id, queue and key is pending, scheduled or running. An
-- entry whose message no longer holds it is stale; the next claim takes it over, prune()
-- deletes it.
--
-- claim_unique_key() claims NEW's key for NEW.id, under a lock of the key's entry:
--  * a new entry (INSERT ... ON CONFLICT DO NOTHING), or one that names NEW.id already (a row
--    deleted and inserted again with its id), or a stale one, taken over: the key is NEW's;
--  * else another message holds the key: a new message is not inserted (the BEFORE INSERT
--    trigger returns NULL, so the INSERT writes and returns no row, and the publish says
--    DuplicateTask, as before), and a message that comes back to pending, scheduled or running
--    with a key (retry-failed) comes back without it.
-- A claim whose entry another transaction inserted or locked waits for that transaction to end
-- (the insert's conflict check, the row lock), then reads what it committed: a second
-- publisher of a key waits for the first, as it did for the unique index. The message's row is
-- checked by a statement of its own, taken after the lock, so it sees what committed meanwhile.
--
-- Only a message with a key that is inserted pending, scheduled or running, or comes back to
-- one of those statuses (or changes its key or queue while in one), fires a trigger (their
-- WHEN clauses): the publish, fetch, ack or requeue of any other message does nothing more than
-- before. The claim on update runs AFTER the row is updated: a BEFORE UPDATE trigger would make
-- every update of jobs lock its row first (an ack, a requeue: a tuple lock and its WAL record
-- each), whatever its WHEN clause says.
--
-- The function runs as the schema's owner (SECURITY DEFINER, with this schema's search path):
-- no other role has any privilege on unique_keys nor may execute the function; publishers and
-- workers claim keys by writing jobs. It refuses to run for any other table.
--
-- CREATE TRIGGER holds jobs against writes until the end of this transaction, so the claims
-- of the messages that hold a key are copied while no other can be written, then the index
-- goes. Code of 0019 to 0025 runs with this schema: its publish (INSERT ... ON CONFLICT DO
-- NOTHING) writes no row when the trigger refuses one, and its retry-failed keeps a key only
-- where it is free, as the trigger then checks again.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

CREATE TABLE unique_keys (
    queue      text NOT NULL,
    unique_key text NOT NULL,
    job_id     bigint NOT NULL,
    PRIMARY KEY (queue, unique_key)
);
COMMENT ON TABLE unique_keys IS
    'which message claimed each unique key of a queue; held while jobs row job_id, of that queue and key, is pending, scheduled or running';
COMMENT ON COLUMN unique_keys.job_id IS
    'the message (jobs.id) that claimed the key last; it may have finished since (stale: the next claim takes the entry over)';
REVOKE USAGE ON TYPE unique_keys FROM PUBLIC;

CREATE FUNCTION claim_unique_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    holder bigint;
BEGIN
    IF COALESCE(pg_partition_root(TG_RELID), TG_RELID) <> 'jobs'::regclass THEN
        RAISE EXCEPTION 'claim_unique_key() runs only as a trigger of jobs';
    END IF;
    LOOP
        INSERT INTO unique_keys (queue, unique_key, job_id)
        VALUES (NEW.queue, NEW.unique_key, NEW.id)
            ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
        SELECT u.job_id INTO holder
          FROM unique_keys AS u
         WHERE u.queue = NEW.queue AND u.unique_key = NEW.unique_key
           FOR UPDATE;
        IF FOUND THEN
            IF holder <> NEW.id
               AND EXISTS (SELECT FROM jobs AS j
                            WHERE j.id = holder AND j.queue = NEW.queue
                              AND j.unique_key = NEW.unique_key
                              AND j.status IN ('pending', 'scheduled', 'running')) THEN
                IF TG_OP = 'INSERT' THEN
                    RETURN NULL;
                END IF;
                UPDATE jobs SET unique_key = NULL
                 WHERE id = NEW.id AND unique_key = NEW.unique_key;
                RETURN NULL;
            END IF;
            -- Written even when it names NEW.id already: a transaction whose snapshot is older
            -- than this claim (REPEATABLE READ) then fails to serialize on the entry instead
            -- of reading the claim's message as it was before.
            UPDATE unique_keys SET job_id = NEW.id
             WHERE queue = NEW.queue AND unique_key = NEW.unique_key;
            EXIT;
        END IF;
        -- The entry was deleted (prune) after the insert found it: claim it anew.
    END LOOP;
    IF TG_OP = 'INSERT' THEN
        RETURN NEW;
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION claim_unique_key() FROM PUBLIC;

-- What runs as the owner belongs to the owner, whichever role runs the migration.
DO $$
DECLARE
    owner text := (SELECT nspowner::regrole::text FROM pg_namespace
                    WHERE nspname = current_schema());
BEGIN
    EXECUTE format('ALTER TABLE unique_keys OWNER TO %s', owner);
    EXECUTE format('ALTER FUNCTION claim_unique_key() OWNER TO %s', owner);
END
$$;

CREATE TRIGGER jobs_claim_unique_key BEFORE INSERT ON jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND NEW.status IN ('pending', 'scheduled', 'running'))
    EXECUTE FUNCTION claim_unique_key();

CREATE TRIGGER jobs_reclaim_unique_key AFTER UPDATE ON jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND NEW.status IN ('pending', 'scheduled', 'running')
          AND (OLD.status NOT IN ('pending', 'scheduled', 'running')
               OR OLD.unique_key IS DISTINCT FROM NEW.unique_key
               OR OLD.queue <> NEW.queue))
    EXECUTE FUNCTION claim_unique_key();

-- The claims of the messages that hold a key (the unique index makes them one per key).
INSERT INTO unique_keys (queue, unique_key, job_id)
SELECT queue, unique_key, id
  FROM jobs
 WHERE unique_key IS NOT NULL AND status IN ('pending', 'scheduled', 'running');

DROP INDEX IF EXISTS jobs_unique_key;

-- Up to `batch` stale entries (all when NULL), each locked, then checked again by a statement
-- of its own: one that a claim took over (or made held again) between the first statement's
-- snapshot and its lock is kept. An entry a claim has locked is left for the next run.
CREATE FUNCTION prune_unique_keys(batch integer) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    stale_queues text[];
    stale_keys   text[];
    n            bigint;
BEGIN
    SELECT array_agg(s.queue), array_agg(s.unique_key) INTO stale_queues, stale_keys
      FROM (SELECT u.queue, u.unique_key
              FROM unique_keys AS u
             WHERE NOT EXISTS (SELECT FROM jobs AS j
                                WHERE j.id = u.job_id AND j.queue = u.queue
                                  AND j.unique_key = u.unique_key
                                  AND j.status IN ('pending', 'scheduled', 'running'))
             LIMIT batch
               FOR UPDATE OF u SKIP LOCKED) AS s;
    WITH d AS (
        DELETE FROM unique_keys AS u
         USING unnest(stale_queues, stale_keys) AS p(queue, unique_key)
         WHERE u.queue = p.queue AND u.unique_key = p.unique_key
           AND NOT EXISTS (SELECT FROM jobs AS j
                            WHERE j.id = u.job_id AND j.queue = u.queue
                              AND j.unique_key = u.unique_key
                              AND j.status IN ('pending', 'scheduled', 'running'))
        RETURNING 1
    )
    SELECT count(*) INTO n FROM d;
    RETURN n;
END
$$;
REVOKE ALL ON FUNCTION prune_unique_keys(integer) FROM PUBLIC;

CREATE OR REPLACE FUNCTION prune(completed_after interval DEFAULT '1 day',
                                 failed_after interval DEFAULT '14 days')
RETURNS TABLE (completed bigint, failed bigint, slots bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
-- Stale unique-key claims first, in a statement of their own (prune_unique_keys).
SELECT prune_unique_keys(NULL);
WITH c AS (
    DELETE FROM jobs
     WHERE completed_after IS NOT NULL AND status = 'completed'
       AND finished_at < now() - completed_after
    RETURNING 1
), f AS (
    DELETE FROM jobs
     WHERE failed_after IS NOT NULL AND status = 'failed'
       AND finished_at < now() - failed_after
    RETURNING 1
), s AS (
    -- fire_due never looks back further than an entry's cursor, and a cursor never moves
    -- back past now(): records older than this only serve `beat-list` history.
    DELETE FROM beat_slots
     WHERE slot < now() - interval '35 days'
    RETURNING 1
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM f), (SELECT count(*) FROM s);
$$;

DO $migration$
BEGIN
    EXECUTE pg_catalog.format($create$
CREATE OR REPLACE PROCEDURE %1$I.prune_in_batches(
    completed_after interval DEFAULT '1 day',
    failed_after interval DEFAULT '14 days',
    batch integer DEFAULT 10000,
    INOUT completed bigint DEFAULT NULL,
    INOUT failed bigint DEFAULT NULL,
    INOUT slots bigint DEFAULT NULL)
LANGUAGE plpgsql AS $body$
-- No SET clause (it would forbid COMMIT): every name is qualified, every operator too, so the
-- caller's search path resolves nothing here.
DECLARE
    cutoff timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) completed_after;
    n bigint;
BEGIN
    IF batch IS NULL OR batch OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION 'prune_in_batches: batch must be a positive number of rows, not %%', batch;
    END IF;
    completed := 0;
    IF completed_after IS NOT NULL THEN
        LOOP
            n := %1$I.prune_completed_batch(cutoff, batch);
            completed := completed OPERATOR(pg_catalog.+) n;
            COMMIT;
            EXIT WHEN n OPERATOR(pg_catalog.<) batch;
        END LOOP;
    END IF;
    -- Stale unique-key claims, as many per transaction.
    LOOP
        n := %1$I.prune_unique_keys(batch);
        COMMIT;
        EXIT WHEN n OPERATOR(pg_catalog.<) batch;
    END LOOP;
    SELECT p.failed, p.slots INTO failed, slots FROM %1$I.prune(NULL, failed_after) AS p;
END
$body$
$create$, pg_catalog.current_schema());
END
$migration$;

CREATE OR REPLACE FUNCTION beat_emit(e beat_entries, slot timestamptz, sent timestamptz,
                          fired_at timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    tid      text := COALESCE(e.fixed_task_id, gen_random_uuid()::text);
    due      timestamptz := sent + COALESCE(e.eta_offset, interval '0');
    inserted record;
BEGIN
    INSERT INTO beat_slots (entry, slot, task_id, sent_at) VALUES (e.name, slot, tid, sent)
        ON CONFLICT ON CONSTRAINT beat_slots_pkey DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Same rules as the broker's publish: priority clamped to the queue's x-max-priority,
    -- TTL from the message or the queue. A run whose unique key is held (the previous run
    -- still waits or runs) is not inserted (claim_unique_key()), and returns no row here.
    FOR inserted IN
        INSERT INTO jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at,
                          created_at, unique_key, concurrency_key)
        SELECT msg.value->>'queue',
               LEAST((msg.value->>'priority')::integer, COALESCE(q.max_priority, 255)),
               CASE WHEN due > fired_at THEN 'scheduled' ELSE 'pending' END::job_status,
               CASE WHEN due > fired_at THEN due ELSE LEAST(due, now()) END,
               beat_payload(msg.value->'payload', e.id_paths, tid,
                            CASE WHEN e.eta_offset IS NOT NULL THEN due END,
                            sent + e.expires_offset)::json,
               e.task,
               tid,
               GREATEST(due, now())
                 + make_interval(secs => LEAST((msg.value->>'ttl_ms')::bigint, q.message_ttl) / 1000.0),
               CASE WHEN due > fired_at THEN sent ELSE LEAST(sent, now()) END,
               msg.value->>'unique_key',
               msg.value->>'concurrency_key'
          FROM jsonb_array_elements(e.messages) AS msg
          LEFT JOIN queues AS q ON q.name = msg.value->>'queue'
        RETURNING jobs.queue, jobs.status, jobs.run_at
    LOOP
        IF inserted.status = 'pending' THEN
            PERFORM pg_notify('pgskip:' || current_schema(), inserted.queue);
        ELSE
            PERFORM pg_notify('pgskip:' || current_schema() || ':scheduled',
                              extract(epoch FROM inserted.run_at)::text);
        END IF;
    END LOOP;
    RETURN tid;
END;
$$;
