-- Runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description" (sql/__init__.py).
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- {@name} includes the block of that name, from any of the runtime files.
-- Queues, exchanges and bindings: declarations (AMQP semantics: the first declaration fixes a
-- queue's arguments), liveness, routing, sizes, the scheduled messages of a queue, and deletion.

-- declare_queue: create a queue, or refresh the x-expires clock of one declared with the same settings (auto_delete, x-max-priority, x-message-ttl, x-expires: AMQP fixes them at the first declaration); returns its name, and no row when the stored settings differ (nothing changed; queue_declaration reads them)
INSERT INTO {schema}.queues AS q (name, durable, auto_delete, arguments, max_priority, message_ttl, expires)
VALUES (%(name)s, %(durable)s, %(auto_delete)s, %(arguments)s, %(max_priority)s, %(message_ttl)s, %(expires)s)
ON CONFLICT (name) DO UPDATE
   SET last_used_at = now()
 WHERE (q.auto_delete, q.max_priority, q.message_ttl, q.expires)
       IS NOT DISTINCT FROM (EXCLUDED.auto_delete, EXCLUDED.max_priority, EXCLUDED.message_ttl, EXCLUDED.expires)
RETURNING q.name;

-- queue_declaration: the settings a queue was declared with (no row when it does not exist)
SELECT auto_delete, max_priority, message_ttl, expires FROM {schema}.queues WHERE name = %(name)s;

-- live: (fragment, included as {@live} in a condition over a row q with the columns name, expires and last_used_at of queues) whether queue q is live: it has no x-expires, was used within it, or a consumer whose lease holds consumes it (the SQL function expire_queues(), which pg_cron calls, restates it)
(q.expires IS NULL
 OR q.last_used_at + q.expires * interval '1 millisecond' > now()
 OR EXISTS (SELECT 1 FROM {schema}.consumers AS c
             WHERE q.name = ANY (c.queues) AND c.lease_until > now()))

-- has_queue: is the queue declared (and not expired)
SELECT EXISTS (
    SELECT 1 FROM {schema}.queues AS q
     WHERE q.name = %(name)s
       AND {@live}
);

-- delete_queue: drop a queue and its waiting messages; returns how many messages went
WITH q AS (
    DELETE FROM {schema}.queues WHERE name = %(name)s RETURNING name
), d AS (
    DELETE FROM {schema}.jobs WHERE queue = %(name)s AND status IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM q);

-- delete_unused_queues: auto_delete queues whose last consumer left: drop them, their waiting messages and bindings
WITH gone AS (
    DELETE FROM {schema}.queues AS q
     WHERE q.name = ANY(%(names)s::text[]) AND q.auto_delete
       AND NOT EXISTS (SELECT 1 FROM {schema}.consumers AS c
                        WHERE q.name = ANY (c.queues) AND c.id <> %(consumer)s
                          AND c.lease_until > now())
    RETURNING q.name
), d AS (
    DELETE FROM {schema}.jobs AS j
     USING gone
     WHERE j.queue = gone.name AND j.status IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM d);

-- purge: delete every waiting (pending or scheduled) message of a queue; returns the exact count
WITH d AS (
    DELETE FROM {schema}.jobs WHERE queue = %(queue)s AND status IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT count(*) FROM d;

-- revoke_waiting: mark the waiting (pending or scheduled) messages of the given task ids failed with the error reason, never to be delivered (a revoke that lasts: kombu_pgskip.control); a message another session has locked (being taken) is skipped; returns (id, task_id, task_name, queue) of each marked
-- Each status is read through its own partial index (jobs_dequeue, jobs_scheduled), so the
-- cost is that of the waiting rows, never of the completed history (no index on task_id is
-- kept for this on the path of every message). (A locking clause is not allowed on a UNION's
-- own branches.)
UPDATE {schema}.jobs AS j
   SET status = 'failed', finished_at = now(), last_error = %(reason)s
 WHERE j.id IN (SELECT p.id FROM (SELECT w.id FROM {schema}.jobs AS w
                                   WHERE w.status = 'pending'
                                     AND w.task_id = ANY (%(task_ids)s::text[])
                                     FOR UPDATE SKIP LOCKED) AS p
                UNION ALL
                SELECT s.id FROM (SELECT w.id FROM {schema}.jobs AS w
                                   WHERE w.status = 'scheduled'
                                     AND w.task_id = ANY (%(task_ids)s::text[])
                                     FOR UPDATE SKIP LOCKED) AS s)
RETURNING j.id, j.task_id, j.task_name, j.queue;

-- size: messages ready for delivery in a queue
SELECT count(*) FROM {schema}.jobs WHERE queue = %(queue)s AND status = 'pending';

-- stored_etas: the scheduled messages (an ETA further away than eta_threshold: they wait here until due) of the given queues that the worker whose consumers are given lists for Celery's inspect scheduled, earliest first, at most limit; a queue's are listed by the consumer of it whose lease holds that registered first (then the lowest id), so that the replies of all the workers name each message once; returns (id, queue, redelivered, payload)
-- Each queue is read in due order through jobs_scheduled (run_at), filtered by queue, until
-- limit rows are found: the cost grows with the scheduled messages of other queues due before
-- them (130-190 ms past 300,000 of them on a 2-core machine); the caller bounds the statement.
WITH mine AS (
    SELECT q.name
      FROM unnest(%(queues)s::text[]) AS q(name)
     WHERE (SELECT c.id
              FROM {schema}.consumers AS c
             WHERE q.name = ANY (c.queues) AND c.lease_until > now()
             ORDER BY c.started_at, c.id
             LIMIT 1) = ANY (%(consumers)s::uuid[])
)
SELECT j.id, j.queue, j.redelivered, j.payload
  FROM mine
 CROSS JOIN LATERAL (
       SELECT s.id, s.queue, s.run_at, s.redelivered, s.payload
         FROM {schema}.jobs AS s
        WHERE s.queue = mine.name AND s.status = 'scheduled'
        ORDER BY s.run_at, s.id
        LIMIT %(limit)s) AS j
 ORDER BY j.run_at, j.id
 LIMIT %(limit)s;

-- pause: pause the given queues for every worker: no fetch takes their messages until resume (a row each in paused_queues, migration 0021); a queue paused already keeps its row and reason; returns the names newly paused
INSERT INTO {schema}.paused_queues (name, reason)
SELECT DISTINCT n.name, %(reason)s::text FROM unnest(%(names)s::text[]) AS n(name)
    ON CONFLICT (name) DO NOTHING
RETURNING name;

-- resume: resume the given paused queues and wake their consumers at commit; returns the names that were paused
WITH r AS (
    DELETE FROM {schema}.paused_queues WHERE name = ANY (%(names)s::text[]) RETURNING name
)
SELECT r.name, pg_notify(%(channel)s, r.name) FROM r;

-- paused: every paused queue, by name: (name, paused_at, paused_by, reason, its pending messages)
SELECT p.name, p.paused_at, p.paused_by, p.reason,
       (SELECT count(*) FROM {schema}.jobs AS j WHERE j.queue = p.name AND j.status = 'pending')
  FROM {schema}.paused_queues AS p
 ORDER BY p.name;

-- paused_for: the paused queues that the given consumers consume: (name, paused_at, paused_by, reason), by name
SELECT p.name, p.paused_at, p.paused_by, p.reason
  FROM {schema}.paused_queues AS p
 WHERE p.name IN (SELECT unnest(c.queues) FROM {schema}.consumers AS c
                   WHERE c.id = ANY (%(ids)s::uuid[]))
 ORDER BY p.name;

-- set_limit: set the limits of a queue for every worker (a row in queue_limits, migration 0025), replacing those it had (a limit not given is not set); the bucket keeps its tokens (at most the new burst); from the commit on, only the limited fetch takes its messages; returns its row as limits does, and whether it had limits before
WITH old AS (
    SELECT name FROM {schema}.queue_limits WHERE name = %(name)s
), l AS (
    INSERT INTO {schema}.queue_limits AS l (name, max_running, max_running_per_key, rate, burst)
    VALUES (%(name)s, %(max_running)s, %(max_running_per_key)s, %(rate)s, %(burst)s)
    ON CONFLICT (name) DO UPDATE
       SET max_running = EXCLUDED.max_running,
           max_running_per_key = EXCLUDED.max_running_per_key,
           rate = EXCLUDED.rate, burst = EXCLUDED.burst,
           tokens = CASE WHEN EXCLUDED.rate IS NOT NULL THEN l.tokens END,
           refilled_at = CASE WHEN EXCLUDED.rate IS NOT NULL THEN l.refilled_at END,
           set_at = now(), set_by = current_user
    RETURNING l.*
)
SELECT l.name, l.max_running, l.max_running_per_key, l.rate,
       CASE WHEN l.rate IS NOT NULL
            THEN coalesce(l.burst, greatest(1, ceil(l.rate))::integer) END, l.set_at, l.set_by,
       (SELECT count(*) FROM {schema}.jobs AS j WHERE j.queue = l.name AND j.status = 'pending'),
       (SELECT count(*) FROM {schema}.jobs AS j WHERE j.queue = l.name AND j.status = 'running'),
       EXISTS (SELECT FROM old)
  FROM l;

-- unlimit: remove the limits of the given queues and wake their consumers at commit (the normal fetch takes their messages again); returns the names that were limited
WITH r AS (
    DELETE FROM {schema}.queue_limits WHERE name = ANY (%(names)s::text[]) RETURNING name
)
SELECT r.name, pg_notify(%(channel)s, r.name) FROM r;

-- limits: every limited queue, by name: (name, max_running, max_running_per_key, rate, burst as the fetch applies it, set_at, set_by, its pending and its running messages)
SELECT l.name, l.max_running, l.max_running_per_key, l.rate,
       CASE WHEN l.rate IS NOT NULL
            THEN coalesce(l.burst, greatest(1, ceil(l.rate))::integer) END, l.set_at, l.set_by,
       (SELECT count(*) FROM {schema}.jobs AS j WHERE j.queue = l.name AND j.status = 'pending'),
       (SELECT count(*) FROM {schema}.jobs AS j WHERE j.queue = l.name AND j.status = 'running')
  FROM {schema}.queue_limits AS l
 ORDER BY l.name;

-- limited_among: which of the given queues are limited (a row each in queue_limits), by name
SELECT name FROM {schema}.queue_limits WHERE name = ANY (%(names)s::text[]) ORDER BY name;

-- limited_for: the limited queues that the given consumers consume: (name, max_running, max_running_per_key, rate, burst as the fetch applies it), by name
SELECT l.name, l.max_running, l.max_running_per_key, l.rate,
       CASE WHEN l.rate IS NOT NULL
            THEN coalesce(l.burst, greatest(1, ceil(l.rate))::integer) END
  FROM {schema}.queue_limits AS l
 WHERE l.name IN (SELECT unnest(c.queues) FROM {schema}.consumers AS c
                   WHERE c.id = ANY (%(ids)s::uuid[]))
 ORDER BY l.name;

-- queue_stats: per-queue counts for operators
SELECT queue,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'scheduled') AS scheduled,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8 AS oldest_pending_age,
       count(*) FILTER (WHERE status = 'completed' AND finished_at > now() - interval '1 minute') AS completed_last_minute
  FROM {schema}.jobs
 GROUP BY queue
 ORDER BY queue;

-- matches: (fragment, included as {@matches} in a condition over a binding b of an exchange e) whether b routes routing_key: every binding of a fanout exchange, the topic bindings whose pattern matches, the direct bindings of that very key
CASE e.type WHEN 'fanout' THEN true
            WHEN 'topic' THEN %(routing_key)s ~ b.pattern
            WHEN 'direct' THEN b.routing_key = %(routing_key)s
            ELSE false END

-- route: the live queues the exchange routes routing_key to, from the bindings of all processes
SELECT b.queue
  FROM {schema}.bindings AS b
  JOIN {schema}.exchanges AS e ON e.name = b.exchange
  JOIN {schema}.queues AS q ON q.name = b.queue
 WHERE b.exchange = %(exchange)s
   AND {@matches}
   AND {@live}
 ORDER BY b.queue;

-- declare_exchange: create an exchange unless one of that name exists; returns its stored type (AMQP: a declaration of another type fails, and changes nothing); no row when another session created it after this statement's snapshot was taken
WITH created AS (
    INSERT INTO {schema}.exchanges (name, type, durable, auto_delete, arguments)
    VALUES (%(name)s, %(type)s, %(durable)s, %(auto_delete)s, %(arguments)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING type
)
SELECT type FROM created
UNION ALL
SELECT type FROM {schema}.exchanges WHERE name = %(name)s AND NOT EXISTS (SELECT 1 FROM created);

-- exchange_type: the type of a declared exchange (no row when undeclared)
SELECT type FROM {schema}.exchanges WHERE name = %(name)s;

-- delete_exchange: drop an exchange and (by the foreign key) its bindings; returns how many exchanges went
WITH e AS (DELETE FROM {schema}.exchanges WHERE name = %(name)s RETURNING 1)
SELECT count(*) FROM e;

-- bind: bind a queue to an exchange (creating either row if another process has not declared it yet); a binding that exists stays as it is (its pattern follows from the routing key)
WITH e AS (
    INSERT INTO {schema}.exchanges (name, type) VALUES (%(exchange)s, %(type)s)
    ON CONFLICT (name) DO NOTHING
), q AS (
    INSERT INTO {schema}.queues (name) VALUES (%(queue)s)
    ON CONFLICT (name) DO UPDATE SET last_used_at = now()
)
INSERT INTO {schema}.bindings (exchange, queue, routing_key, arguments, pattern)
VALUES (%(exchange)s, %(queue)s, %(routing_key)s, %(arguments)s, %(pattern)s)
ON CONFLICT (exchange, queue, routing_key) DO NOTHING;

-- unbind: remove one binding
DELETE FROM {schema}.bindings
 WHERE exchange = %(exchange)s AND queue = %(queue)s AND routing_key = %(routing_key)s;

-- exchange_table: every binding of an exchange as (routing_key, pattern, queue)
SELECT routing_key, pattern, queue FROM {schema}.bindings WHERE exchange = %(exchange)s
 ORDER BY queue, routing_key;

-- unique_keys: the unique keys held, by queue and key: the messages with a key that are pending, scheduled or running (queue, key, status, task_name, task_id, created_at); queue NULL for every queue; at most limit rows. Read from jobs alone: the claims (unique_keys, migration 0026) are the owner's, and a worker role runs this too
SELECT queue, unique_key, status::text, task_name, task_id, created_at
  FROM {schema}.jobs
 WHERE unique_key IS NOT NULL AND status IN ('pending', 'scheduled', 'running')
   AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
 ORDER BY queue, unique_key
 LIMIT %(limit)s;
