-- pgskip: compatible-with 0015
-- 0016_consumers_die_with_their_session: a consumer whose process is gone is dead in seconds.
--
-- A consuming process holds a session-level advisory lock on the connection of its background
-- thread for as long as it lives, and its lease renewals write the lock's key into its
-- consumers' rows (lock_key), with the start time of the server it was taken on
-- (lock_server_start). PostgreSQL releases the lock the moment that session ends: a process
-- killed with SIGKILL, or whose host is gone and whose socket the kernel closes. The first
-- sweep() to find the key released notes when (lock_lost_at); a sweep two seconds or more later
-- that still finds it released takes the consumer for dead, without waiting for its lease to run
-- out. The two seconds spare a process whose lock session alone ended (killed by an operator,
-- closed by a proxy): its background thread sees that at once, takes the same key again on a
-- new session and renews, which clears lock_lost_at.
--
-- The lease stays the rule where there is no lock to go by: a process that hangs but stays
-- connected, consumers registered without a key (the transport option listen=False, for
-- PgBouncer in transaction pooling, where there is no session of one's own to hold a lock in),
-- and a key taken on another server incarnation (before a restart, or on the primary before a
-- failover): every session of that server ended, none of them says anything about its process.
--
-- sweep() also forgets dead consumers and takes their rows with SKIP LOCKED, so that workers
-- sweeping at the same time do not wait for each other, and returns at most 10,000 rows per
-- call (a consumer's rows left over are taken by the next call, its row being gone).
--
-- Code of the previous version runs with this schema: it writes no lock_key, so its consumers
-- keep the lease rule.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

ALTER TABLE consumers
    ADD COLUMN lock_key bigint,
    ADD COLUMN lock_server_start timestamptz,
    ADD COLUMN lock_lost_at timestamptz;

COMMENT ON COLUMN consumers.lock_key IS
    'key of the session-level advisory lock (pg_advisory_lock(bigint)) the consumer''s process '
    'holds while it lives; NULL: the lease alone says whether it lives';
COMMENT ON COLUMN consumers.lock_server_start IS
    'pg_postmaster_start_time() of the server on which lock_key was taken';
COMMENT ON COLUMN consumers.lock_lost_at IS
    'when a sweep first found lock_key released (a renewal clears it); two seconds later, dead';

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
    UPDATE jobs SET status = 'pending' FROM due WHERE jobs.id = due.id RETURNING jobs.queue
), n AS (
    SELECT pg_notify('pgskip:' || current_schema(), d.queue)
      FROM (SELECT queue FROM r WHERE status = 'pending' UNION SELECT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM r WHERE status = 'pending'),
       (SELECT count(*) FROM r WHERE status = 'failed'),
       (SELECT count(*) FROM gone),
       (SELECT count(*) FROM p) + 0 * (SELECT count(*) FROM n);
$$;
