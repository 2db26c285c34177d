-- Runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description" (sql/__init__.py).
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- {@name} includes the block of that name, from any of the runtime files.
-- Publishing: the inserts of one or many messages, routed or not, and the NOTIFYs that wake
-- their consumers (where each NOTIFY goes: Store._notify_placement).

-- wake: (fragment, included as {@wake} in the select list over a CTE i of inserted rows with queue and status) the NOTIFY of one inserted message of a single-message publish: its queue if pending, else its due time (run_at) on the scheduled channel; run_at comes from the input, as a publisher role may not read it (grants.py)
CASE WHEN i.status = 'pending' THEN pg_notify(%(channel)s, i.queue)
     ELSE pg_notify(%(scheduled_channel)s, extract(epoch FROM %(run_at)s::timestamptz)::text) END

-- name_it: (fragment, included as {@name_it} in the select list before {@wake}, over a relation i of one inserted message with queue and status, and the message's id and slot as id and slot, id NULL to name none) the notification that names a pending message, sent before the one {@wake} sends: its queue, id and slot, separated by U+001F (poller.heard reads the last two parts, so a queue's name may hold the separator), so that an idle consumer takes that message by its id (take_announced) rather than looking for it. A worker of an earlier version takes the payload for the name of a queue it does not consume and ignores it; it is woken by the plain one that follows, which a worker of this version drops (poller.py)
CASE WHEN i.status = 'pending' AND i.id IS NOT NULL
     THEN pg_notify(%(channel)s, i.queue || chr(31) || i.id || chr(31) || i.slot) END

-- publish: insert one message, priority clamped to the queue's x-max-priority, TTL from the message or the queue; wakes the queue's consumers at commit, naming the message (a scheduled message announces its due time instead); returns the id (no row, no NOTIFY: its unique key is held)
WITH q AS (SELECT max_priority, message_ttl FROM {schema}.queues WHERE name = %(queue)s),
i AS ({@insert_one}
    RETURNING id, queue, status)
SELECT i.id, {@name_it}, {@wake}
  FROM (SELECT i.id, i.queue, i.status, r.slot
          FROM i CROSS JOIN {schema}.jobs_rotation AS r) AS i;

-- insert_message: as publish without its NOTIFY, which goes where Store._notify_placement puts it: announce_many after a caller's commit; returns the id and the slot (no row: its unique key is held)
WITH q AS (SELECT max_priority, message_ttl FROM {schema}.queues WHERE name = %(queue)s),
i AS ({@insert_one}
    RETURNING id)
SELECT i.id, r.slot
  FROM i CROSS JOIN {schema}.jobs_rotation AS r;

-- insert_noting: insert_message for announce in a transaction of its own right after this one, in the same round trip (a durable publish on the store's own connection, so that PostgreSQL's cluster-wide NOTIFY lock is not held while this commit waits for its WAL flush): announce is sent before this reply arrives, so the message's id and slot are left in the session's setting pgskip.announced, behind note_key, for announce to name the message (a setting needs no privilege, where currval of the id sequence would); returns the id (no row, nothing noted: its unique key is held)
WITH q AS (SELECT max_priority, message_ttl FROM {schema}.queues WHERE name = %(queue)s),
i AS ({@insert_one}
    RETURNING id)
SELECT i.id, set_config('pgskip.announced', %(note_key)s || ':' || i.id || ':' || r.slot, false)
  FROM i CROSS JOIN {schema}.jobs_rotation AS r;

-- announce: the NOTIFYs of one message written by insert_noting, those publish sends, from the message's own values (the publisher knows them) and the id and slot insert_noting left behind note_key (none named if that insert wrote nothing: its key is not there). A transaction that only notifies writes no WAL of its own, so its commit does not wait for a flush
SELECT {@name_it}, {@wake}
  FROM (SELECT %(queue)s::text AS queue, %(status)s::text AS status,
               CASE WHEN split_part(n.noted, ':', 1) = %(note_key)s
                    THEN split_part(n.noted, ':', 2) END AS id,
               split_part(n.noted, ':', 3) AS slot
          FROM (SELECT current_setting('pgskip.announced', true) AS noted) AS n) AS i;

-- announce_many: the NOTIFYs owed for messages written without theirs (insert_many right before it, in the same round trip; insert_message and insert_many in a caller's transaction, after its commit), as {@wake} and publish_many send them: one per queue given (queues with a pending message), each after the one that names the queue's message ({@name_it}) where ids and slots give it (a queue that got one message, from insert_message; NULL otherwise), and the earliest due time of the scheduled ones (run_at, NULL if none) on the scheduled channel; one transaction that writes no WAL
SELECT {@name_it}, pg_notify(%(channel)s, i.queue)
  FROM (SELECT q.queue, 'pending'::text AS status, q.id, q.slot
          FROM unnest(%(queues)s::text[], %(ids)s::bigint[], %(slots)s::int[])
               AS q(queue, id, slot)) AS i
UNION ALL
SELECT NULL, pg_notify(%(scheduled_channel)s, extract(epoch FROM %(run_at)s::timestamptz)::text)
 WHERE %(run_at)s::timestamptz IS NOT NULL;

-- insert_one: (fragment, included as {@insert_one} after a CTE q of the queue's max_priority and message_ttl) the insert of publish (a TTL, the message's or the queue's, counts from when the message is due: a countdown longer than the TTL is not dropped before it is due; nothing is written when another message of the queue holds its unique key, pending, scheduled or running: the claim trigger of jobs refuses the row, migration 0026), to be followed by RETURNING id, and queue, status where {@wake} reads them in the same statement (only columns a publisher role may read)
INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at,
                           unique_key, concurrency_key, slot)
SELECT %(queue)s,
       LEAST(%(priority)s, COALESCE((SELECT max_priority FROM q), 255)),
       %(status)s::{schema}.job_status,
       COALESCE(%(run_at)s::timestamptz, now()),
       %(payload)s::json,
       %(task_name)s,
       %(task_id)s,
       GREATEST(now(), %(run_at)s::timestamptz)
         + make_interval(secs => LEAST(%(ttl_ms)s::bigint, (SELECT message_ttl FROM q)) / 1000.0),
       %(unique_key)s,
       %(concurrency_key)s,
       (SELECT slot FROM {schema}.jobs_rotation)

-- release_unique_key: the messages of task task_id that hold unique key key in queue (pending, scheduled or running) give it up, so that the task's retry, published in the same transaction, takes it: the key's claim then names a message without the key, and the retry's claim takes it over (Store.take_over_unique_key; a worker role's statement)
UPDATE {schema}.jobs
   SET unique_key = NULL
 WHERE queue = %(queue)s AND unique_key = %(key)s AND task_id = %(task_id)s
   AND status IN ('pending', 'scheduled', 'running')
RETURNING id;

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

-- insert_many: as publish_many without its NOTIFYs, which announce_many sends where Store._notify_placement puts them: in a transaction of its own right after this one, or after a caller's commit; returns the ids in order
WITH {@many_rows}
SELECT i.id FROM i ORDER BY i.id;

-- many_rows: (fragment, included as {@many_rows} after WITH) the CTEs m (the rows given, numbered: their columns from the JSON array, their payloads split apart) and i (their insert, RETURNING id, queue, status) of publish_many and insert_many. The payloads are not in the JSON array: the server would parse each twice there (the array, then the json column), a third of the statement's CPU
m AS MATERIALIZED (
    SELECT *
      FROM ROWS FROM (json_to_recordset(%(rows)s::json)
                      AS (queue text, priority integer, status text, run_at timestamptz,
                          task_name text, task_id text, ttl_ms bigint, concurrency_key text),
                      unnest(string_to_array(%(payloads)s, chr(30))))
           WITH ORDINALITY AS m(queue, priority, status, run_at, task_name, task_id, ttl_ms,
                                concurrency_key, payload, n)
), i AS (
    INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at,
                               concurrency_key, slot)
    SELECT m.queue,
           LEAST(m.priority, COALESCE(q.max_priority, 255)),
           m.status::{schema}.job_status,
           COALESCE(m.run_at, now()),
           m.payload::json,
           m.task_name,
           m.task_id,
           GREATEST(now(), m.run_at) + make_interval(secs => LEAST(m.ttl_ms, q.message_ttl) / 1000.0),
           m.concurrency_key,
           (SELECT slot FROM {schema}.jobs_rotation)
      FROM m
      LEFT JOIN {schema}.queues AS q ON q.name = m.queue
     ORDER BY m.n
    -- Only columns a publisher role may read (grants.py): the due time comes from the input.
    RETURNING id, queue, status
)

-- publish_routed: insert one message into every live queue the exchange routes routing_key to (bindings of all processes, plus the queues this process bound), waking their consumers as publish does (naming each message); returns the queues written to
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
    INSERT INTO {schema}.jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at,
                               concurrency_key, slot)
    SELECT live.queue,
           LEAST(%(priority)s, COALESCE(live.max_priority, 255)),
           %(status)s::{schema}.job_status,
           COALESCE(%(run_at)s::timestamptz, now()),
           %(payload)s::json,
           %(task_name)s,
           %(task_id)s,
           GREATEST(now(), %(run_at)s::timestamptz)
             + make_interval(secs => LEAST(%(ttl_ms)s::bigint, live.message_ttl) / 1000.0),
           %(concurrency_key)s,
           (SELECT slot FROM {schema}.jobs_rotation)
      FROM live
    RETURNING id, queue, status
)
SELECT i.queue, {@name_it}, {@wake}
  FROM (SELECT i.id, i.queue, i.status, (SELECT slot FROM {schema}.jobs_rotation) AS slot
          FROM i) AS i;
