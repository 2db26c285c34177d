-- pgskip: compatible-with 0004
-- 0011_expire_queues_by_index: expire_queues() finds a queue's live consumers by index.
--
-- expire_queues() (migration 0003) asked every consumer row, for each queue past its
-- x-expires window, whether it consumes that queue. consumer_queues (migration 0010) answers
-- by its (queue, polling) index, as has_queue, route and delete_unused_queues now do
-- (kombu_pgskip/sql/queries.sql). Same result: a queue is in use while a consumer whose lease
-- has not run out consumes it.
CREATE OR REPLACE FUNCTION expire_queues(OUT queues bigint, OUT messages bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
    WITH gone AS (
        DELETE FROM queues AS q
         WHERE q.expires IS NOT NULL
           AND q.last_used_at + q.expires * interval '1 millisecond' <= now()
           AND NOT EXISTS (SELECT 1 FROM consumer_queues AS cq
                             JOIN consumers AS c ON c.id = cq.consumer
                            WHERE cq.queue = q.name AND c.lease_until > now())
        RETURNING q.name
    ), dropped AS (
        DELETE FROM jobs AS j
         USING gone
         WHERE j.queue = gone.name AND j.status IN ('pending', 'scheduled')
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM dropped)
$$;
