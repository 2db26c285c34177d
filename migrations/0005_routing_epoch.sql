-- pgskip: compatible-with 0004
-- 0005_routing_epoch: a number that changes whenever routing may have changed, so that a
-- publisher can remember where an exchange sent a routing key and check, in the insert itself,
-- that the answer still holds.
--
-- Routing a message through an exchange (publish_routed in kombu_pgskip/sql/queries.sql) joins
-- bindings, exchanges and queues and checks each target's x-expires: about 25 us of server CPU
-- more per message than inserting into a known queue (docs/performance.md). Celery publishes
-- every task through its 'celery' exchange. The transport now keeps, per process, the queue
-- that an (exchange, routing key) last routed to, with the routing epoch read in the same
-- snapshot, and publishes with the plain single-queue insert guarded by
-- "routing_epoch.n = the remembered epoch". A guard that fails inserts nothing, and the
-- transport routes again.
--
-- Every change that can alter a route bumps the epoch, in the changing transaction: a binding
-- added, removed or changed; an exchange removed or retyped; a queue created or removed, or its
-- x-expires changed (queues with x-expires are routed afresh every time, as their liveness
-- changes with time). The new value comes from a sequence, so a value is never used twice,
-- even when the bumping transaction rolls back.

CREATE SEQUENCE routing_epoch_seq;

CREATE TABLE routing_epoch (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    n         bigint NOT NULL
);
INSERT INTO routing_epoch (n) VALUES (nextval('routing_epoch_seq'));

-- SECURITY DEFINER: a role that may declare and bind (`pgskip grant`) needs no UPDATE on
-- routing_epoch.
CREATE FUNCTION bump_routing_epoch() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    UPDATE routing_epoch SET n = nextval('routing_epoch_seq');
    RETURN NULL;
END
$$;

CREATE TRIGGER bindings_routing_epoch
    AFTER INSERT OR DELETE ON bindings
    FOR EACH ROW EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER bindings_routing_epoch_update
    AFTER UPDATE ON bindings
    FOR EACH ROW
    WHEN ((OLD.exchange, OLD.queue, OLD.routing_key, OLD.pattern)
          IS DISTINCT FROM (NEW.exchange, NEW.queue, NEW.routing_key, NEW.pattern))
    EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER exchanges_routing_epoch_delete
    AFTER DELETE ON exchanges
    FOR EACH ROW EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER exchanges_routing_epoch_type
    AFTER UPDATE OF type ON exchanges
    FOR EACH ROW WHEN (OLD.type IS DISTINCT FROM NEW.type) EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER queues_routing_epoch
    AFTER INSERT OR DELETE ON queues
    FOR EACH ROW EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER queues_routing_epoch_expires
    AFTER UPDATE OF expires ON queues
    FOR EACH ROW WHEN (OLD.expires IS DISTINCT FROM NEW.expires)
    EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER bindings_routing_epoch_truncate
    AFTER TRUNCATE ON bindings
    FOR EACH STATEMENT EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER exchanges_routing_epoch_truncate
    AFTER TRUNCATE ON exchanges
    FOR EACH STATEMENT EXECUTE FUNCTION bump_routing_epoch();
CREATE TRIGGER queues_routing_epoch_truncate
    AFTER TRUNCATE ON queues
    FOR EACH STATEMENT EXECUTE FUNCTION bump_routing_epoch();

-- Roles already granted the publish path (`pgskip grant`: INSERT on jobs) may read the epoch,
-- so that an upgrade does not need `pgskip grant` again.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'jobs'::regclass
           AND a.privilege_type = 'INSERT'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT ON routing_epoch TO %s', grantee);
    END LOOP;
END
$$;
