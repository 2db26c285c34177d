-- All runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- Every transition out of 'running' is fenced by (locked_by, delivery): a consumer whose lease
-- was taken away, or an ack of an earlier delivery of the same message, changes nothing.

-- wake: (fragment, included as {@wake} in the select list over a CTE i of inserted rows with queue and status) the NOTIFY of one inserted message of a single-message publish: its queue if pending, else its due time (run_at) on the scheduled channel; run_at comes from the input, as a publisher role may not read it (grants.py)
CASE WHEN i.status = 'pending' THEN pg_notify(%(channel)s, i.queue)
     ELSE pg_notify(%(scheduled_channel)s, extract(epoch FROM %(run_at)s::timestamptz)::text) END

-- publish: insert one message, priority clamped to the queue's x-max-priority, TTL from the message or the queue; wakes the queue's consumers at commit (a scheduled message announces its due time instead); returns the id
WITH q AS (SELECT max_priority, message_ttl FROM {schema}.queues WHERE name = %(queue)s),
i AS ({@insert_one}
    RETURNING id, queue, status)
SELECT i.id, {@wake}
  FROM i;

-- insert_message: as publish without its NOTIFY, for a durable publish: Store.publish sends announce in a transaction of its own right after this one, in the same round trip, so that PostgreSQL's cluster-wide NOTIFY lock is not held while this commit waits for its WAL flush; returns the id
WITH q AS (SELECT max_priority, message_ttl FROM {schema}.queues WHERE name = %(queue)s),
i AS ({@insert_one}
    RETURNING id)
SELECT i.id
  FROM i;

-- announce: the NOTIFY of one message written by insert_message, the one {@wake} sends for publish, from the message's own values (the publisher knows them). A transaction that only notifies writes no WAL of its own, so its commit does not wait for a flush
SELECT {@wake}
  FROM (SELECT %(queue)s::text AS queue, %(status)s::text AS status) AS i;

-- announce_many: the NOTIFYs owed, after a caller's commit, for the messages its transaction wrote without theirs (insert_message, insert_many), as {@wake} and publish_many send them: one per queue given (queues with a pending message), and the earliest due time of the scheduled ones (run_at, NULL if none) on the scheduled channel; one transaction that writes no WAL
SELECT pg_notify(%(channel)s, i.queue)
  FROM unnest(%(queues)s::text[]) AS i(queue)
UNION ALL
SELECT pg_notify(%(scheduled_channel)s, extract(epoch FROM %(run_at)s::timestamptz)::text)
 WHERE %(run_at)s::timestamptz IS NOT NULL;

-- insert_one: (fragment, included as {@insert_one} after a CTE q of the queue's max_priority and message_ttl) the insert of publish, to be followed by RETURNING id, and queue, status where {@wake} reads them in the same statement (only columns a publisher role may read)
INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at)
SELECT %(queue)s,
       LEAST(%(priority)s, COALESCE((SELECT max_priority FROM q), 255)),
       %(status)s::{schema}.job_status,
       COALESCE(%(run_at)s::timestamptz, now()),
       %(payload)s::json,
       %(task_name)s,
       %(task_id)s,
       now() + make_interval(secs => LEAST(%(ttl_ms)s::bigint, (SELECT message_ttl FROM q)) / 1000.0)

-- publish_many: insert many messages in one statement, given as one JSON array of their columns (queue, priority, status, run_at, task_name, task_id, ttl_ms) and their payloads as one text, in the same order, separated by U+001E (which JSON text cannot hold unescaped); priority clamped, TTL applied and consumers woken as publish does; returns the ids in order
WITH {@many_rows}, woken AS (
    SELECT pg_notify(%(channel)s, d.queue)
      FROM (SELECT DISTINCT queue FROM i WHERE status = 'pending') AS d
    UNION ALL
    SELECT pg_notify(%(scheduled_channel)s, extract(epoch FROM min(m.run_at))::text)
      FROM m WHERE m.status = 'scheduled' HAVING count(*) > 0
)
-- Identity values follow insertion order, so ORDER BY id returns them as the rows were given.
SELECT i.id FROM i WHERE (SELECT count(*) FROM woken) >= 0 ORDER BY i.id;

-- insert_many: as publish_many without its NOTIFYs, for apply_many_in on Django, whose NOTIFYs go after the caller's commit (announce_many); returns the ids in order
WITH {@many_rows}
SELECT i.id FROM i ORDER BY i.id;

-- many_rows: (fragment, included as {@many_rows} after WITH) the CTEs m (the rows given, numbered: their columns from the JSON array, their payloads split apart) and i (their insert, RETURNING id, queue, status) of publish_many and insert_many. The payloads are not in the JSON array: the server would parse each twice there (the array, then the json column), a third of the statement's CPU
m AS MATERIALIZED (
    SELECT *
      FROM ROWS FROM (json_to_recordset(%(rows)s::json)
                      AS (queue text, priority integer, status text, run_at timestamptz,
                          task_name text, task_id text, ttl_ms bigint),
                      unnest(string_to_array(%(payloads)s, chr(30))))
           WITH ORDINALITY AS m(queue, priority, status, run_at, task_name, task_id, ttl_ms,
                                payload, n)
), i AS (
    INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at)
    SELECT m.queue,
           LEAST(m.priority, COALESCE(q.max_priority, 255)),
           m.status::{schema}.job_status,
           COALESCE(m.run_at, now()),
           m.payload::json,
           m.task_name,
           m.task_id,
           now() + make_interval(secs => LEAST(m.ttl_ms, q.message_ttl) / 1000.0)
      FROM m
      LEFT JOIN {schema}.queues AS q ON q.name = m.queue
     ORDER BY m.n
    -- Only columns a publisher role may read (grants.py): the due time comes from the input.
    RETURNING id, queue, status
)

-- due: (fragment, included as {@due}) up to limit due messages of the given queues, locked, round-robin across queues in delivery order, and only while the payloads before a message total less than max_bytes (so the first one is always taken, however large); budget_full is true on the last one when the budget left a due message behind. Rows locked here but not taken stay pending when the statement ends
-- Payload bytes: pg_column_size reads only the varlena header or the TOAST pointer, and for a
-- value stored uncompressed that is its length (to within a header of at most 4 bytes). A
-- compressed value's header holds its raw length too, but no function over json reads it: json
-- has no binary-coercible cast to text (pg_cast has no json -> text row, so payload::text is an
-- I/O conversion, json_out then textin, which detoasts and copies the whole value twice: 4 ms
-- for 8 MB), and pg_column_size of a compressed value is what it takes on disk, a fraction of
-- what the worker receives. So only compressed values are measured through the cast, and only
-- as far as the budget goes: past only grows, and a window function that only grows compared
-- with a constant is a run condition (PostgreSQL 15), which stops the WindowAgg at the first
-- message past the budget. The sizes are then computed for the messages taken and one more
-- (which the stop reads ahead), not for every message locked.
SELECT b.id, b.priority, b.rn, coalesce(b.next_before >= %(max_bytes)s::bigint, false) AS budget_full
  FROM (SELECT s.id, s.priority, s.rn,
               count(*) FILTER (WHERE s.bytes_before >= %(max_bytes)s::bigint) OVER w AS past,
               lead(s.bytes_before) OVER w AS next_before
          FROM (SELECT c.id, c.priority, c.rn,
                       sum(CASE WHEN c.packed IS NULL THEN c.stored
                                ELSE octet_length(c.packed::text) END)
                           OVER (ORDER BY c.priority DESC, c.rn, c.id
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS bytes_before
                  FROM (SELECT x.id, x.priority, x.stored, x.packed,
                               row_number() OVER (PARTITION BY x.queue ORDER BY x.priority DESC, x.run_at, x.id) AS rn
                          FROM unnest(%(queues)s::text[]) AS q(name)
                          CROSS JOIN LATERAL (
                                SELECT id, queue, priority, run_at, pg_column_size(payload) AS stored,
                                       CASE WHEN pg_column_compression(payload) IS NOT NULL
                                            THEN payload END AS packed
                                  FROM {schema}.jobs
                                 WHERE jobs.queue = q.name
                                   AND status = 'pending'
                                   AND run_at <= now()
                                   AND (expires_at IS NULL OR expires_at > now())
                                 ORDER BY priority DESC, run_at, id
                                 LIMIT %(limit)s
                                   FOR UPDATE SKIP LOCKED
                          ) AS x
                         -- id last: a total order, which the running sum above follows
                         ORDER BY x.priority DESC, rn, x.id
                         LIMIT %(limit)s) AS c) AS s
        WINDOW w AS (ORDER BY s.priority DESC, s.rn, s.id ROWS UNBOUNDED PRECEDING)) AS b
 -- <= 0, not = 0: PostgreSQL applies it as the run condition alone and still estimates limit
 -- rows here; an equality stays a filter too, estimated to let one row in 200 through, and take
 -- then joins the rows to jobs by a nested loop (5 ms instead of 1 for 100 messages).
 WHERE b.past <= 0

-- take: (fragment, included as {@take} after a CTE named picked) mark the picked rows running under the consumer and stamp this delivery's token; returns what a consumer needs; the rows are looked up by id (= ANY), which a generic plan, estimating a tenth of the table for an unknown LIMIT, would otherwise hash-join by scanning the whole table
-- The token (delivery, migration 0013) fences every transition out of this delivery
-- (ack_fence, requeue, fail): the id of the transaction taking the row, 64 bits with its epoch
-- and never reused, so no other delivery of the row carries it, whereas attempts (reset by
-- retry-failed) and locked_by (a consumer keeps its id when it registers again) can repeat.
-- Every fetch of the transport is a transaction of its own, which takes a row at most once.
UPDATE {schema}.jobs AS jobs
   SET status = 'running', locked_by = %(consumer)s, locked_at = now(), attempts = jobs.attempts + 1,
       delivery = (SELECT pg_current_xact_id()::text::bigint)
  FROM picked
 WHERE jobs.id = picked.id
   AND jobs.id = ANY (ARRAY(SELECT id FROM picked))
RETURNING jobs.id, jobs.queue, jobs.payload, jobs.redelivered, jobs.attempts, jobs.expires_at,
          picked.priority, picked.rn, jobs.delivery, picked.budget_full

-- fetch: take up to limit due messages (and max_bytes of payload, at least one message) from the given queues, round-robin across queues, mark them running
WITH picked AS ({@due})
{@take};

-- ack_fetch: ack delivered messages (fenced, as ack) and fetch (as fetch) in one round trip; every row starts with how many acks were still ours, and a lone row with no message says nothing was due; every row ends with whether a due message waits in one of the queues urgent (the no-ack queues of remote control and events, which the event loop fetches on their notification, the poll, or this saying so: Transport._deliver_urgent), read in the fetch's own snapshot, one probe of the dequeue index per queue (ordered as that index: the generic plan, estimating that most rows match, would otherwise scan the table)
WITH acked AS ({@ack}), {@fetch_after_ack};

-- ack_delete_fetch: as ack_fetch, with the acks deleting their messages (ack_delete) instead of marking them completed: the transport option keep_completed=False
WITH acked AS ({@ack_delete}), {@fetch_after_ack};

-- fetch_after_ack: (fragment, included as {@fetch_after_ack} after a CTE named acked that returns one row per ack still ours) the fetch of ack_fetch and the row it returns
picked AS ({@due}), taken AS ({@take})
SELECT a.n, t.id, t.queue, t.payload, t.redelivered, t.attempts, t.expires_at, t.priority, t.rn,
       t.delivery, t.budget_full, a.urgent
  FROM (SELECT count(*) AS n,
               EXISTS (SELECT 1
                         FROM unnest(%(urgent)s::text[]) AS uq(name)
                        CROSS JOIN LATERAL (
                              SELECT 1
                                FROM {schema}.jobs AS u
                               WHERE u.queue = uq.name
                                 AND u.status = 'pending'
                                 AND u.run_at <= now()
                                 AND (u.expires_at IS NULL OR u.expires_at > now())
                               ORDER BY u.priority DESC, u.run_at, u.id
                               LIMIT 1) AS w) AS urgent
          FROM acked) AS a
  LEFT JOIN taken AS t ON true

-- fetch_noack: take and delete up to limit due messages (and max_bytes of payload, at least one message; no-ack consumers: remote control, events); their delivery token is 0, as nothing settles them
WITH picked AS ({@due})
DELETE FROM {schema}.jobs AS jobs
 USING picked
 WHERE jobs.id = picked.id
RETURNING jobs.id, jobs.queue, jobs.payload, jobs.redelivered, jobs.attempts + 1, jobs.expires_at,
          picked.priority, picked.rn, 0::bigint, picked.budget_full;

-- ack: mark delivered messages completed (fenced); ids[k] was delivered with the token deliveries[k]. Rows are found by id and their tokens looked up in the array, not joined to unnest(): a prepared statement's generic plan, which cannot know the arrays' sizes, then still reads each row once
UPDATE {schema}.jobs AS jobs
   SET status = 'completed', finished_at = now(), locked_by = NULL
 WHERE {@ack_fence}
RETURNING jobs.id;

-- ack_delete: as ack, deleting the acknowledged messages instead of marking them completed (transport option keep_completed=False: no completed rows, nothing for the prune job; one dead row version less per message, and none of a kilobyte kept for the retention period)
DELETE FROM {schema}.jobs AS jobs
 WHERE {@ack_fence}
RETURNING jobs.id;

-- ack_fence: (fragment, included as {@ack_fence} in the WHERE of ack and ack_delete over jobs AS jobs) the delivered messages ids[k] in the delivery that take stamped with the token deliveries[k], only while still running under consumer
jobs.id = ANY (%(ids)s::bigint[])
   AND jobs.delivery = (%(deliveries)s::bigint[])[array_position(%(ids)s::bigint[], jobs.id)]
   AND jobs.locked_by = %(consumer)s AND jobs.status = 'running'

-- requeue: return delivered messages to pending (fenced by their delivery tokens, as ack), or to failed past max_attempts deliveries
WITH r AS (
    UPDATE {schema}.jobs AS jobs
       SET status = CASE WHEN jobs.attempts >= %(max_attempts)s THEN 'failed'
                         ELSE 'pending' END::{schema}.job_status,
           redelivered = true, locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.attempts >= %(max_attempts)s THEN now() END,
           last_error = CASE WHEN jobs.attempts >= %(max_attempts)s
                             THEN 'requeued after ' || jobs.attempts || ' deliveries (max_attempts)'
                             ELSE jobs.last_error END
      FROM unnest(%(ids)s::bigint[], %(deliveries)s::bigint[]) AS a(id, delivery)
     WHERE jobs.id = a.id AND jobs.delivery = a.delivery
       AND jobs.locked_by = %(consumer)s AND jobs.status = 'running'
    RETURNING jobs.id, jobs.queue, jobs.status
), n AS (
    SELECT pg_notify(%(channel)s, d.queue)
      FROM (SELECT DISTINCT queue FROM r WHERE status = 'pending') AS d
)
SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM r WHERE status = 'failed'),
       (SELECT count(*) FROM n);

-- fail: move delivered messages to failed with a reason (fenced by their delivery tokens, as ack; reject without requeue)
UPDATE {schema}.jobs AS jobs
   SET status = 'failed', finished_at = now(), locked_by = NULL, last_error = %(error)s
  FROM unnest(%(ids)s::bigint[], %(deliveries)s::bigint[]) AS a(id, delivery)
 WHERE jobs.id = a.id AND jobs.delivery = a.delivery
   AND jobs.locked_by = %(consumer)s AND jobs.status = 'running'
RETURNING jobs.id;

-- register_consumer: create or refresh a consumer and its lease
INSERT INTO {schema}.consumers (id, hostname, pid, queues, lease_until)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(queues)s, now() + make_interval(secs => %(lease)s))
ON CONFLICT (id) DO UPDATE
   SET lease_until = EXCLUDED.lease_until, heartbeat_at = now(), queues = EXCLUDED.queues;

-- renew_consumers: extend the leases of live consumers and mark their expiring queues used; returns the ids still known
WITH c AS (
    UPDATE {schema}.consumers
       SET lease_until = now() + make_interval(secs => %(lease)s), heartbeat_at = now()
     WHERE id = ANY(%(ids)s::uuid[])
    RETURNING id, queues
), used AS (
    UPDATE {schema}.queues SET last_used_at = now()
     WHERE expires IS NOT NULL AND name IN (SELECT unnest(queues) FROM c)
    RETURNING 1
)
SELECT id FROM c;

-- unregister_consumer: a consumer leaves: what it still holds goes back to pending, its row goes
WITH c AS (
    DELETE FROM {schema}.consumers WHERE id = %(id)s RETURNING id, queues
), used AS (
    -- x-expires counts from when the queue was last used
    UPDATE {schema}.queues SET last_used_at = now()
     WHERE expires IS NOT NULL AND name IN (SELECT unnest(queues) FROM c)
    RETURNING 1
), r AS (
    UPDATE {schema}.jobs
       SET status = 'pending', redelivered = true, locked_by = NULL, locked_at = NULL
     WHERE locked_by = %(id)s AND status = 'running'
    RETURNING queue
), n AS (
    SELECT pg_notify(%(channel)s, d.queue) FROM (SELECT DISTINCT queue FROM r) AS d
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM r), (SELECT count(*) FROM n);

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

-- purge: delete every waiting (pending or scheduled) message of a queue; returns the exact count
WITH d AS (
    DELETE FROM {schema}.jobs WHERE queue = %(queue)s AND status IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT count(*) FROM d;

-- size: messages ready for delivery in a queue
SELECT count(*) FROM {schema}.jobs WHERE queue = %(queue)s AND status = 'pending';

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

-- publish_routed: insert one message into every live queue the exchange routes routing_key to (bindings of all processes, plus the queues this process bound), waking their consumers as publish does; returns the queues written to
WITH targets AS (
    SELECT t.queue FROM unnest(%(queues)s::text[]) AS t(queue)
    UNION
    SELECT b.queue
      FROM {schema}.bindings AS b
      JOIN {schema}.exchanges AS e ON e.name = b.exchange
     WHERE b.exchange = %(exchange)s
       AND {@matches}
), known AS (
    SELECT t.queue AS name, q.name IS NOT NULL AS declared, q.max_priority, q.message_ttl,
           q.expires, q.last_used_at
      FROM targets AS t
      LEFT JOIN {schema}.queues AS q ON q.name = t.queue
), live AS (
    -- A queue nobody declared yet is live, as with Redis.
    SELECT q.name AS queue, q.max_priority, q.message_ttl
      FROM known AS q
     WHERE NOT q.declared OR {@live}
), i AS (
    INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at)
    SELECT live.queue,
           LEAST(%(priority)s, COALESCE(live.max_priority, 255)),
           %(status)s::{schema}.job_status,
           COALESCE(%(run_at)s::timestamptz, now()),
           %(payload)s::json,
           %(task_name)s,
           %(task_id)s,
           now() + make_interval(secs => LEAST(%(ttl_ms)s::bigint, live.message_ttl) / 1000.0)
      FROM live
    RETURNING queue, status
)
SELECT i.queue, {@wake}
  FROM i;

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

-- expire_queues: delete queues with x-expires unused for that long (see the SQL function); returns (queues, messages)
SELECT queues, messages FROM {schema}.expire_queues();
