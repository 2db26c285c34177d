-- pgskip: compatible-with 0019
-- 0021_paused_queues: a queue can be paused for the whole fleet, in the database.
--
-- `pgskip pause QUEUE` adds the queue's row here and `pgskip resume QUEUE` deletes it. While
-- the row exists no fetch takes a message of that queue (sql/consume.sql, due_row): its
-- messages stay pending, countdowns still become due, publishes still succeed, tasks already
-- running finish and are acknowledged as usual. The row is apart from the queue's own row in
-- queues, so a queue can be paused before any worker or publisher declared it, and a queue
-- deleted and declared again (auto_delete, x-expires) stays paused.
--
-- Workers read this table in every fetch; only the owner writes it (and roles the owner
-- grants INSERT, DELETE to). Worker roles granted by `pgskip grant` (those with DELETE on
-- jobs) get SELECT here. Code of 0019 and 0020 runs with this schema, and does not honour a
-- pause: pausing is for a fleet that runs code of 0021 or later.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

CREATE TABLE paused_queues (
    name      text PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 255),
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL DEFAULT current_user,
    reason    text
);
COMMENT ON TABLE paused_queues IS
    'queues whose messages no fetch takes until resumed (pgskip pause / resume)';
COMMENT ON COLUMN paused_queues.paused_by IS 'the role that paused it';
COMMENT ON COLUMN paused_queues.reason IS 'what the operator said when pausing (--reason)';
-- As every type of the schema since 0012: no other role defines operators over its row type.
REVOKE USAGE ON TYPE paused_queues FROM PUBLIC;

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
        EXECUTE format('GRANT SELECT ON paused_queues TO %s', grantee);
    END LOOP;
END
$$;
