-- pgskip: compatible-with 0014
-- 0014_no_busy_polling_no_routing_epoch: drop what busy polling and the route cache needed.
--
-- Both were kept for speed and measured against their absence in one sitting, three full
-- runs of `python -m bench.run --brokers pgskip,pgskip-nobusy,pgskip-noroute` on two cores
-- (bench/reference/mechanisms-*-20261202*.json). Neither moved a figure a user sees beyond the
-- spread of two runs of identical code: end to end 0.98-1.07x without busy polling against
-- 0.99-1.06x between identical runs; latency, worker side and scaling within the same spread.
-- The route cache saved 25-35 us of server CPU on a kombu publish to a named exchange, which
-- Celery's default routing never uses (it publishes to the anonymous exchange, which does
-- not route), and which a queue with x-expires (remote control, events) never used.
-- What they cost: the polling flag of every consumer and its copy in consumer_queues (a
-- trigger on consumers), an advisory-lock handshake between workers and publishers, and the
-- routing epoch (a table, a sequence, nine triggers and the one function that ran as its
-- owner).
--
-- Code of the previous version reads these objects: migrate and restart every worker and
-- publisher together, as for every migration of this package.

DROP TRIGGER consumers_queues_rows ON consumers;
DROP TRIGGER consumers_queues_update ON consumers;
DROP TRIGGER consumers_queues_truncate ON consumers;
DROP FUNCTION sync_consumer_queues();

-- As 0003 had it: a queue is in use while a consumer whose lease holds consumes it.
CREATE OR REPLACE FUNCTION expire_queues(OUT queues bigint, OUT messages bigint)
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

DROP TABLE consumer_queues;
ALTER TABLE consumers DROP COLUMN polling;

DROP TRIGGER bindings_routing_epoch ON bindings;
DROP TRIGGER bindings_routing_epoch_update ON bindings;
DROP TRIGGER bindings_routing_epoch_truncate ON bindings;
DROP TRIGGER exchanges_routing_epoch_delete ON exchanges;
DROP TRIGGER exchanges_routing_epoch_type ON exchanges;
DROP TRIGGER exchanges_routing_epoch_truncate ON exchanges;
DROP TRIGGER queues_routing_epoch ON queues;
DROP TRIGGER queues_routing_epoch_expires ON queues;
DROP TRIGGER queues_routing_epoch_truncate ON queues;
DROP FUNCTION bump_routing_epoch();
DROP TABLE routing_epoch;
DROP SEQUENCE routing_epoch_seq;
