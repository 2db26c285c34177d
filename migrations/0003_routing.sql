-- pgskip: compatible-with 0001
-- 0003_routing: exchanges and bindings shared by every process, and queue expiry (x-expires).
--
-- Celery's remote control (a fanout exchange whose queues the workers bind, replies to a queue
-- only the caller declared) and its events (a topic exchange whose queues the receivers bind)
-- need routing that one process sets up and another one uses, so routing reads these tables.

-- A topic binding's routing-key pattern as a regular expression (kombu's translation of the
-- binding key: '*' one word, '#' any words), so that routing is one SQL predicate. NULL for the
-- other exchange types.
ALTER TABLE bindings ADD COLUMN pattern text;

-- Queues with x-expires, for the expiry sweep (few queues have one).
CREATE INDEX queues_expiring ON queues (last_used_at) WHERE expires IS NOT NULL;

-- Deletes the queues declared with x-expires that nobody used for that long, with their
-- waiting messages and (by the foreign key) their bindings. A queue is in use while a live
-- consumer (lease not run out) consumes it; last_used_at is refreshed when the queue is
-- declared and while its consumers renew their leases. Returns (queues, messages) deleted.
-- Live workers call it from their sweeper; pg_cron can call it too: SELECT pgskip.expire_queues().
CREATE FUNCTION expire_queues(OUT queues bigint, OUT messages bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
    WITH gone AS (
        DELETE FROM queues AS q
         WHERE q.expires IS NOT NULL
           AND q.last_used_at + q.expires * interval '1 millisecond' <= now()
           AND NOT EXISTS (SELECT 1 FROM consumers AS c
                            WHERE q.name = ANY (c.queues) AND c.lease_until > now())
        RETURNING q.name
    ), dropped AS (
        DELETE FROM jobs AS j
         USING gone
         WHERE j.queue = gone.name AND j.status IN ('pending', 'scheduled')
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM dropped)
$$;
