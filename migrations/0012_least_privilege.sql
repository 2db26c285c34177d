-- pgskip: compatible-with 0012
-- 0012_least_privilege: no role but the owner runs code as the owner or changes what it does
-- not own (docs/security.md has the threat model; kombu_pgskip/doctor.py checks all of this).
--
-- 1. Every function resolves names in this schema and pg_catalog only. The functions of
--    0001-0011 pinned `SET search_path FROM CURRENT`, which was "<schema>, public": a role
--    that can create objects in public (the app role that runs Django migrations, often the
--    publisher) could define public.nextval(text), a closer match than pg_catalog's
--    nextval(regclass), and it ran with the owner's rights inside bump_routing_epoch()
--    (CVE-2018-1058). Two functions had no path at all and used their caller's.
--    prune_in_batches() commits between batches, which a procedure with a SET clause may not
--    do: it now qualifies every name and operator it uses and deletes through a pinned
--    function.
-- 2. Nothing here is executable by PUBLIC. A trigger function could be attached to a table
--    of the caller's own (CREATE TRIGGER needs EXECUTE on the function) and then run as its
--    owner: sync_consumer_queues() emptied consumer_queues that way for a role without
--    DELETE on it. Workers get EXECUTE on expire_queues() from `pgskip grant`; publishers get
--    nothing; the owner and pg_cron (which runs as the owner) own everything.
-- 3. Trigger functions refuse to run for any table but their own.
-- 4. sync_consumer_queues() is no longer SECURITY DEFINER: the roles that change consumers
--    (workers, the owner) are granted what it writes. bump_routing_epoch() stays SECURITY
--    DEFINER: publishers bump the epoch when they declare queues and bindings, and a grant of
--    UPDATE on routing_epoch would let one set it back to a value other publishers remember,
--    so that their guarded inserts follow a route that no longer holds.
-- 5. No type of this schema is usable by PUBLIC: an operator over job_status defined by
--    another role (=(job_status, job_status) beats pg_catalog's =(anyenum, anyenum)) would
--    run in every session that compares a status with public on its search path.
-- 6. Privileges of roles granted by earlier versions of `pgskip grant` shrink to what the
--    code needs: a publisher inserts only the columns a publish writes and updates only
--    queues.last_used_at (declaring refreshes x-expires' clock); a worker no longer updates
--    queue arguments, exchanges or bindings. A declaration that disagrees with the stored
--    one fails (PRECONDITION_FAILED) and changes nothing; the owner changes a queue's
--    arguments deliberately (`pgskip queue-args`).

-- Everything below resolves names with this path (as every migration run by `pgskip migrate`),
-- and the functions created below keep it (SET search_path FROM CURRENT).
SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

-- 1. A safe path for every function of 0001-0011 (prune_in_batches is replaced below).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p
         WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
           AND p.prokind = 'f'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_catalog, pg_temp',
                       f, current_schema());
    END LOOP;
END
$$;

-- One batch of prune_in_batches(): the oldest `batch` completed rows finished before cutoff.
CREATE FUNCTION prune_completed_batch(cutoff timestamptz, batch integer) RETURNS bigint
LANGUAGE sql SET search_path FROM CURRENT AS $$
    WITH d AS (
        DELETE FROM jobs
         WHERE id IN (SELECT id FROM jobs
                       WHERE status = 'completed' AND finished_at < cutoff
                       ORDER BY finished_at
                       LIMIT batch)
        RETURNING 1
    )
    SELECT count(*) FROM d
$$;

DO $migration$
BEGIN
    EXECUTE pg_catalog.format($create$
CREATE OR REPLACE PROCEDURE %1$I.prune_in_batches(
    completed_after interval DEFAULT '1 day',
    failed_after interval DEFAULT '14 days',
    batch integer DEFAULT 10000,
    INOUT completed bigint DEFAULT NULL,
    INOUT failed bigint DEFAULT NULL,
    INOUT slots bigint DEFAULT NULL)
LANGUAGE plpgsql AS $body$
-- No SET clause (it would forbid COMMIT): every name is qualified, every operator too, so the
-- caller's search path resolves nothing here.
DECLARE
    cutoff timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) completed_after;
    n bigint;
BEGIN
    IF batch IS NULL OR batch OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION 'prune_in_batches: batch must be a positive number of rows, not %%', batch;
    END IF;
    completed := 0;
    IF completed_after IS NOT NULL THEN
        LOOP
            n := %1$I.prune_completed_batch(cutoff, batch);
            completed := completed OPERATOR(pg_catalog.+) n;
            COMMIT;
            EXIT WHEN n OPERATOR(pg_catalog.<) batch;
        END LOOP;
    END IF;
    SELECT p.failed, p.slots INTO failed, slots FROM %1$I.prune(NULL, failed_after) AS p;
END
$body$
$create$, pg_catalog.current_schema());
END
$migration$;

-- 3, 4. The trigger functions, each for its own tables only.
CREATE OR REPLACE FUNCTION bump_routing_epoch() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_RELID NOT IN ('bindings'::regclass, 'exchanges'::regclass, 'queues'::regclass) THEN
        RAISE EXCEPTION 'bump_routing_epoch() runs only as a trigger of bindings, exchanges and queues';
    END IF;
    UPDATE routing_epoch SET n = nextval('routing_epoch_seq'::regclass);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION sync_consumer_queues() RETURNS trigger
LANGUAGE plpgsql SECURITY INVOKER SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_RELID <> 'consumers'::regclass THEN
        RAISE EXCEPTION 'sync_consumer_queues() runs only as a trigger of consumers';
    END IF;
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

-- 2. Nothing executable by PUBLIC; workers keep expire_queues() if they had it.
DO $$
BEGIN
    EXECUTE format('REVOKE ALL ON ALL ROUTINES IN SCHEMA %I FROM PUBLIC', current_schema());
END
$$;

-- 5. No type usable by PUBLIC (array types follow their element type).
DO $$
DECLARE
    t regtype;
BEGIN
    FOR t IN
        SELECT ty.oid::regtype FROM pg_type AS ty
         WHERE ty.typnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
           AND ty.typcategory <> 'A'
    LOOP
        EXECUTE format('REVOKE USAGE ON TYPE %s FROM PUBLIC', t);
    END LOOP;
END
$$;

-- 6. Roles granted by earlier versions of `pgskip grant`: workers (DELETE on jobs) and
-- publishers (INSERT on jobs without DELETE).
DO $$
DECLARE
    grantee text;
    worker boolean;
BEGIN
    FOR grantee, worker IN
        SELECT DISTINCT a.grantee::regrole::text,
               has_table_privilege(a.grantee, 'jobs', 'DELETE')
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'jobs'::regclass
           AND a.privilege_type = 'INSERT'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('REVOKE UPDATE ON queues, exchanges, bindings FROM %s', grantee);
        EXECUTE format('GRANT UPDATE (last_used_at) ON queues TO %s', grantee);
        IF worker THEN
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON consumer_queues TO %s',
                           grantee);
        ELSE
            EXECUTE format('REVOKE INSERT ON jobs FROM %s', grantee);
            EXECUTE format(
                'GRANT INSERT (queue, priority, status, run_at, payload, task_name, task_id,'
                ' expires_at) ON jobs TO %s', grantee);
            EXECUTE format('REVOKE INSERT ON queues, exchanges, bindings FROM %s', grantee);
            EXECUTE format(
                'GRANT INSERT (name, durable, auto_delete, arguments, max_priority,'
                ' message_ttl, expires) ON queues TO %s', grantee);
            EXECUTE format(
                'GRANT INSERT (name, type, durable, auto_delete, arguments) ON exchanges TO %s',
                grantee);
            EXECUTE format(
                'GRANT INSERT (exchange, queue, routing_key, arguments, pattern) ON bindings'
                ' TO %s', grantee);
        END IF;
    END LOOP;
END
$$;
