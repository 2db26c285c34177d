-- pgskip: compatible-with 0014
-- 0015_workers_sweep_with_the_function: a worker's sweep runs the SQL function sweep().
--
-- A live worker's sweeper and the maintenance job did the same work from two definitions: a
-- statement of the worker's (kombu_pgskip/sql/queries.sql) and the function sweep() of
-- migration 0002, which the job calls. The worker calls the function now, so the roles that
-- run workers need EXECUTE on it: granted here to every role already granted expire_queues()
-- (what `pgskip grant --worker` gave), so that an upgrade needs no second `pgskip grant`.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_proc AS p, aclexplode(p.proacl) AS a
         WHERE p.oid = 'expire_queues()'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee NOT IN (0, p.proowner)
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION sweep(integer) TO %s', grantee);
    END LOOP;
END
$$;
