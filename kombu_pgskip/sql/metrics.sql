-- SQL of the Prometheus collector (kombu_pgskip.metrics), as named blocks: "-- name: description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- Every statement runs on each scrape, so each reads only what its partial index covers: the
-- completed rows, most of a large table, are never read.

-- queue_counts: per status (pending, scheduled, running, failed) and queue: messages, how many of them were delivered before (redelivered), and for pending the seconds since the first in delivery order took its place in the queue (its run_at: its publish, a countdown's too since migration 0020, or its retry); each branch reads only the rows of its status through that status's partial index (jobs_dequeue, jobs_scheduled, jobs_running_rows, jobs_failed)
SELECT 'pending' AS status, queue, count(*) AS messages,
       count(*) FILTER (WHERE redelivered) AS redelivered,
       greatest(extract(epoch FROM now() - min(run_at)), 0)::float8 AS oldest_age
  FROM {schema}.jobs
 WHERE status = 'pending'
 GROUP BY queue
UNION ALL
SELECT 'scheduled', queue, count(*), 0, NULL
  FROM {schema}.jobs
 WHERE status = 'scheduled'
 GROUP BY queue
UNION ALL
SELECT 'running', queue, count(*), count(*) FILTER (WHERE redelivered), NULL
  FROM {schema}.jobs
 WHERE status = 'running'
 GROUP BY queue
UNION ALL
SELECT 'failed', queue, count(*), 0, NULL
  FROM {schema}.jobs
 WHERE status = 'failed'
 GROUP BY queue;

-- declared_queues: the queues declared durable and without auto_delete or x-expires (those a deployment keeps, not Celery's per-worker pidbox and event queues), so that their series read 0 rather than vanish when they are empty
SELECT name FROM {schema}.queues WHERE NOT auto_delete AND expires IS NULL ORDER BY name;

-- paused_queues: the queues paused for every worker (pgskip pause, migration 0021)
SELECT name FROM {schema}.paused_queues;

-- queue_limits: the limits of the queues limited for every worker (pgskip limit, migration 0025): (name, max_running, max_running_per_key, rate), NULL where not set
SELECT name, max_running, max_running_per_key, rate FROM {schema}.queue_limits;

-- consumer_counts: consumers whose lease holds (alive) and consumers whose lease has run out and that no sweep has removed yet (their running messages return to pending at the next sweep)
SELECT count(*) FILTER (WHERE lease_until > now()),
       count(*) FILTER (WHERE lease_until <= now())
  FROM {schema}.consumers;

-- queue_consumers: per queue, the consumers whose lease holds that consume it
SELECT q.queue, count(*)
  FROM {schema}.consumers AS c
 CROSS JOIN LATERAL unnest(c.queues) AS q(queue)
 WHERE c.lease_until > now()
 GROUP BY q.queue;

-- jobs_table: the jobs table's size on disk with its indexes and TOAST (bytes), and from the statistics collector its live and dead row versions, rows inserted since the statistics were reset, and when autovacuum last vacuumed it, each over its partitions (migration 0027: the slots and jobs_kept; a slot emptied has none); no row when the table does not exist
SELECT sum(pg_total_relation_size(s.relid))::bigint, sum(s.n_live_tup)::bigint,
       sum(s.n_dead_tup)::bigint, sum(s.n_tup_ins)::bigint,
       extract(epoch FROM max(s.last_autovacuum))::float8
  FROM pg_stat_all_tables AS s
 WHERE s.relid IN (SELECT t.relid
                     FROM pg_partition_tree(to_regclass(format('%%I.jobs', %(schema)s::text))) AS t
                    WHERE t.isleaf)
HAVING count(*) > 0;

-- ring_blocked_seconds: seconds since rotations of jobs' slots were first refused the lock of a slot they would empty (migration 0028), NULL while they get their locks
SELECT extract(epoch FROM now() - blocked_since)::float8 FROM {schema}.jobs_rotation;
