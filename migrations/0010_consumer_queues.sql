-- pgskip: compatible-with 0004
-- 0010_consumer_queues: a publish reads its queue's polling flags with one b-tree probe.
--
-- A publish decides whether to NOTIFY by reading the polling flags of its queue's consumers
-- (migration 0008): every quiet publish, and one announcement in eight. Migration 0009 made the
-- first half of that read ("does a consumer of the queue not poll?") a lookup of a GIN index,
-- but the second half ("is there any consumer of the queue?") stayed a scan of consumers that
-- stops at the first consumer of the queue: cheap for `celery`, which most rows consume, and a
-- scan of the whole table for a queue that a few workers of a large fleet consume and poll
-- (a quiet publish to such a queue: 119 us with no other consumer rows, 435 us beside 1,500
-- workers, 771 us beside 3,000: docs/performance.md, sixteenth session). And a GIN lookup
-- builds a bitmap of every match before EXISTS can stop: 0.27 ms for a queue that 3,000
-- workers consume and do not poll.
--
-- consumer_queues holds one row per (consumer, queue it consumes) with the consumer's flag,
-- kept by triggers on consumers in the transaction that changes them, so a flag and its copy
-- commit together (the order stop_polling and a quiet publish rely on is unchanged). Its index
-- on (queue, polling) answers both halves at once: the first entry of the queue in that order
-- is a consumer that does not poll if there is one; none means nobody consumes it. One descent
-- of a b-tree, however many workers there are. A lease renewal changes neither column and
-- fires nothing (the WHEN clause); a flag change rewrites the consumer's few rows here.
CREATE TABLE consumer_queues (
    consumer  uuid NOT NULL,
    queue     text NOT NULL,
    polling   boolean NOT NULL,
    PRIMARY KEY (consumer, queue)
) WITH (fillfactor = 50);
CREATE INDEX consumer_queues_by_queue ON consumer_queues (queue, polling);

-- SECURITY DEFINER: roles that register consumers (workers) need no privilege on this table,
-- and publishers only read it.
CREATE FUNCTION sync_consumer_queues() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM consumer_queues;
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.id = NEW.id AND OLD.queues IS NOT DISTINCT FROM NEW.queues THEN
        UPDATE consumer_queues SET polling = NEW.polling WHERE consumer = NEW.id;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM consumer_queues WHERE consumer = OLD.id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO consumer_queues (consumer, queue, polling)
        SELECT DISTINCT NEW.id, q.queue, NEW.polling
          FROM unnest(NEW.queues) AS q(queue)
         WHERE q.queue IS NOT NULL;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER consumers_queues_rows
    AFTER INSERT OR DELETE ON consumers
    FOR EACH ROW EXECUTE FUNCTION sync_consumer_queues();
CREATE TRIGGER consumers_queues_update
    AFTER UPDATE OF id, queues, polling ON consumers
    FOR EACH ROW
    WHEN ((OLD.id, OLD.queues, OLD.polling) IS DISTINCT FROM (NEW.id, NEW.queues, NEW.polling))
    EXECUTE FUNCTION sync_consumer_queues();
CREATE TRIGGER consumers_queues_truncate
    AFTER TRUNCATE ON consumers
    FOR EACH STATEMENT EXECUTE FUNCTION sync_consumer_queues();

-- The consumers already registered (the triggers above hold off concurrent changes to consumers
-- until this transaction commits).
INSERT INTO consumer_queues (consumer, queue, polling)
SELECT DISTINCT c.id, q.queue, c.polling
  FROM consumers AS c, unnest(c.queues) AS q(queue)
 WHERE q.queue IS NOT NULL;

-- Nothing reads it any more.
DROP INDEX IF EXISTS consumers_notified;

-- Roles already granted access to consumers (`pgskip grant`: workers and publishers both read
-- it) may read consumer_queues, so that an upgrade does not need `pgskip grant` again.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'consumers'::regclass
           AND a.privilege_type = 'SELECT'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT ON consumer_queues TO %s', grantee);
    END LOOP;
END
$$;
