-- pgskip: compatible-with 0019
-- 0030_orphan_scan_spaced: a worker's sweep reads every running message once a minute, not at
-- every sweep.
--
-- sweep() returns to their queues the running messages of the consumers it takes for dead, and
-- of consumers no longer known at all: a running row whose locked_by names no consumers row,
-- left by an earlier sweep that reached its batch limit, or by a consumer deleted by hand. To
-- find the second kind it reads every running row of jobs, through the index of running rows,
-- which holds an entry for every message taken since vacuum last passed. While a session holds
-- an old snapshot none of them can be removed, so each sweep walks all of them and the rows they
-- point to: 360-390 ms a call late in a 150 s hold at 2,000 messages a second, growing with the
-- hold, and every worker sweeps every sweep_interval (10 s), so a fleet of N workers made that
-- walk N times every 10 s.
--
-- sweep(max_attempts, scan_every) reads them where it takes consumers for dead itself (their
-- rows are found in that read, as before), where the last read left rows behind (its batch
-- limit), or where the last began scan_every ago or more: sweep_scans says when. Workers of
-- this release pass a minute. sweep(max_attempts), which pg_cron's sweep job, `pgskip tick` and
-- a person call, reads them every time, as before.
--
-- Code of 0019 to 0029 calls sweep(max_attempts), which reads them every time, as before; the
-- roles granted that function are granted what the new one needs, so that an upgrade needs no
-- second `pgskip grant`.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

CREATE TABLE sweep_scans (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    scanned_at timestamptz NOT NULL DEFAULT '-infinity',
    complete   boolean NOT NULL DEFAULT true
);
COMMENT ON TABLE sweep_scans IS
    'when a sweep last read every running message of jobs for those of unknown consumers';
COMMENT ON COLUMN sweep_scans.scanned_at IS 'when the last such read began';
COMMENT ON COLUMN sweep_scans.complete IS
    'false: it reached its batch limit, so the next sweep reads them again';
REVOKE USAGE ON TYPE sweep_scans FROM PUBLIC;
INSERT INTO sweep_scans DEFAULT VALUES;

CREATE FUNCTION sweep(max_attempts integer, scan_every interval)
RETURNS TABLE(requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
LANGUAGE sql SET search_path FROM CURRENT SET jit = off AS $$
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
), look AS MATERIALIZED (
    -- Whether this sweep reads the running rows, for those of consumers it forgot or no longer
    -- known: where it forgot consumers itself, where the last read left rows behind, or where
    -- the last began scan_every ago or more (or is dated ahead of now(): a clock set back, or
    -- the row written so as to stop the reads).
    SELECT EXISTS (SELECT FROM gone)
           OR EXISTS (SELECT FROM sweep_scans AS s
                       WHERE NOT s.complete
                          OR s.scanned_at <= now() - scan_every
                          OR s.scanned_at > now()) AS due
), lost AS (
    -- Every running row is read here, and while a snapshot is held every row version that
    -- became running since it began, dead or not. Where look says no, a one-time filter
    -- skips the whole read.
    SELECT j.id
      FROM jobs AS j
     WHERE (SELECT l.due FROM look AS l)
       AND j.status = 'running'
       AND (j.locked_by IN (SELECT g.id FROM gone AS g)
            OR NOT EXISTS (SELECT 1 FROM consumers AS c WHERE c.id = j.locked_by))
     LIMIT 10000
       FOR UPDATE OF j SKIP LOCKED
), looked AS (
    -- When this read began, and whether it left rows behind (rows another sweep has locked
    -- are that sweep's to return). While another sweep holds the row, it writes it.
    UPDATE sweep_scans AS s
       SET scanned_at = now(), complete = (SELECT count(*) FROM lost) < 10000
     WHERE (SELECT l.due FROM look AS l)
       AND s.only_row IN (SELECT t.only_row FROM sweep_scans AS t FOR UPDATE SKIP LOCKED)
    RETURNING 1
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
REVOKE EXECUTE ON FUNCTION sweep(integer, interval) FROM PUBLIC;

CREATE OR REPLACE FUNCTION sweep(max_attempts integer DEFAULT 20)
RETURNS TABLE(requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
LANGUAGE sql SET search_path FROM CURRENT SET jit = off AS $$
    SELECT * FROM sweep(max_attempts, interval '0 seconds');
$$;

DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT quote_ident(a.grantee::regrole::text)
          FROM pg_proc AS p, aclexplode(p.proacl) AS a
         WHERE p.oid = 'sweep(integer)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee NOT IN (0, p.proowner)
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION sweep(integer, interval) TO %s', grantee);
        EXECUTE format('GRANT SELECT, UPDATE (scanned_at, complete) ON sweep_scans TO %s',
                       grantee);
    END LOOP;
END
$$;
