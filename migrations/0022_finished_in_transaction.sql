-- pgskip: compatible-with 0019
-- 0022_finished_in_transaction: a task can finish its message in its own transaction.
--
-- kombu_pgskip.completing() marks the message it runs from done inside the task's own
-- database transaction (finished_at set, fenced by the delivery token, while the row stays
-- 'running' under its consumer): the work and that mark commit together or not at all. The
-- worker's ack then completes it as any other. Until the ack, every path that returns a
-- running message to its queue now completes such a message instead, so that work that
-- committed never runs again: sweep() here (a consumer that died between the commit and the
-- ack), and the workers' requeue and unregister_consumer (sql/consume.sql).
--
-- Code of 0019 to 0021 runs with this schema: it never sets finished_at on a running message,
-- and calls sweep() with the same arguments.

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
    -- A message whose task finished it in its own transaction (finished_at set while
    -- running: kombu_pgskip.completing) is completed: its work committed, it never runs again.
    UPDATE jobs
       SET status = CASE WHEN jobs.finished_at IS NOT NULL THEN 'completed'
                         WHEN jobs.attempts >= max_attempts THEN 'failed'
                         ELSE 'pending' END::job_status,
           redelivered = jobs.redelivered OR jobs.finished_at IS NULL, locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.finished_at IS NOT NULL THEN jobs.finished_at
                              WHEN jobs.attempts >= max_attempts THEN now() END,
           last_error = CASE WHEN jobs.finished_at IS NULL AND jobs.attempts >= max_attempts
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
