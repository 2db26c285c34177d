-- pgskip: compatible-with 0019
-- 0020_countdowns_keep_their_place: a message with a countdown keeps its place in its queue.
--
-- A message published with an ETA further away than eta_threshold waits as 'scheduled' until
-- due, and was then promoted to 'pending' with run_at its ETA: fetches, which take a queue's
-- messages in the order (priority DESC, run_at, id), served it after every message due before
-- its ETA, including those published after it, so behind a backlog it started as late as the
-- backlog was long. With RabbitMQ or Redis a worker receives an ETA message in publish order
-- and holds it until its ETA: its place in the queue is its publish. Now a promotion sets
-- run_at to created_at (the publish) when that is earlier, in sweep() here and in the workers'
-- promotion (sql/maintenance.sql), so a promoted message comes before those published after it.
--
-- A periodic run's messages are published, as celery beat would publish them, at their send
-- time (beat_slots.sent_at), which fire_due() reaches up to its lookahead ahead: beat_emit()
-- now stores that as created_at, so a run stored ahead of its slot keeps the slot's place,
-- not the tick's.
--
-- Code of 0019 runs with this schema: it promotes without moving run_at, as before.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

CREATE OR REPLACE FUNCTION sweep(max_attempts integer DEFAULT 20)
RETURNS TABLE(requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
-- The advisory locks held in this database, as pg_advisory_lock(bigint) keys: read after
-- this statement's snapshot was taken, so a row it sees was marked while its lock was held.
WITH held AS MATERIALIZED (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
      FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
), suspected AS (
    -- Here and in gone, a row renewed meanwhile is rechecked in its newest version (FOR
    -- UPDATE): a renewal that marked it after the locks were read has a heartbeat_at past this
    -- transaction's start, and a renewal clears lock_lost_at.
    UPDATE consumers AS c
       SET lock_lost_at = now()
     WHERE c.id IN (SELECT d.id
                      FROM consumers AS d
                     WHERE d.lock_lost_at IS NULL
                       AND d.lease_until > now()
                       AND d.lock_server_start = pg_postmaster_start_time()
                       AND d.heartbeat_at < now()
                       AND d.lock_key NOT IN (SELECT h.key FROM held AS h)
                       FOR UPDATE SKIP LOCKED)
    RETURNING c.id
), gone AS (
    DELETE FROM consumers AS c
     WHERE c.id IN (SELECT d.id
                      FROM consumers AS d
                     WHERE d.lease_until <= now()
                        OR (d.lock_lost_at <= now() - interval '2 seconds'
                            AND d.lock_server_start = pg_postmaster_start_time()
                            AND d.heartbeat_at < now()
                            AND d.lock_key NOT IN (SELECT h.key FROM held AS h))
                       FOR UPDATE SKIP LOCKED)
    RETURNING c.id
), lost AS (
    SELECT j.id
      FROM jobs AS j
     WHERE j.status = 'running'
       AND (j.locked_by IN (SELECT g.id FROM gone AS g)
            OR NOT EXISTS (SELECT 1 FROM consumers AS c WHERE c.id = j.locked_by))
     LIMIT 10000
       FOR UPDATE OF j SKIP LOCKED
), r AS (
    UPDATE jobs
       SET status = CASE WHEN jobs.attempts >= max_attempts THEN 'failed'
                         ELSE 'pending' END::job_status,
           redelivered = true, locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.attempts >= max_attempts THEN now() END,
           last_error = CASE WHEN jobs.attempts >= max_attempts
                             THEN 'consumer lost on each of ' || jobs.attempts
                                  || ' deliveries (max_attempts)'
                             ELSE jobs.last_error END
      FROM lost
     WHERE jobs.id = lost.id
    RETURNING jobs.queue, jobs.status
), due AS (
    SELECT id FROM jobs
     WHERE status = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT 10000
       FOR UPDATE SKIP LOCKED
), p AS (
    UPDATE jobs SET status = 'pending', run_at = LEAST(jobs.run_at, jobs.created_at)
      FROM due WHERE jobs.id = due.id RETURNING jobs.queue
), n AS (
    SELECT pg_notify('pgskip:' || current_schema(), d.queue)
      FROM (SELECT queue FROM r WHERE status = 'pending' UNION SELECT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM r WHERE status = 'pending'),
       (SELECT count(*) FROM r WHERE status = 'failed'),
       (SELECT count(*) FROM gone),
       (SELECT count(*) FROM p) + 0 * (SELECT count(*) FROM n);
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
                          created_at)
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
               CASE WHEN due > fired_at THEN sent ELSE LEAST(sent, now()) END
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

