-- Runtime SQL of kombu-pgskip, as named blocks: "-- name: one-line description" (sql/__init__.py).
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- {@name} includes the block of that name, from any of the runtime files.
-- Consuming: the fetch (due messages locked with SKIP LOCKED, marked running under a consumer
-- with a fresh delivery token), acks, requeues and rejects, and the consumers' leases.
-- Every transition out of 'running' is fenced by (locked_by, delivery): a consumer whose lease
-- was taken away, or an ack of an earlier delivery of the same message, changes nothing.

-- due: (fragment, included as {@due}) up to limit due messages of the given queues, locked, round-robin across queues in delivery order, and only while the payloads before a message total less than max_bytes (so the first one is always taken, however large); budget_full is true on the last one when the budget left a due message behind. Rows locked here but not taken stay pending when the statement ends. Each queue's scan starts after the position (after_priority, after_run_at, after_id) given for it, in delivery order; (32767, '-infinity', 0) starts at the beginning
-- Where each scan starts. A row taken leaves its pending version behind as a dead entry at the
-- front of the dequeue index, and while any session holds a snapshot older than the take (a
-- pg_dump, a long report, a transaction left open) no such entry can be removed or marked dead,
-- so a scan from the beginning reads every one of them, and the row each points to, before it
-- reaches a due message. A scan after the position of the last message a consumer took skips
-- those entries. Its first branch walks the rest of that message's priority level from just
-- after it, its second the lower levels from their beginning (within a queue the index is
-- ordered priority DESC, run_at, id, so "after" is not one range of it). A message that becomes
-- due behind the position (a publish that committed after a later one was taken, a message
-- returned to the queue, a promoted one, a higher priority) is found by the next scan from the
-- beginning, which the consumer sends often enough (policy.FULL_SCAN_SPACING).
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
                          FROM unnest(%(queues)s::text[], %(after_priority)s::int[],
                                      %(after_run_at)s::timestamptz[], %(after_id)s::bigint[])
                               AS q(name, after_priority, after_run_at, after_id)
                          CROSS JOIN LATERAL (
                                -- (a locking clause is not allowed on a UNION's own branches)
                                SELECT * FROM (
                                 SELECT {@due_row}
                                    AND jobs.priority = q.after_priority
                                    AND (jobs.run_at, jobs.id) > (q.after_run_at, q.after_id)
                                  ORDER BY run_at, id
                                  LIMIT %(limit)s
                                    FOR UPDATE SKIP LOCKED) AS same_level
                                UNION ALL
                                SELECT * FROM (
                                 SELECT {@due_row}
                                    AND jobs.priority < q.after_priority
                                  ORDER BY priority DESC, run_at, id
                                  LIMIT %(limit)s
                                    FOR UPDATE SKIP LOCKED) AS lower_levels
                          ) AS x
                         -- id last: a total order, which the running sum above follows
                         ORDER BY x.priority DESC, rn, x.id
                         LIMIT %(limit)s) AS c) AS s
        WINDOW w AS (ORDER BY s.priority DESC, s.rn, s.id ROWS UNBOUNDED PRECEDING)) AS b
 -- <= 0, not = 0: PostgreSQL applies it as the run condition alone and still estimates limit
 -- rows here; an equality stays a filter too, estimated to let one row in 200 through, and take
 -- then joins the rows to jobs by a nested loop (5 ms instead of 1 for 100 messages).
 WHERE b.past <= 0

-- due_row: (fragment, included as {@due_row} after SELECT, within due's scan of queue q) a due pending message of the queue, unless the queue is paused (migration 0021) or limited (migration 0025: only fetch_limited takes its messages), each a one-time filter of the scan, one probe of a primary key, with its stored payload size (and its payload when compressed, which due measures only as far as its budget goes), up to the WHERE clause's end, where the scan's bounds follow
id, queue, priority, run_at, pg_column_size(payload) AS stored,
       CASE WHEN pg_column_compression(payload) IS NOT NULL THEN payload END AS packed
  FROM {schema}.jobs
 WHERE jobs.queue = q.name
   AND status = 'pending'
   AND run_at <= now()
   AND (expires_at IS NULL OR expires_at > now())
   AND NOT EXISTS (SELECT FROM {schema}.paused_queues AS pq WHERE pq.name = q.name)
   AND NOT EXISTS (SELECT FROM {schema}.queue_limits AS ql WHERE ql.name = q.name)

-- take: (fragment, included as {@take} after a CTE named picked) mark the picked rows running under the consumer and stamp this delivery's token; returns what a consumer needs, then the due time (as text, which the consumer's connection reads back exactly: with the priority and id, where its next fetch of the queue may start); the rows are looked up by id (= ANY), which a generic plan, estimating a tenth of the table for an unknown LIMIT, would otherwise hash-join by scanning the whole table
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
          picked.priority, picked.rn, jobs.delivery, picked.budget_full, jobs.run_at::text

-- fetch: take up to limit due messages (and max_bytes of payload, at least one message) from the given queues, round-robin across queues, mark them running
WITH picked AS ({@due})
{@take};

-- ack_fetch: ack delivered messages (fenced, as ack) and fetch (as fetch) in one round trip; every row starts with how many acks were still ours, and a lone row with no message says nothing was due; every row ends with the message's due time (as take returns it) after whether a due message waits in one of the queues urgent (the no-ack queues of remote control and events, which the event loop fetches on their notification, the poll, or this saying so: Dispatcher._deliver_urgent), read in the fetch's own snapshot, one probe of the dequeue index per queue (ordered as that index: the generic plan, estimating that most rows match, would otherwise scan the table)
WITH acked AS ({@ack}), {@fetch_after_ack};

-- ack_delete_fetch: as ack_fetch, with the acks deleting their messages (ack_delete) instead of marking them completed: the transport option keep_completed=False
WITH acked AS ({@ack_delete}), {@fetch_after_ack};

-- fetch_after_ack: (fragment, included as {@fetch_after_ack} after a CTE named acked that returns one row per ack still ours) the fetch of ack_fetch and the rows it returns
picked AS ({@due}), {@take_reported}

-- take_announced: the fetch of an idle consumer that answers a notification naming one message (name_it): take that message, by its id, as fetch would if it is still a due pending message of one of the queues (not paused, not limited, not expired), and nothing else: whatever else becomes due is announced too; the consumer runs it on the message's slot alone (AsyncFetcher). No acks; its row, or a lone row saying nothing was taken, as ack_fetch returns them, with whether a due message waits in one of the queues urgent
WITH acked AS (SELECT WHERE false), picked AS (
    SELECT jobs.id, jobs.priority, 1::bigint AS rn, false AS budget_full
      FROM {schema}.jobs
     WHERE jobs.id = %(id)s::bigint
       AND jobs.queue = ANY (%(queues)s::text[])
       AND status = 'pending'
       AND run_at <= now()
       AND (expires_at IS NULL OR expires_at > now())
       AND NOT EXISTS (SELECT FROM {schema}.paused_queues AS pq WHERE pq.name = jobs.queue)
       AND NOT EXISTS (SELECT FROM {schema}.queue_limits AS ql WHERE ql.name = jobs.queue)
       FOR UPDATE SKIP LOCKED
), {@take_reported};

-- take_reported: (fragment, included as {@take_reported} after CTEs named acked, one row per ack still ours, and picked, the rows to take as due picks them) the take and the rows ack_fetch returns
taken AS ({@take})
SELECT a.n, t.id, t.queue, t.payload, t.redelivered, t.attempts, t.expires_at, t.priority, t.rn,
       t.delivery, t.budget_full, a.urgent, t.run_at
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
                                 AND NOT EXISTS (SELECT FROM {schema}.paused_queues AS pq
                                                  WHERE pq.name = uq.name)
                                 AND NOT EXISTS (SELECT FROM {schema}.queue_limits AS ql
                                                  WHERE ql.name = uq.name)
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
          picked.priority, picked.rn, 0::bigint, picked.budget_full, jobs.run_at::text;

-- limit_lock: (the first statement of a limited fetch's transaction, before fetch_limited) lock the queue's row of queue_limits until the transaction ends: the limited fetches of a queue, by every worker, run one after the other, and the next statement's snapshot, taken once the lock is granted, sees the messages every earlier one took; no row when the queue is no longer limited
-- A row lock rather than an advisory lock: only roles that may update queue_limits (workers,
-- the owner) can take it, where any role of the database could hold an advisory key forever,
-- and a change of the limits (pgskip limit, unlimit) waits for the fetch in progress.
SELECT 1 FROM {schema}.queue_limits WHERE name = %(queue)s FOR NO KEY UPDATE;

-- fetch_limited: (after limit_lock, in its transaction) take up to limit due messages of one limited queue (migration 0025), within its limits: no more than max_running minus its running messages, than max_running_per_key minus the running messages of each concurrency key, than the whole tokens of its bucket (refilled at rate per second since refilled_at, holding at most burst, by default max(1, ceil(rate))); mark them running as fetch does, spend the tokens; one row (limited, free, tokens, more, rate) left-joined to the rows taken, as take returns them: limited is false when the queue has no limits (any more), free the running slots left (NULL: no max_running), tokens those left (NULL: no rate), more whether due messages were left behind
-- The running messages are counted through jobs_running_rows (every running message of every
-- queue, a worker's executing and prefetched ones), per key only with a per-key limit. The
-- candidates are read without locks in delivery order, at most window of them with a per-key
-- limit (a key whose messages all lie further on waits until those ahead are taken), only as
-- many as can be taken without: the lock above keeps every other limited fetch of the queue
-- out; the normal fetch skips the queue (due_row). The picked ones are then locked, skipping
-- any another session holds (a revoke, an older worker's fetch), and rechecked as pending.
WITH lim AS (
    SELECT l.max_running, l.max_running_per_key, l.rate,
           CASE WHEN l.rate IS NULL THEN NULL
                ELSE least(coalesce(l.burst, greatest(1, ceil(l.rate)))::float8,
                           coalesce(l.tokens, coalesce(l.burst, greatest(1, ceil(l.rate)))::float8)
                           + l.rate * greatest(0, extract(epoch FROM statement_timestamp()
                                                 - coalesce(l.refilled_at, statement_timestamp()))))
           END AS tokens
      FROM {schema}.queue_limits AS l
     WHERE l.name = %(queue)s
), counted AS MATERIALIZED (
    -- A paused queue (migration 0021) takes nothing: no row here. (Materialized: the running
    -- messages are counted once, not for each reference to free.)
    SELECT lim.*,
           CASE WHEN lim.max_running IS NOT NULL
                THEN greatest(0, lim.max_running - (SELECT count(*) FROM {schema}.jobs AS r
                                                     WHERE r.status = 'running'
                                                       AND r.queue = %(queue)s)) END AS free
      FROM lim
     WHERE NOT EXISTS (SELECT FROM {schema}.paused_queues AS pq WHERE pq.name = %(queue)s)
), budget AS (
    -- least() leaves out the limits that are NULL (not set)
    SELECT counted.*,
           greatest(0, least(%(limit)s::bigint, counted.free, floor(counted.tokens)::bigint)) AS n
      FROM counted
), keys AS (
    SELECT r.concurrency_key AS key, count(*) AS n
      FROM {schema}.jobs AS r
     WHERE r.status = 'running' AND r.queue = %(queue)s AND r.concurrency_key IS NOT NULL
       AND (SELECT max_running_per_key FROM budget WHERE n > 0) IS NOT NULL
     GROUP BY r.concurrency_key
), candidates AS (
    SELECT c.id, c.priority, c.run_at, c.concurrency_key,
           row_number() OVER (PARTITION BY c.concurrency_key
                              ORDER BY c.priority DESC, c.run_at, c.id) AS krank
      FROM (SELECT j.id, j.priority, j.run_at, j.concurrency_key
              FROM {schema}.jobs AS j
             WHERE j.queue = %(queue)s
               AND j.status = 'pending'
               AND j.run_at <= now()
               AND (j.expires_at IS NULL OR j.expires_at > now())
               AND EXISTS (SELECT FROM budget)
             ORDER BY j.priority DESC, j.run_at, j.id
             -- one more than can be taken says whether any was left behind
             LIMIT (SELECT CASE WHEN n = 0 OR max_running_per_key IS NULL THEN n + 1
                                ELSE greatest(%(window)s::bigint, n + 1) END
                      FROM budget)) AS c
), eligible AS (
    SELECT c.id, c.priority, c.run_at
      FROM candidates AS c
      LEFT JOIN keys AS k ON k.key = c.concurrency_key
     WHERE c.concurrency_key IS NULL
        OR (SELECT max_running_per_key FROM budget) IS NULL
        OR c.krank <= (SELECT max_running_per_key FROM budget) - coalesce(k.n, 0)
     ORDER BY c.priority DESC, c.run_at, c.id
     LIMIT (SELECT n FROM budget)
), picked AS (
    SELECT j.id, j.priority, row_number() OVER (ORDER BY j.priority DESC, j.run_at, j.id) AS rn,
           false AS budget_full
      FROM (SELECT w.id, w.priority, w.run_at
              FROM {schema}.jobs AS w
             WHERE w.id = ANY (ARRAY(SELECT id FROM eligible))
               AND w.queue = %(queue)s AND w.status = 'pending'
               FOR UPDATE OF w SKIP LOCKED) AS j
), taken AS (
{@take}
), spent AS (
    UPDATE {schema}.queue_limits AS l
       SET tokens = b.tokens - (SELECT count(*) FROM taken), refilled_at = statement_timestamp()
      FROM budget AS b
     WHERE l.name = %(queue)s AND b.rate IS NOT NULL
    RETURNING l.tokens
)
SELECT s.limited, s.free, s.tokens, s.more, s.rate, t.id, t.queue, t.payload, t.redelivered, t.attempts,
       t.expires_at, t.priority, t.rn, t.delivery, t.budget_full, t.run_at
  FROM (SELECT EXISTS (SELECT FROM lim) AS limited,
               (SELECT free - (SELECT count(*) FROM taken) FROM budget) AS free,
               (SELECT tokens FROM spent) AS tokens,
               (SELECT count(*) FROM candidates) > (SELECT count(*) FROM taken) AS more,
               (SELECT rate FROM lim) AS rate) AS s
  LEFT JOIN taken AS t ON true;

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

-- requeue: return delivered messages to pending (fenced by their delivery tokens, as ack), or to failed past max_attempts deliveries; one its task finished in its own transaction (finished_at set: kombu_pgskip.completing, migration 0022) is completed instead, never run again
WITH r AS (
    UPDATE {schema}.jobs AS jobs
       SET status = CASE WHEN jobs.finished_at IS NOT NULL THEN 'completed'
                         WHEN jobs.attempts >= %(max_attempts)s THEN 'failed'
                         ELSE 'pending' END::{schema}.job_status,
           redelivered = jobs.redelivered OR jobs.finished_at IS NULL,
           locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.finished_at IS NOT NULL THEN jobs.finished_at
                              WHEN jobs.attempts >= %(max_attempts)s THEN now() END,
           last_error = CASE WHEN jobs.finished_at IS NULL AND jobs.attempts >= %(max_attempts)s
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

-- finish_in_transaction: mark a delivered message done inside its task's own transaction (kombu_pgskip.completing, migration 0022): finished_at set, fenced by its delivery token, while it stays running until the worker's ack (requeue, unregister_consumer and sweep() complete such a message instead of returning it); the row stays locked until that transaction ends; no row when the delivery is no longer that worker's
UPDATE {schema}.jobs
   SET finished_at = now()
 WHERE id = %(id)s AND delivery = %(delivery)s AND status = 'running' AND finished_at IS NULL
RETURNING id;

-- fail: move delivered messages to failed with a reason (fenced by their delivery tokens, as ack; reject without requeue)
UPDATE {schema}.jobs AS jobs
   SET status = 'failed', finished_at = now(), locked_by = NULL, last_error = %(error)s
  FROM unnest(%(ids)s::bigint[], %(deliveries)s::bigint[]) AS a(id, delivery)
 WHERE jobs.id = a.id AND jobs.delivery = a.delivery
   AND jobs.locked_by = %(consumer)s AND jobs.status = 'running'
RETURNING jobs.id;

-- register_consumer: create or refresh a consumer and its lease (a new row has no lock_key: the lease alone says it lives until the background thread's renewal marks it)
INSERT INTO {schema}.consumers (id, hostname, pid, queues, lease_until)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(queues)s, now() + make_interval(secs => %(lease)s))
ON CONFLICT (id) DO UPDATE
   SET lease_until = EXCLUDED.lease_until, heartbeat_at = now(), queues = EXCLUDED.queues;

-- take_session_lock: take the advisory lock whose release tells sweep() that this process is gone (false: another session holds that key); the session is never ended for idling (idle_session_timeout, PostgreSQL 14+), which would end the lock with it
SELECT pg_try_advisory_lock(%(key)s),
       CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', '0', false) END;

-- renew_consumers: extend the leases of live consumers, and say which advisory lock this session holds for them (lock_key, or NULL for none) and on which server, which clears a suspicion that the lock was gone (lock_lost_at); only the consumers row is written, so nothing done to jobs or queues can hold it up; returns the ids still known
UPDATE {schema}.consumers
   SET lease_until = now() + make_interval(secs => %(lease)s), heartbeat_at = now(),
       lock_key = %(lock_key)s::bigint,
       lock_server_start = CASE WHEN %(lock_key)s::bigint IS NOT NULL
                                THEN pg_postmaster_start_time() END,
       lock_lost_at = NULL
 WHERE id = ANY(%(ids)s::uuid[])
RETURNING id;

-- mark_queues_used: restart the x-expires clock of the queues live consumers consume (expire_queues counts from when a queue was last used); a queue row another session has locked is skipped, its clock being restarted by that session or by the next call
UPDATE {schema}.queues AS q
   SET last_used_at = now()
 WHERE q.name IN (SELECT u.name
                    FROM {schema}.queues AS u
                   WHERE u.expires IS NOT NULL
                     AND u.name IN (SELECT unnest(c.queues)
                                      FROM {schema}.consumers AS c
                                     WHERE c.id = ANY(%(ids)s::uuid[]))
                     FOR NO KEY UPDATE SKIP LOCKED)
RETURNING q.name;

-- unregister_consumer: a consumer leaves: what it still holds goes back to pending (or is completed, when its task finished it in its own transaction: requeue), its row goes
WITH c AS (
    DELETE FROM {schema}.consumers WHERE id = %(id)s RETURNING id, queues
), used AS (
    -- x-expires counts from when the queue was last used
    UPDATE {schema}.queues SET last_used_at = now()
     WHERE expires IS NOT NULL AND name IN (SELECT unnest(queues) FROM c)
    RETURNING 1
), r AS (
    UPDATE {schema}.jobs
       SET status = CASE WHEN finished_at IS NULL THEN 'pending'
                         ELSE 'completed' END::{schema}.job_status,
           redelivered = redelivered OR finished_at IS NULL, locked_by = NULL, locked_at = NULL
     WHERE locked_by = %(id)s AND status = 'running'
    RETURNING queue, status
), n AS (
    SELECT pg_notify(%(channel)s, d.queue)
      FROM (SELECT DISTINCT queue FROM r WHERE status = 'pending') AS d
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM r WHERE status = 'pending'),
       (SELECT count(*) FROM n);
