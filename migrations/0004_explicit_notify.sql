-- pgskip: compatible-with 0004
-- 0004_explicit_notify: every statement that inserts messages sends its own NOTIFY.
--
-- 0001 woke consumers from a statement-level AFTER INSERT trigger with a transition table. That
-- machinery (a tuplestore of the new rows, a PL/pgSQL call running two queries over it) cost
-- about 20 us of server CPU per single-row publish, some 10% of a durable publish on a fast
-- disk (docs/performance.md). The broker's insert statements (publish, publish_many,
-- publish_routed in kombu_pgskip/sql/queries.sql, and beat_emit below) now call pg_notify
-- themselves, with the same payloads: the queue name on channel 'pgskip:<schema>' for pending
-- rows, the epoch of the earliest run_at on 'pgskip:<schema>:scheduled' for scheduled ones.
-- NOTIFY stays transactional: a rolled-back insert wakes nobody.
--
-- Rows inserted by other means (hand-written SQL) wake nobody; consumers find them at their next
-- poll (the polling_interval option). Insert through the broker, apply_async_in or
-- publish_many instead, or call pg_notify('pgskip:<schema>', queue) in the same transaction.

DROP TRIGGER jobs_notify_insert ON jobs;
DROP FUNCTION notify_jobs_inserted();

-- As in 0002, plus the NOTIFY the trigger used to send.
CREATE OR REPLACE FUNCTION beat_emit(e beat_entries, slot timestamptz, fired_at timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    tid      text := COALESCE(e.fixed_task_id, gen_random_uuid()::text);
    -- Celery builds beat's message when it sends it: at the slot, or now for a late one.
    sent     timestamptz := greatest(slot, fired_at);
    due      timestamptz := greatest(slot, fired_at) + COALESCE(e.eta_offset, interval '0');
    inserted record;
BEGIN
    INSERT INTO beat_slots (entry, slot, task_id) VALUES (e.name, slot, tid)
        ON CONFLICT ON CONSTRAINT beat_slots_pkey DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Same rules as the broker's publish: priority clamped to the queue's x-max-priority,
    -- TTL from the message or the queue.
    FOR inserted IN
        INSERT INTO jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at)
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
                 + make_interval(secs => LEAST((msg.value->>'ttl_ms')::bigint, q.message_ttl) / 1000.0)
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
