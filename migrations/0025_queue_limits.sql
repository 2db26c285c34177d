-- pgskip: compatible-with 0019
-- 0025_queue_limits: fleet-wide concurrency and rate limits of a queue, in the database.
--
-- `pgskip limit QUEUE` writes the queue's row here and `pgskip unlimit QUEUE` deletes it.
-- While the row exists the normal fetch (sql/consume.sql, due_row) takes none of the queue's
-- messages; the limited fetch (fetch_limited) takes them, one queue at a time, in a
-- transaction that first locks this row, so that the fetches of every worker of that queue
-- run one after the other and each one counts the running messages every earlier one took.
-- It takes no more than max_running minus the queue's running messages, no more than
-- max_running_per_key minus the running messages of each concurrency key (jobs.concurrency_key,
-- migration 0023), and no more than the tokens of the queue's bucket (rate per second, at
-- most burst held), which it refills and spends here (tokens, refilled_at).
--
-- Workers read this table and write the bucket's two columns; only the owner writes the rest
-- (and roles the owner grants INSERT, UPDATE, DELETE to). Worker roles granted by `pgskip
-- grant` (those with DELETE on jobs) get SELECT and UPDATE (tokens, refilled_at) here. Code of
-- 0019 to 0024 runs with this schema and does not honour a limit (it fetches a limited queue's
-- messages as any other's): limits are for a fleet that runs code of 0025 or later.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

CREATE TABLE queue_limits (
    name                text PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 255),
    max_running         integer CHECK (max_running > 0),
    max_running_per_key integer CHECK (max_running_per_key > 0),
    rate                double precision CHECK (rate > 0 AND rate < 'infinity'),
    burst               integer CHECK (burst > 0),
    tokens              double precision,
    refilled_at         timestamptz,
    set_at              timestamptz NOT NULL DEFAULT now(),
    set_by              text NOT NULL DEFAULT current_user,
    CHECK (max_running IS NOT NULL OR max_running_per_key IS NOT NULL OR rate IS NOT NULL),
    CHECK (burst IS NULL OR rate IS NOT NULL)
);
COMMENT ON TABLE queue_limits IS
    'queues whose messages only the limited fetch takes, within these limits (pgskip limit / unlimit)';
COMMENT ON COLUMN queue_limits.max_running IS
    'most messages of the queue running at once, across every worker';
COMMENT ON COLUMN queue_limits.max_running_per_key IS
    'most messages of one jobs.concurrency_key running at once';
COMMENT ON COLUMN queue_limits.rate IS 'most messages started per second (a token bucket)';
COMMENT ON COLUMN queue_limits.burst IS
    'most tokens the bucket holds; NULL: max(1, ceil(rate))';
COMMENT ON COLUMN queue_limits.tokens IS
    'tokens left at refilled_at (written by the limited fetch); NULL: a full bucket';
COMMENT ON COLUMN queue_limits.set_by IS 'the role that set the limits';
-- As every type of the schema since 0012: no other role defines operators over its row type.
REVOKE USAGE ON TYPE queue_limits FROM PUBLIC;

DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'jobs'::regclass
           AND a.privilege_type = 'DELETE'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT, UPDATE (tokens, refilled_at) ON queue_limits TO %s',
                       grantee);
    END LOOP;
END
$$;
