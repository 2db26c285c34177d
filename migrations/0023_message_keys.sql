-- pgskip: compatible-with 0019
-- 0023_message_keys: a message can carry a unique key and a concurrency key.
--
-- unique_key: no two messages of a queue hold the same key while pending, scheduled or
-- running (the unique index of migration 0024); a publish whose key is held writes nothing
-- (apply_async(..., pgskip_unique=...), docs/unique.md). concurrency_key: the key a queue's
-- per-key concurrency limit counts by (apply_async(..., pgskip_concurrency_key=...)). Both are
-- copied into the message's headers too, so that Celery's retry carries them.
--
-- Adding nullable columns without a default rewrites nothing. Publisher roles granted by
-- `pgskip grant` (INSERT on jobs without DELETE) may write both columns; worker roles write
-- every column already. beat_emit() writes the keys of a periodic entry's messages and
-- skips a run whose unique key is held. Code of 0019 to 0022 runs with this schema: it
-- writes no key.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

ALTER TABLE jobs ADD COLUMN unique_key text, ADD COLUMN concurrency_key text;
COMMENT ON COLUMN jobs.unique_key IS
    'no other message of the queue holds it while pending, scheduled or running (pgskip_unique)';
COMMENT ON COLUMN jobs.concurrency_key IS
    'what a per-key concurrency limit of the queue counts by (pgskip_concurrency_key)';

DO $$
DECLARE
    grantee text;
BEGIN
    -- Publishers hold INSERT on the columns a publish writes (migration 0012), payload among
    -- them, and no DELETE.
    FOR grantee IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_attribute AS att, aclexplode(att.attacl) AS a
         WHERE att.attrelid = 'jobs'::regclass
           AND att.attname = 'payload'
           AND a.privilege_type = 'INSERT'
           AND a.grantee <> 0
           AND NOT has_table_privilege(a.grantee, 'jobs', 'DELETE')
    LOOP
        EXECUTE format('GRANT INSERT (unique_key, concurrency_key) ON jobs TO %s', grantee);
    END LOOP;
END
$$;

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
    -- TTL from the message or the queue.
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
        -- A run whose unique key is held (the previous run still waits or runs) is skipped.
        ON CONFLICT DO NOTHING
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
