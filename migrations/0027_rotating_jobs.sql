-- pgskip: compatible-with 0019
-- 0027_rotating_jobs: jobs becomes a table partitioned by slot, whose slots are emptied whole.
--
-- Every message leaves dead row versions behind it (its pending and running versions, and
-- its completed one once pruned). In one table only vacuum gives their space back, and a
-- transaction holding an old snapshot (a pg_dump, a report, a shell left open, a standby's
-- hot_standby_feedback) stops vacuum for as long as it lasts: the table grows and every fetch
-- walks more dead entries. Here new messages go to one of a ring of partitions, the current
-- slot (jobs.slot, from jobs_rotation); once it has taken slot_rows ids the next slot becomes
-- current. rotate() empties with TRUNCATE each slot whose messages are all finished, past the
-- retention of completed messages: its space returns to the file system at once, whatever
-- vacuum and snapshots do, and its dead entries leave every index. A slot about to become
-- current while it still holds messages to keep (not finished, failed, or completed within
-- the retention) has those moved to slot 0, jobs_kept, first: nothing is lost, and a message
-- keeps its id. jobs_kept holds the table's rows from before this migration and the messages
-- kept past their slot; vacuum and prune() look after it as they did after the table.
--
-- TRUNCATE needs an ACCESS EXCLUSIVE lock of the one partition it empties, which waits for the
-- statements reading it (fetches, acks: milliseconds) and for transactions that read it and
-- are still open. rotate() asks for it with a short lock_timeout and tries again on its next
-- call: a pg_dump (which locks every table it dumps until it ends) delays the emptying, never
-- a fetch for long. A publish locks only the parent and the current slot, so a transaction
-- left open after a publish delays no emptying of another slot.
--
-- Workers call rotate() every second (one at a time: the others skip), and the pg_cron
-- maintenance job every minute. Worker roles (DELETE on jobs) may read and move on the
-- ring (jobs_rotation) and TRUNCATE the slots, which deletes no more than the DELETE they
-- hold already; publishers read the current slot. Code of 0019 to 0025 runs with this
-- schema: its inserts take the current slot from the column's default.
--
-- The conversion locks jobs while it runs: the table is renamed to jobs_kept and attached as
-- slot 0 of a new partitioned jobs (which reads it once to check that every row belongs
-- there), and the empty slots are created with their indexes; jobs_kept's indexes are kept.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

-- Where the ids go on, before the identity of the old table (and its sequence) goes.
SELECT pg_catalog.set_config('pgskip.next_job_id',
    (SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM jobs_id_seq)::text,
    true);

ALTER TABLE jobs RENAME TO jobs_kept;
ALTER INDEX jobs_pkey RENAME TO jobs_kept_pkey;
ALTER INDEX jobs_dequeue RENAME TO jobs_dequeue_kept;
ALTER INDEX jobs_running_rows RENAME TO jobs_running_rows_kept;
ALTER INDEX jobs_scheduled RENAME TO jobs_scheduled_kept;
ALTER INDEX jobs_completed RENAME TO jobs_completed_kept;
ALTER INDEX jobs_failed RENAME TO jobs_failed_kept;
ALTER INDEX jobs_expiring RENAME TO jobs_expiring_kept;
-- The claims of unique keys (migration 0026) become triggers of the partitioned table below.
DROP TRIGGER jobs_claim_unique_key ON jobs_kept;
DROP TRIGGER jobs_reclaim_unique_key ON jobs_kept;
ALTER TABLE jobs_kept ALTER COLUMN id DROP IDENTITY;
ALTER TABLE jobs_kept ADD COLUMN slot smallint NOT NULL DEFAULT 0;

CREATE TABLE jobs_rotation (
    only_row            boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    slot                smallint NOT NULL,
    slots               smallint NOT NULL CHECK (slots >= 2),
    slot_rows           bigint NOT NULL CHECK (slot_rows > 0),
    first_id            bigint NOT NULL,
    since               timestamptz NOT NULL DEFAULT now(),
    completed_retention interval NOT NULL DEFAULT interval '1 day',
    CHECK (slot BETWEEN 1 AND slots)
);
COMMENT ON TABLE jobs_rotation IS
    'the slot of jobs new messages go to, and when rotate() moves on to the next one';
COMMENT ON COLUMN jobs_rotation.slot IS 'the current slot: new messages go to jobs_<slot>';
COMMENT ON COLUMN jobs_rotation.slots IS 'slots in the ring, jobs_1 to jobs_<slots>';
COMMENT ON COLUMN jobs_rotation.slot_rows IS 'ids the current slot gives out before the next';
COMMENT ON COLUMN jobs_rotation.first_id IS 'the first id given out in the current slot';
COMMENT ON COLUMN jobs_rotation.completed_retention IS
    'a slot whose completed messages are younger than this is not emptied before it is needed '
    '(pgskip maintenance writes its completed_retention here)';
REVOKE USAGE ON TYPE jobs_rotation FROM PUBLIC;
INSERT INTO jobs_rotation (slot, slots, slot_rows, first_id)
VALUES (1, 8, 20000, current_setting('pgskip.next_job_id')::bigint);

CREATE FUNCTION current_slot() RETURNS smallint
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT slot FROM jobs_rotation
$$;
REVOKE EXECUTE ON FUNCTION current_slot() FROM PUBLIC;

CREATE TABLE jobs (LIKE jobs_kept INCLUDING DEFAULTS INCLUDING COMMENTS INCLUDING STORAGE
                   INCLUDING COMPRESSION)
    PARTITION BY LIST (slot);
ALTER TABLE jobs ALTER COLUMN slot SET DEFAULT current_slot();
COMMENT ON COLUMN jobs.slot IS
    'the partition the message is in: 1 to jobs_rotation.slots, or 0 (jobs_kept)';
DO $$
BEGIN
    EXECUTE format('ALTER TABLE jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY '
                   '(SEQUENCE NAME jobs_id_seq START WITH %s)',
                   current_setting('pgskip.next_job_id')::bigint);
END
$$;
COMMENT ON TABLE jobs IS
    'one row per message of a queue, in a ring of partitions by slot (jobs_rotation)';

ALTER TABLE jobs ATTACH PARTITION jobs_kept FOR VALUES IN (0);
-- As every type of the schema since 0012: no other role defines operators over its row type.
REVOKE USAGE ON TYPE jobs FROM PUBLIC;

DO $$
DECLARE
    k integer;
BEGIN
    FOR k IN 1 .. (SELECT slots FROM jobs_rotation) LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF jobs FOR VALUES IN (%s) WITH (fillfactor = 70, '
            'autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, '
            'autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05, '
            'autovacuum_vacuum_cost_delay = 0)', 'jobs_' || k, k);
        EXECUTE format('ALTER TABLE %I ADD PRIMARY KEY (id)', 'jobs_' || k);
        EXECUTE format('REVOKE USAGE ON TYPE %I FROM PUBLIC', 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (queue, priority DESC, run_at, id) '
                       'WHERE status = ''pending''', 'jobs_dequeue_' || k, 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (id) WHERE status = ''running''',
                       'jobs_running_rows_' || k, 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (run_at) WHERE status = ''scheduled''',
                       'jobs_scheduled_' || k, 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (finished_at) WHERE status = ''completed''',
                       'jobs_completed_' || k, 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (queue, finished_at) WHERE status = ''failed''',
                       'jobs_failed_' || k, 'jobs_' || k);
        EXECUTE format('CREATE INDEX %I ON %I (expires_at) WHERE expires_at IS NOT NULL '
                       'AND status IN (''pending'', ''scheduled'')',
                       'jobs_expiring_' || k, 'jobs_' || k);
    END LOOP;
END
$$;

-- The parent's indexes take the partitions' of the same columns and predicates as theirs:
-- jobs_dequeue is jobs_dequeue_kept and jobs_dequeue_1 to jobs_dequeue_<slots>, and so on.
CREATE INDEX jobs_dequeue ON jobs (queue, priority DESC, run_at, id) WHERE status = 'pending';
CREATE INDEX jobs_running_rows ON jobs (id) WHERE status = 'running';
CREATE INDEX jobs_scheduled ON jobs (run_at) WHERE status = 'scheduled';
CREATE INDEX jobs_completed ON jobs (finished_at) WHERE status = 'completed';
CREATE INDEX jobs_failed ON jobs (queue, finished_at) WHERE status = 'failed';
CREATE INDEX jobs_expiring ON jobs (expires_at)
    WHERE expires_at IS NOT NULL AND status IN ('pending', 'scheduled');

-- rotate: move the ring on when the current slot has given out slot_rows ids, and empty the
-- slots that hold nothing to keep. Returns the slots emptied, the messages moved to jobs_kept,
-- and the current slot.
CREATE FUNCTION rotate(OUT emptied integer, OUT moved bigint, OUT current smallint)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    r     jobs_rotation;
    k     integer;
    n     bigint;
    last  bigint;
    part  text;
    kept  bigint[];
BEGIN
    emptied := 0;
    moved := 0;
    -- One rotation at a time: the others skip, they would find nothing left to do.
    SELECT * INTO r FROM jobs_rotation FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT slot INTO current FROM jobs_rotation;
        RETURN;
    END IF;
    current := r.slot;
    PERFORM set_config('lock_timeout', '100ms', true);
    -- Empty the slots behind the current one that hold nothing to keep.
    FOR k IN 1 .. r.slots LOOP
        CONTINUE WHEN k = r.slot;
        part := 'jobs_' || k;
        CONTINUE WHEN pg_relation_size(part::regclass) = 0;
        CONTINUE WHEN rotation_keeps(k::smallint, r.completed_retention);
        BEGIN
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part);
            -- Under the lock, nothing writes the slot: look again (a publish that read this
            -- slot as current just before the ring moved on may have written to it).
            IF NOT rotation_keeps(k::smallint, r.completed_retention) THEN
                EXECUTE format('TRUNCATE %I', part);
                emptied := emptied + 1;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- read by a statement or an open transaction: next time
        END;
    END LOOP;
    -- Move the ring on.
    SELECT max(id) INTO last FROM jobs WHERE slot = r.slot;
    IF last - r.first_id + 1 >= r.slot_rows THEN
        k := r.slot % r.slots + 1;
        part := 'jobs_' || k;
        BEGIN
            IF pg_relation_size(part::regclass) > 0 THEN
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part);
                SELECT coalesce(array_agg(id), '{}') INTO kept FROM jobs
                 WHERE slot = k
                   AND (status IN ('scheduled', 'pending', 'running', 'failed')
                        OR (status = 'completed'
                            AND finished_at > now() - r.completed_retention));
                UPDATE jobs SET slot = 0 WHERE slot = k AND id = ANY (kept);
                -- Every one of them is in jobs_kept before the slot is emptied, or nothing
                -- is done (a trigger that refused a row would otherwise lose it).
                n := (SELECT count(*) FROM jobs WHERE slot = 0 AND id = ANY (kept));
                IF n <> cardinality(kept) THEN
                    RAISE EXCEPTION 'rotate(): % of the % messages to keep of slot % reached '
                                    'jobs_kept; the slot is left as it is', n, cardinality(kept), k;
                END IF;
                moved := moved + n;
                EXECUTE format('TRUNCATE %I', part);
                emptied := emptied + 1;
            END IF;
            UPDATE jobs_rotation SET slot = k, first_id = last + 1, since = now();
            current := k;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END IF;
END
$$;
REVOKE EXECUTE ON FUNCTION rotate() FROM PUBLIC;

-- rotation_keeps: whether slot k holds a message to keep: not finished, failed, or completed
-- within the retention (each an index's predicate: a probe of each).
CREATE FUNCTION rotation_keeps(k smallint, completed_retention interval) RETURNS boolean
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'pending')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'scheduled')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'running')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'failed')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'completed'
                                      AND finished_at > now() - completed_retention)
$$;
REVOKE EXECUTE ON FUNCTION rotation_keeps(smallint, interval) FROM PUBLIC;

-- As migration 0026 made them, on every partition. A message moved to jobs_kept by rotate()
-- is inserted there again with its id: its claim stays its own.
CREATE TRIGGER jobs_claim_unique_key BEFORE INSERT ON jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND NEW.status IN ('pending', 'scheduled', 'running'))
    EXECUTE FUNCTION claim_unique_key();
CREATE TRIGGER jobs_reclaim_unique_key AFTER UPDATE ON jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND NEW.status IN ('pending', 'scheduled', 'running')
          AND (OLD.status NOT IN ('pending', 'scheduled', 'running')
               OR OLD.unique_key IS DISTINCT FROM NEW.unique_key
               OR OLD.queue <> NEW.queue))
    EXECUTE FUNCTION claim_unique_key();

-- The roles granted on the table are granted the same on the parent, and nothing on the
-- partition: every statement of theirs names jobs.
DO $$
DECLARE
    g record;
    k integer;
BEGIN
    FOR g IN
        SELECT a.privilege_type AS priv,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(a.grantee::regrole::text) END
                   AS who,
               NULL::name AS col
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'jobs_kept'::regclass AND a.grantee <> c.relowner
        UNION ALL
        SELECT a.privilege_type,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(a.grantee::regrole::text) END,
               att.attname
          FROM pg_attribute AS att, aclexplode(att.attacl) AS a
         WHERE att.attrelid = 'jobs_kept'::regclass AND att.attnum > 0 AND NOT att.attisdropped
    LOOP
        IF g.col IS NULL THEN
            EXECUTE format('GRANT %s ON jobs TO %s', g.priv, g.who);
            EXECUTE format('REVOKE %s ON jobs_kept FROM %s', g.priv, g.who);
        ELSE
            EXECUTE format('GRANT %s (%I) ON jobs TO %s', g.priv, g.col, g.who);
            EXECUTE format('REVOKE %s (%I) ON jobs_kept FROM %s', g.priv, g.col, g.who);
        END IF;
    END LOOP;
    -- Publishers (INSERT on payload, no DELETE) write the slot the statement read.
    FOR g IN
        SELECT DISTINCT quote_ident(a.grantee::regrole::text) AS who
          FROM pg_attribute AS att, aclexplode(att.attacl) AS a
         WHERE att.attrelid = 'jobs'::regclass AND att.attname = 'payload'
           AND a.privilege_type = 'INSERT' AND a.grantee <> 0
           AND NOT has_table_privilege(a.grantee, 'jobs', 'DELETE')
    LOOP
        EXECUTE format('GRANT INSERT (slot) ON jobs TO %s', g.who);
        EXECUTE format('GRANT SELECT ON jobs_rotation TO %s', g.who);
        EXECUTE format('GRANT EXECUTE ON FUNCTION current_slot() TO %s', g.who);
    END LOOP;
    -- Workers (DELETE on jobs) rotate.
    FOR g IN
        SELECT DISTINCT quote_ident(a.grantee::regrole::text) AS who
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'jobs'::regclass AND a.privilege_type = 'DELETE'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT, UPDATE (slot, first_id, since) ON jobs_rotation TO %s',
                       g.who);
        EXECUTE format('GRANT EXECUTE ON FUNCTION rotate(), rotation_keeps(smallint, interval), '
                       'current_slot() TO %s', g.who);
        FOR k IN 1 .. (SELECT slots FROM jobs_rotation) LOOP
            EXECUTE format('GRANT TRUNCATE ON %I TO %s', 'jobs_' || k, g.who);
        END LOOP;
    END LOOP;
END
$$;
