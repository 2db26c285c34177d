-- Runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description" (sql/__init__.py).
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- {@name} includes the block of that name, from any of the runtime files.
-- A live worker's maintenance (kombu_pgskip.sweeper) and the promotion of scheduled messages.

-- sweep: return rows of consumers whose lease ran out to pending (or failed past max_attempts), forget those consumers, and promote due scheduled rows: the SQL function sweep() (migration 0002), which the maintenance job runs too; returns (requeued, failed, consumers forgotten)
SELECT requeued, failed, consumers_forgotten FROM {schema}.sweep(%(max_attempts)s);

-- promote_scheduled: make due scheduled messages pending; returns how many, and seconds until the next one
WITH due AS (
    SELECT id FROM {schema}.jobs
     WHERE status = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), p AS (
    UPDATE {schema}.jobs AS jobs SET status = 'pending'
      FROM due WHERE jobs.id = due.id
    RETURNING jobs.queue
), n AS (
    SELECT pg_notify(%(channel)s, d.queue) FROM (SELECT DISTINCT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM p), (SELECT count(*) FROM n),
       (SELECT extract(epoch FROM min(run_at) - now())::float8
          FROM {schema}.jobs WHERE status = 'scheduled' AND run_at > now());

-- drop_expired: delete waiting messages whose TTL ran out; returns how many
WITH d AS (
    DELETE FROM {schema}.jobs
     WHERE expires_at <= now() AND status IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT count(*) FROM d;

-- expire_queues: delete queues with x-expires unused for that long (see the SQL function); returns (queues, messages)
SELECT queues, messages FROM {schema}.expire_queues();
