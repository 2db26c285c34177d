-- Runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description" (sql/__init__.py).
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- {@name} includes the block of that name, from any of the runtime files.
-- A live worker's maintenance (kombu_pgskip.sweeper) and the promotion of scheduled messages.

-- sweep: return rows of dead consumers (lease run out, or the session of their process ended: migration 0016) to pending (or failed past max_attempts), forget those consumers, and promote due scheduled rows: the SQL function sweep(), which the maintenance job runs too; the running rows are read for those of consumers no longer known only where the database's last such read began scan_every seconds ago or more, or left rows behind (migration 0030); returns (requeued, failed, consumers forgotten)
SELECT requeued, failed, consumers_forgotten
  FROM {schema}.sweep(%(max_attempts)s, make_interval(secs => %(scan_every)s));

-- suspected_consumers: how many consumers a sweep found without their session lock, not yet long enough to be taken for dead (lock_lost_at, migration 0016)
SELECT count(*) FROM {schema}.consumers WHERE lock_lost_at IS NOT NULL;

-- promote_scheduled: make due scheduled messages pending, each in its place in the queue (run_at becomes its publish, created_at, as sweep() does since migration 0020); returns how many, and seconds until the next one
WITH due AS (
    SELECT id FROM {schema}.jobs
     WHERE status = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), p AS (
    UPDATE {schema}.jobs AS jobs SET status = 'pending', run_at = LEAST(jobs.run_at, jobs.created_at)
      FROM due WHERE jobs.id = due.id
    RETURNING jobs.queue
), n AS (
    SELECT pg_notify(%(channel)s, d.queue) FROM (SELECT DISTINCT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM p), (SELECT count(*) FROM n),
       (SELECT extract(epoch FROM min(run_at) - now())::float8
          FROM {schema}.jobs WHERE status = 'scheduled' AND run_at > now());

-- drop_expired: delete up to limit waiting messages whose TTL ran out, oldest expiry first (the jobs_expiring index), skipping rows another session has locked (a consumer taking them, another worker's batch); returns how many
WITH d AS (
    DELETE FROM {schema}.jobs
     WHERE id IN (SELECT id FROM {schema}.jobs
                   WHERE expires_at <= now() AND status IN ('pending', 'scheduled')
                   ORDER BY expires_at
                   LIMIT %(limit)s
                     FOR UPDATE SKIP LOCKED)
    RETURNING 1
)
SELECT count(*) FROM d;

-- bound_waits: (the first statement of a transaction) the rest of the transaction waits at most lock_ms for a lock and runs at most statement_ms per statement: the background thread's housekeeping, which must leave it time for the next lease renewal
SELECT set_config('lock_timeout', %(lock_ms)s, true),
       set_config('statement_timeout', %(statement_ms)s, true);

-- expire_queues: delete queues with x-expires unused for that long (see the SQL function); returns (queues, messages)
SELECT queues, messages FROM {schema}.expire_queues();

-- rotate: move the ring of jobs' slots on once the current slot has given out its ids, and empty with TRUNCATE the slots that hold nothing to keep (migration 0027); one caller at a time, the others return at once; returns (emptied, moved, current): slots emptied, messages moved to jobs_kept, the current slot
SELECT emptied, moved, current FROM {schema}.rotate();

-- set_rotation_retention: the retention of completed messages, which rotate() waits for before it empties a slot holding them (pgskip maintenance writes its completed_retention; NULL, kept forever: a slot's completed messages are moved to jobs_kept when the ring needs the slot)
UPDATE {schema}.jobs_rotation
   SET completed_retention = COALESCE(%(completed_after)s::interval, interval '1000 years');
