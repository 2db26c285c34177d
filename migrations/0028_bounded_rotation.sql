-- pgskip: compatible-with 0019
-- 0028_bounded_rotation: the ring never moves more than twice a slot's worth of messages at once.
--
-- When the ring comes back to a slot that still holds messages to keep, rotate() moves them to
-- jobs_kept under an ACCESS EXCLUSIVE lock of the slot, which every fetch and ack waits for (a
-- generic plan locks every partition). A slot filled as intended holds slot_rows ids, and the
-- few published in the second before rotate() noticed: with the one-day retention of completed
-- messages, moving them takes a fraction of a second. But while a session that has read jobs
-- holds its locks (a pg_dump, a report in REPEATABLE READ), no slot can be locked, the ring
-- stays on the current slot and that slot takes every message published meanwhile: hundreds of
-- thousands in a few minutes. When the ring came back to it, moving them all outlasted the
-- worker's statement_timeout, was rolled back (leaving every row it had copied as a dead row of
-- jobs_kept) and was tried again a second later, holding up every fetch each time: the fleet
-- drained at a few percent of its rate until the move happened to fit.
--
-- Now rotate() counts, without a lock, whether a slot holds more than 2 * slot_rows messages to
-- keep, and passes over such a slot: the ring takes the next slot after it that holds fewer, or
-- stays on the current one (which then takes more than slot_rows ids, as one table would) until
-- one does. A slot passed over is also emptied by TRUNCATE like any other once its messages
-- have finished and its completed ones are past the retention.
--
-- And most of what the ring keeps moves before it is needed, without the slot's lock: each call
-- moves up to slot_rows completed messages (those within the retention) of the slots behind the
-- current one, oldest first, to jobs_kept, row by row (no fetch, ack, requeue or sweep writes a
-- completed message). With the default retention of a day, a slot the ring comes back to holds
-- a slot's worth of them: moving those under the lock held up every fetch at every wrap (a move
-- of 20,000 rows takes a fifth of a second on an idle server), and a slot passed over with
-- hundreds of thousands would have stayed so for a day. And a slot the ring has left, kept for
-- the day by its completed messages, held the dead entries of every message consumed from it
-- until vacuum removed them, and every fetch that scanned its dequeue index walked them. Now a
-- slot is emptied by TRUNCATE once its messages have run, and at the wrap only the messages
-- still waiting or running move under the lock. The cost: with a retention between a minute
-- and a turn of the ring, completed messages are copied that would have expired in their slot.
-- Each call moves first and locks after: the ACCESS EXCLUSIVE lock of a slot it empties, which
-- every fetch waits for (a generic plan locks every partition), is not held while completed
-- messages move, and a slot whose last completed messages a call moved is emptied by that
-- same call.
-- A slot the ring cannot lock (read by a statement or an open transaction) is still left for
-- the next call, and so is every other slot that needs a lock: each try waits up to the
-- lock_timeout, every fetch waits behind it, and a session that holds one slot (a pg_dump)
-- holds them all, so that trying each slot would hold up fetches that long for every slot
-- the ring could empty, at every call.
-- And while such a session holds them, a call does nothing but try one lock: once a lock was
-- refused (jobs_rotation.blocked_since), the next call first tries to lock one slot that holds
-- rows, and releases the lock at once; while that is refused it moves no completed message
-- and checks no slot for what it keeps, and the ring moves on only to an empty next slot. Those
-- moves and checks walk every row version the session's snapshot keeps, a quarter of a core
-- of the server at a call a second through a pg_dump, for moves that leave dead versions
-- behind and slots that cannot be emptied until it ends.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

ALTER TABLE jobs_rotation ADD COLUMN blocked_since timestamptz;
COMMENT ON COLUMN jobs_rotation.blocked_since IS
    'since when rotate() has found the slots it must lock held by another session (NULL: it '
    'has not); meanwhile each call only tries one lock';

-- rotation_keeps: as migration 0027 made it, with completed messages probed first: a slot of
-- messages that ran, within the retention, is what rotate() meets in every slot but the current
-- one while more than a turn of the ring goes through in a retention (the default of a day), and
-- it answers at that probe instead of walking the dead entries the other probes find first.
CREATE OR REPLACE FUNCTION rotation_keeps(k smallint, completed_retention interval)
RETURNS boolean
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'completed'
                                      AND finished_at > now() - completed_retention)
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'pending')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'scheduled')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'running')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'failed')
$$;

-- rotation_keeps_more: whether slot k holds more than n messages to keep (as rotation_keeps
-- counts them), reading at most n + 1 of them.
CREATE FUNCTION rotation_keeps_more(k smallint, completed_retention interval, n bigint)
RETURNS boolean
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT count(*) > n
      FROM (SELECT FROM jobs
             WHERE slot = k
               AND (status IN ('scheduled', 'pending', 'running', 'failed')
                    OR (status = 'completed' AND finished_at > now() - completed_retention))
             LIMIT n + 1) AS kept
$$;
REVOKE EXECUTE ON FUNCTION rotation_keeps_more(smallint, interval, bigint) FROM PUBLIC;

-- rotate: move the ring on when the current slot has given out slot_rows ids, and empty the
-- slots that hold nothing to keep. Returns the slots emptied, the messages moved to jobs_kept,
-- and the current slot. (CREATE OR REPLACE keeps the grants of migration 0027.)
CREATE OR REPLACE FUNCTION rotate(OUT emptied integer, OUT moved bigint, OUT current smallint)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    r     jobs_rotation;
    i     integer;
    k     integer;
    n     bigint;
    last  bigint;
    part  text;
    kept  bigint[];
    blocked boolean := false;
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
    PERFORM set_config('lock_timeout', '20ms', true);
    -- A lock was refused last time: first try to lock one slot that holds rows (the lock goes
    -- with the subtransaction). While it is refused, nothing below locks, moves or checks a
    -- slot.
    IF r.blocked_since IS NOT NULL THEN
        FOR k IN 1 .. r.slots LOOP
            CONTINUE WHEN k = r.slot OR pg_relation_size(('jobs_' || k)::regclass) = 0;
            BEGIN
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', 'jobs_' || k);
                RAISE EXCEPTION USING ERRCODE = 'PGSK0';
            EXCEPTION
                WHEN lock_not_available THEN blocked := true;
                WHEN SQLSTATE 'PGSK0' THEN NULL;
            END;
            EXIT;
        END LOOP;
    END IF;
    -- The slots behind the current one, oldest first: their completed messages move to
    -- jobs_kept now, up to slot_rows per call, row by row, before any slot is locked. Those
    -- within a minute of the retention stay, for prune() to delete (a prune with a shorter
    -- retention, or an expired queue's deletion, that meets a message moved meanwhile fails
    -- with a serialization error and deletes it on its next run).
    FOR i IN 1 .. r.slots - 1 LOOP
        EXIT WHEN blocked;
        k := (r.slot + i - 1) % r.slots + 1;
        CONTINUE WHEN pg_relation_size(('jobs_' || k)::regclass) = 0;
        WITH c AS (
            SELECT id FROM jobs
             WHERE slot = k AND status = 'completed'
               AND finished_at > now() - r.completed_retention + interval '1 minute'
             LIMIT r.slot_rows - moved
               FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs SET slot = 0 FROM c WHERE jobs.slot = k AND jobs.id = c.id;
        GET DIAGNOSTICS n = ROW_COUNT;
        moved := moved + n;
        EXIT WHEN moved >= r.slot_rows;
    END LOOP;
    -- Empty the slots behind the current one that hold nothing to keep.
    FOR k IN 1 .. r.slots LOOP
        EXIT WHEN blocked;
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
            -- Read by a statement or an open transaction: next time. A session that holds one
            -- slot (a pg_dump, a report that read jobs) holds them all, and every fetch waits
            -- behind each try for up to the lock_timeout: no other slot is tried this call.
            blocked := true;
            EXIT;
        END;
    END LOOP;
    -- Move the ring on, to the first slot after the current one that is empty or holds at most
    -- 2 * slot_rows messages to keep (those are moved to jobs_kept first); when a lock was
    -- refused this call, only to the next slot, if it is empty.
    SELECT max(id) INTO last FROM jobs WHERE slot = r.slot;
    IF last - r.first_id + 1 >= r.slot_rows THEN
        FOR i IN 1 .. r.slots - 1 LOOP
            k := (r.slot + i - 1) % r.slots + 1;
            part := 'jobs_' || k;
            EXIT WHEN blocked AND pg_relation_size(part::regclass) > 0;
            CONTINUE WHEN pg_relation_size(part::regclass) > 0
                AND rotation_keeps_more(k::smallint, r.completed_retention, 2 * r.slot_rows);
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
                                        'jobs_kept; the slot is left as it is',
                                        n, cardinality(kept), k;
                    END IF;
                    moved := moved + n;
                    EXECUTE format('TRUNCATE %I', part);
                    emptied := emptied + 1;
                END IF;
                UPDATE jobs_rotation SET slot = k, first_id = last + 1, since = now();
                current := k;
            EXCEPTION WHEN lock_not_available THEN
                blocked := true;  -- next time
            END;
            EXIT;
        END LOOP;
    END IF;
    IF blocked <> (r.blocked_since IS NOT NULL) THEN
        UPDATE jobs_rotation SET blocked_since = CASE WHEN blocked THEN now() END;
    END IF;
END
$$;

-- Workers rotate: the roles that may call rotate() may call what it calls.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT quote_ident(a.grantee::regrole::text) AS who
          FROM pg_proc AS p, aclexplode(p.proacl) AS a
         WHERE p.oid = 'rotate()'::regprocedure AND a.grantee NOT IN (0, p.proowner)
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION rotation_keeps_more(smallint, interval, bigint)'
                       ' TO %s', g.who);
        EXECUTE format('GRANT UPDATE (blocked_since) ON jobs_rotation TO %s', g.who);
    END LOOP;
END
$$;
