-- The pgskip schema that migrations/NNNN_*.sql build, in order, as pg_dump --schema-only
-- writes it (without its session settings): a snapshot to review a new migration against.
-- `pgskip migrate` never runs this file. tests/integration/test_schema_snapshot.py checks it;
-- after a new migration, regenerate it and review the diff:
--   PGSKIP_WRITE_SCHEMA=1 bash scripts/test.sh tests/integration/test_schema_snapshot.py

--
-- Name: pgskip; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA pgskip;

--
-- Name: job_status; Type: TYPE; Schema: pgskip; Owner: -
--

CREATE TYPE pgskip.job_status AS ENUM (
    'scheduled',
    'pending',
    'running',
    'completed',
    'failed'
);

--
-- Name: beat_cron_next(timestamp with time zone, text, smallint[], smallint[], smallint[], smallint[], smallint[]); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_cron_next(after timestamp with time zone, tz text, minutes smallint[], hours smallint[], days_of_week smallint[], days_of_month smallint[], months smallint[]) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    floor_wall  timestamp := after AT TIME ZONE tz;
    d           date := (after AT TIME ZONE tz)::date;
    min_minute  smallint := (SELECT min(x) FROM unnest(minutes) AS x);
    min_hour    smallint := (SELECT min(x) FROM unnest(hours) AS x);
    fh          smallint;
    fm          smallint;
    h           smallint;
    m           smallint;
    cand        timestamp;
    slot        timestamptz;
BEGIN
    -- 29 February on a given weekday recurs within 41 years.
    FOR i IN 1..(366 * 41) LOOP
        IF extract(month FROM d)::smallint = ANY (months)
           AND extract(day FROM d)::smallint = ANY (days_of_month)
           AND extract(dow FROM d)::smallint = ANY (days_of_week) THEN
            LOOP
                cand := NULL;
                IF floor_wall IS NULL THEN
                    cand := d + make_interval(hours => min_hour, mins => min_minute);
                ELSE
                    fh := extract(hour FROM floor_wall)::smallint;
                    fm := extract(minute FROM floor_wall)::smallint;
                    IF fh = ANY (hours) THEN
                        SELECT min(x) INTO m FROM unnest(minutes) AS x WHERE x > fm;
                        IF m IS NOT NULL THEN
                            cand := d + make_interval(hours => fh, mins => m);
                        END IF;
                    END IF;
                    IF cand IS NULL THEN
                        SELECT min(x) INTO h FROM unnest(hours) AS x WHERE x > fh;
                        IF h IS NOT NULL THEN
                            cand := d + make_interval(hours => h, mins => min_minute);
                        END IF;
                    END IF;
                END IF;
                EXIT WHEN cand IS NULL;
                slot := beat_local_to_utc(cand, tz);
                IF slot > after THEN
                    RETURN slot;
                END IF;
                -- Only when starting inside a repeated hour: that wall time's first occurrence
                -- is already past.
                floor_wall := cand;
            END LOOP;
        END IF;
        d := d + 1;
        floor_wall := NULL;
    END LOOP;
    RETURN NULL;
END;
$$;

--
-- Name: beat_entries; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.beat_entries (
    name text NOT NULL,
    task text NOT NULL,
    kind text NOT NULL,
    timezone text NOT NULL,
    minutes smallint[],
    hours smallint[],
    days_of_week smallint[],
    days_of_month smallint[],
    months smallint[],
    first_slot timestamp with time zone,
    every_us bigint,
    every_days integer,
    schedule_key text NOT NULL,
    description text NOT NULL,
    missed text DEFAULT 'latest'::text NOT NULL,
    grace interval DEFAULT '00:02:00'::interval NOT NULL,
    deadline interval,
    max_catchup integer DEFAULT 100 NOT NULL,
    messages jsonb NOT NULL,
    id_paths jsonb DEFAULT '[]'::jsonb NOT NULL,
    fixed_task_id text,
    eta_offset interval,
    expires_offset interval,
    digest text NOT NULL,
    next_slot timestamp with time zone,
    last_slot timestamp with time zone,
    last_task_id text,
    last_fired_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    relative boolean GENERATED ALWAYS AS ((strpos(schedule_key, ', relative'::text) > 0)) STORED NOT NULL,
    CONSTRAINT beat_entries_check CHECK (((kind <> 'crontab'::text) OR ((minutes IS NOT NULL) AND (hours IS NOT NULL) AND (days_of_week IS NOT NULL) AND (days_of_month IS NOT NULL) AND (months IS NOT NULL)))),
    CONSTRAINT beat_entries_check1 CHECK (((kind <> 'interval'::text) OR ((first_slot IS NOT NULL) AND (every_us IS NOT NULL)))),
    CONSTRAINT beat_entries_check2 CHECK (((kind <> 'days'::text) OR ((first_slot IS NOT NULL) AND (every_days IS NOT NULL)))),
    CONSTRAINT beat_entries_every_days_check CHECK ((every_days > 0)),
    CONSTRAINT beat_entries_every_us_check CHECK ((every_us > 0)),
    CONSTRAINT beat_entries_kind_check CHECK ((kind = ANY (ARRAY['crontab'::text, 'interval'::text, 'days'::text]))),
    CONSTRAINT beat_entries_max_catchup_check CHECK ((max_catchup > 0)),
    CONSTRAINT beat_entries_missed_check CHECK ((missed = ANY (ARRAY['latest'::text, 'all'::text, 'skip'::text])))
);

--
-- Name: COLUMN beat_entries.relative; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.beat_entries.relative IS 'a relative=True schedule (kept to the wall clock after a late run, as crontab entries are)';

--
-- Name: beat_emit(pgskip.beat_entries, timestamp with time zone, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_emit(e pgskip.beat_entries, slot timestamp with time zone, sent timestamp with time zone, fired_at timestamp with time zone) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    tid      text := COALESCE(e.fixed_task_id, gen_random_uuid()::text);
    due      timestamptz := sent + COALESCE(e.eta_offset, interval '0');
    inserted record;
BEGIN
    INSERT INTO beat_slots (entry, slot, task_id, sent_at) VALUES (e.name, slot, tid, sent)
        ON CONFLICT ON CONSTRAINT beat_slots_pkey DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Same rules as the broker's publish: priority clamped to the queue's x-max-priority,
    -- TTL from the message or the queue. A run whose unique key is held (the previous run
    -- still waits or runs) is not inserted (claim_unique_key()), and returns no row here.
    FOR inserted IN
        INSERT INTO jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at,
                          created_at, unique_key, concurrency_key)
        SELECT msg.value->>'queue',
               LEAST((msg.value->>'priority')::integer, COALESCE(q.max_priority, 255)),
               CASE WHEN due > fired_at THEN 'scheduled' ELSE 'pending' END::job_status,
               CASE WHEN due > fired_at THEN due ELSE LEAST(due, now()) END,
               beat_payload(msg.value->'payload', e.id_paths, tid,
                            CASE WHEN e.eta_offset IS NOT NULL THEN due END,
                            sent + e.expires_offset)::json,
               e.task,
               tid,
               GREATEST(due, now())
                 + make_interval(secs => LEAST((msg.value->>'ttl_ms')::bigint, q.message_ttl) / 1000.0),
               CASE WHEN due > fired_at THEN sent ELSE LEAST(sent, now()) END,
               msg.value->>'unique_key',
               msg.value->>'concurrency_key'
          FROM jsonb_array_elements(e.messages) AS msg
          LEFT JOIN queues AS q ON q.name = msg.value->>'queue'
        RETURNING jobs.queue, jobs.status, jobs.run_at
    LOOP
        IF inserted.status = 'pending' THEN
            PERFORM pg_notify('pgskip:' || current_schema(), inserted.queue);
        ELSE
            PERFORM pg_notify('pgskip:' || current_schema() || ':scheduled',
                              extract(epoch FROM inserted.run_at)::text);
        END IF;
    END LOOP;
    RETURN tid;
END;
$$;

--
-- Name: beat_isoformat(timestamp with time zone); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_isoformat(t timestamp with time zone) RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || '+00:00'
$$;

--
-- Name: beat_local_to_utc(timestamp without time zone, text); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_local_to_utc(wall timestamp without time zone, tz text) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    guess       timestamptz := wall AT TIME ZONE tz;
    off_before  interval := ((guess - interval '3 hours') AT TIME ZONE tz)
                            - ((guess - interval '3 hours') AT TIME ZONE 'UTC');
    off_after   interval := ((guess + interval '3 hours') AT TIME ZONE tz)
                            - ((guess + interval '3 hours') AT TIME ZONE 'UTC');
    early       timestamptz := (wall - off_before) AT TIME ZONE 'UTC';
    late        timestamptz := (wall - off_after) AT TIME ZONE 'UTC';
BEGIN
    IF (early AT TIME ZONE tz) = wall THEN
        RETURN early;
    ELSIF (late AT TIME ZONE tz) = wall THEN
        RETURN late;
    END IF;
    RETURN early;  -- in a gap
END;
$$;

--
-- Name: beat_next_slot(pgskip.beat_entries, timestamp with time zone); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_next_slot(e pgskip.beat_entries, after timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    k          numeric;
    first_day  date;
    slot       timestamptz;
BEGIN
    IF e.kind = 'crontab' THEN
        RETURN beat_cron_next(after, e.timezone, e.minutes, e.hours, e.days_of_week,
                              e.days_of_month, e.months);
    END IF;
    IF after < e.first_slot THEN
        RETURN e.first_slot;
    END IF;
    IF e.kind = 'interval' THEN
        -- Exact integer microseconds (extract(epoch ...) is numeric).
        k := floor(extract(epoch FROM after - e.first_slot) * 1000000 / e.every_us) + 1;
        RETURN e.first_slot + interval '1 microsecond' * (k * e.every_us)::float8;
    END IF;
    first_day := (e.first_slot AT TIME ZONE e.timezone)::date;
    k := greatest(0, ceil(((after AT TIME ZONE e.timezone)::date - first_day)::numeric
                          / e.every_days));
    LOOP
        slot := beat_local_to_utc((first_day + (k * e.every_days)::integer)::timestamp,
                                  e.timezone);
        IF slot > after THEN
            RETURN slot;
        END IF;
        k := k + 1;
    END LOOP;
END;
$$;

--
-- Name: beat_payload(jsonb, jsonb, text, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.beat_payload(template jsonb, id_paths jsonb, task_id text, eta timestamp with time zone, expires timestamp with time zone) RETURNS jsonb
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    p     jsonb := template;
    path  jsonb;
BEGIN
    FOR path IN SELECT value FROM jsonb_array_elements(id_paths) LOOP
        p := jsonb_set(p, ARRAY(SELECT jsonb_array_elements_text(path)), to_jsonb(task_id));
    END LOOP;
    IF eta IS NOT NULL THEN
        p := jsonb_set(p, '{headers,eta}', to_jsonb(beat_isoformat(eta)));
    END IF;
    IF expires IS NOT NULL THEN
        p := jsonb_set(p, '{headers,expires}', to_jsonb(beat_isoformat(expires)));
    END IF;
    RETURN p;
END;
$$;

--
-- Name: claim_unique_key(); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.claim_unique_key() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    holder bigint;
BEGIN
    IF COALESCE(pg_partition_root(TG_RELID), TG_RELID) <> 'jobs'::regclass THEN
        RAISE EXCEPTION 'claim_unique_key() runs only as a trigger of jobs';
    END IF;
    LOOP
        INSERT INTO unique_keys (queue, unique_key, job_id)
        VALUES (NEW.queue, NEW.unique_key, NEW.id)
            ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
        SELECT u.job_id INTO holder
          FROM unique_keys AS u
         WHERE u.queue = NEW.queue AND u.unique_key = NEW.unique_key
           FOR UPDATE;
        IF FOUND THEN
            IF holder <> NEW.id
               AND EXISTS (SELECT FROM jobs AS j
                            WHERE j.id = holder AND j.queue = NEW.queue
                              AND j.unique_key = NEW.unique_key
                              AND j.status IN ('pending', 'scheduled', 'running')) THEN
                IF TG_OP = 'INSERT' THEN
                    RETURN NULL;
                END IF;
                UPDATE jobs SET unique_key = NULL
                 WHERE id = NEW.id AND unique_key = NEW.unique_key;
                RETURN NULL;
            END IF;
            -- Written even when it names NEW.id already: a transaction whose snapshot is older
            -- than this claim (REPEATABLE READ) then fails to serialize on the entry instead
            -- of reading the claim's message as it was before.
            UPDATE unique_keys SET job_id = NEW.id
             WHERE queue = NEW.queue AND unique_key = NEW.unique_key;
            EXIT;
        END IF;
        -- The entry was deleted (prune) after the insert found it: claim it anew.
    END LOOP;
    IF TG_OP = 'INSERT' THEN
        RETURN NEW;
    END IF;
    RETURN NULL;
END
$$;

--
-- Name: current_slot(); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.current_slot() RETURNS smallint
    LANGUAGE sql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
    SELECT slot FROM jobs_rotation
$$;

--
-- Name: expire_queues(); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.expire_queues(OUT queues bigint, OUT messages bigint) RETURNS record
    LANGUAGE sql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
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

--
-- Name: fire_due(timestamp with time zone, interval); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.fire_due(now timestamp with time zone DEFAULT now(), lookahead interval DEFAULT '00:01:30'::interval) RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
DECLARE
    e          beat_entries;
    horizon    timestamptz := fire_due.now + fire_due.lookahead;
    every      interval;
    s          timestamptz;  -- the entry's cursor: its first slot not handled yet
    late       timestamptz;  -- its newest slot before now
    nxt        timestamptz;  -- its first slot at or after now
    steps      integer;
    pace       interval;
    sent       timestamptz;
    prev_sent  timestamptz;
    tid        text;
    last_s     timestamptz;
    last_tid   text;
    fired      integer := 0;
BEGIN
    FOR e IN
        SELECT * FROM beat_entries
         WHERE next_slot IS NOT NULL AND next_slot <= horizon
         ORDER BY name
           FOR UPDATE
    LOOP
        s := e.next_slot;
        every := interval '1 microsecond' * e.every_us::float8;
        last_s := NULL;
        last_tid := NULL;
        prev_sent := NULL;
        pace := NULL;
        IF e.missed = 'all' THEN
            -- Every slot runs, late ones oldest first, each at least `pace` after the previous
            -- run (of this call or of an earlier one).
            pace := interval '60 seconds' / e.max_catchup;
            IF e.kind = 'interval' THEN
                pace := least(pace, every);
            END IF;
            SELECT max(b.sent_at) INTO prev_sent FROM beat_slots AS b WHERE b.entry = e.name;
        ELSIF s < fire_due.now THEN
            -- Late slots: one run, at once, stands for them (if the newest is within the grace,
            -- or by the 'latest' policy); then the cadence goes on.
            IF e.kind = 'interval' THEN
                nxt := beat_next_slot(e, fire_due.now - interval '1 microsecond');
                late := nxt - every;
            ELSE
                steps := 0;
                late := NULL;
                WHILE s IS NOT NULL AND s < fire_due.now LOOP
                    late := s;
                    steps := steps + 1;
                    IF steps >= 50000 THEN
                        -- A very long outage: go on from a day ago.
                        s := beat_next_slot(e, greatest(s, fire_due.now - interval '1 day'));
                        steps := 0;
                    ELSE
                        s := beat_next_slot(e, s);
                    END IF;
                END LOOP;
                nxt := s;
            END IF;
            IF fire_due.now - late <= e.grace
               OR (e.missed = 'latest'
                   AND (e.deadline IS NULL OR fire_due.now - late <= e.deadline)) THEN
                IF e.kind = 'interval' AND NOT e.relative THEN
                    -- Elapsed time: the next run one interval after this one, on a whole
                    -- second (from the same instant for sub-second intervals).
                    e.first_slot := CASE WHEN e.every_us >= 1000000
                                         THEN date_trunc('second', fire_due.now - interval '1 microsecond')
                                              + interval '1 second'
                                         ELSE fire_due.now END
                                    + every;
                    nxt := e.first_slot;
                    tid := beat_emit(e, late, fire_due.now, fire_due.now);
                ELSIF nxt IS NULL OR nxt - fire_due.now >= least(fire_due.now - late, e.grace) THEN
                    -- Wall clock: unless the next slot is nearer (and within the grace), which
                    -- then stands for this one.
                    tid := beat_emit(e, late, fire_due.now, fire_due.now);
                ELSE
                    tid := NULL;
                END IF;
                IF tid IS NOT NULL THEN
                    fired := fired + 1;
                    last_s := late;
                    last_tid := tid;
                    prev_sent := fire_due.now;
                END IF;
            END IF;
            s := nxt;
        END IF;
        WHILE s IS NOT NULL AND s <= horizon LOOP
            sent := greatest(s, fire_due.now, prev_sent + pace);
            EXIT WHEN sent > horizon;
            tid := beat_emit(e, s, sent, fire_due.now);
            IF tid IS NOT NULL THEN
                fired := fired + 1;
                last_s := s;
                last_tid := tid;
                prev_sent := sent;
            END IF;
            s := beat_next_slot(e, s);
        END LOOP;
        UPDATE beat_entries
           SET next_slot = s,
               first_slot = e.first_slot,
               last_slot = CASE WHEN last_s IS NULL THEN last_slot
                                ELSE greatest(last_slot, last_s) END,
               last_task_id = CASE WHEN last_s IS NULL OR last_s < last_slot THEN last_task_id
                                   ELSE last_tid END,
               last_fired_at = CASE WHEN last_s IS NULL THEN last_fired_at ELSE now() END
         WHERE name = e.name;
    END LOOP;
    RETURN fired;
END;
$$;

--
-- Name: prune(interval, interval); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.prune(completed_after interval DEFAULT '1 day'::interval, failed_after interval DEFAULT '14 days'::interval) RETURNS TABLE(completed bigint, failed bigint, slots bigint)
    LANGUAGE sql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
-- Stale unique-key claims first, in a statement of their own (prune_unique_keys).
SELECT prune_unique_keys(NULL);
WITH c AS (
    DELETE FROM jobs
     WHERE completed_after IS NOT NULL AND status = 'completed'
       AND finished_at < now() - completed_after
    RETURNING 1
), f AS (
    DELETE FROM jobs
     WHERE failed_after IS NOT NULL AND status = 'failed'
       AND finished_at < now() - failed_after
    RETURNING 1
), s AS (
    -- fire_due never looks back further than an entry's cursor, and a cursor never moves
    -- back past now(): records older than this only serve `beat-list` history.
    DELETE FROM beat_slots
     WHERE slot < now() - interval '35 days'
    RETURNING 1
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM f), (SELECT count(*) FROM s);
$$;

--
-- Name: prune_completed_batch(timestamp with time zone, integer); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.prune_completed_batch(cutoff timestamp with time zone, batch integer) RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
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

--
-- Name: prune_in_batches(interval, interval, integer, bigint, bigint, bigint); Type: PROCEDURE; Schema: pgskip; Owner: -
--

CREATE PROCEDURE pgskip.prune_in_batches(IN completed_after interval DEFAULT '1 day'::interval, IN failed_after interval DEFAULT '14 days'::interval, IN batch integer DEFAULT 10000, INOUT completed bigint DEFAULT NULL::bigint, INOUT failed bigint DEFAULT NULL::bigint, INOUT slots bigint DEFAULT NULL::bigint)
    LANGUAGE plpgsql
    AS $$
-- No SET clause (it would forbid COMMIT): every name is qualified, every operator too, so the
-- caller's search path resolves nothing here.
DECLARE
    cutoff timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) completed_after;
    n bigint;
BEGIN
    IF batch IS NULL OR batch OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION 'prune_in_batches: batch must be a positive number of rows, not %', batch;
    END IF;
    completed := 0;
    IF completed_after IS NOT NULL THEN
        LOOP
            n := pgskip.prune_completed_batch(cutoff, batch);
            completed := completed OPERATOR(pg_catalog.+) n;
            COMMIT;
            EXIT WHEN n OPERATOR(pg_catalog.<) batch;
        END LOOP;
    END IF;
    -- Stale unique-key claims, as many per transaction.
    LOOP
        n := pgskip.prune_unique_keys(batch);
        COMMIT;
        EXIT WHEN n OPERATOR(pg_catalog.<) batch;
    END LOOP;
    SELECT p.failed, p.slots INTO failed, slots FROM pgskip.prune(NULL, failed_after) AS p;
END
$$;

--
-- Name: prune_unique_keys(integer); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.prune_unique_keys(batch integer) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
DECLARE
    stale_queues text[];
    stale_keys   text[];
    n            bigint;
BEGIN
    SELECT array_agg(s.queue), array_agg(s.unique_key) INTO stale_queues, stale_keys
      FROM (SELECT u.queue, u.unique_key
              FROM unique_keys AS u
             WHERE NOT EXISTS (SELECT FROM jobs AS j
                                WHERE j.id = u.job_id AND j.queue = u.queue
                                  AND j.unique_key = u.unique_key
                                  AND j.status IN ('pending', 'scheduled', 'running'))
             LIMIT batch
               FOR UPDATE OF u SKIP LOCKED) AS s;
    WITH d AS (
        DELETE FROM unique_keys AS u
         USING unnest(stale_queues, stale_keys) AS p(queue, unique_key)
         WHERE u.queue = p.queue AND u.unique_key = p.unique_key
           AND NOT EXISTS (SELECT FROM jobs AS j
                            WHERE j.id = u.job_id AND j.queue = u.queue
                              AND j.unique_key = u.unique_key
                              AND j.status IN ('pending', 'scheduled', 'running'))
        RETURNING 1
    )
    SELECT count(*) INTO n FROM d;
    RETURN n;
END
$$;

--
-- Name: rotate(); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.rotate(OUT emptied integer, OUT moved bigint, OUT current smallint) RETURNS record
    LANGUAGE plpgsql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
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

--
-- Name: rotation_keeps(smallint, interval); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.rotation_keeps(k smallint, completed_retention interval) RETURNS boolean
    LANGUAGE sql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
    SELECT EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'completed'
                                      AND finished_at > now() - completed_retention)
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'pending')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'scheduled')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'running')
        OR EXISTS (SELECT FROM jobs WHERE slot = k AND status = 'failed')
$$;

--
-- Name: rotation_keeps_more(smallint, interval, bigint); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.rotation_keeps_more(k smallint, completed_retention interval, n bigint) RETURNS boolean
    LANGUAGE sql STABLE
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    AS $$
    SELECT count(*) > n
      FROM (SELECT FROM jobs
             WHERE slot = k
               AND (status IN ('scheduled', 'pending', 'running', 'failed')
                    OR (status = 'completed' AND finished_at > now() - completed_retention))
             LIMIT n + 1) AS kept
$$;

--
-- Name: sweep(integer); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.sweep(max_attempts integer DEFAULT 20) RETURNS TABLE(requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
    LANGUAGE sql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
    SELECT * FROM sweep(max_attempts, interval '0 seconds');
$$;

--
-- Name: sweep(integer, interval); Type: FUNCTION; Schema: pgskip; Owner: -
--

CREATE FUNCTION pgskip.sweep(max_attempts integer, scan_every interval) RETURNS TABLE(requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
    LANGUAGE sql
    SET search_path TO 'pgskip', 'pg_catalog', 'pg_temp'
    SET jit TO 'off'
    AS $$
-- The advisory locks held in this database, as pg_advisory_lock(bigint) keys: read after
-- this statement's snapshot was taken, so a row it sees was marked while its lock was held.
WITH held AS MATERIALIZED (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
      FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
), suspected AS (
    -- Here and in gone, a row renewed meanwhile is rechecked in its newest version (FOR
    -- UPDATE): a renewal that marked it after the locks were read has a heartbeat_at past this
    -- transaction's start, and a renewal clears lock_lost_at.
    UPDATE consumers AS c
       SET lock_lost_at = now()
     WHERE c.id IN (SELECT d.id
                      FROM consumers AS d
                     WHERE d.lock_lost_at IS NULL
                       AND d.lease_until > now()
                       AND d.lock_server_start = pg_postmaster_start_time()
                       AND d.heartbeat_at < now()
                       AND d.lock_key NOT IN (SELECT h.key FROM held AS h)
                       FOR UPDATE SKIP LOCKED)
    RETURNING c.id
), gone AS (
    DELETE FROM consumers AS c
     WHERE c.id IN (SELECT d.id
                      FROM consumers AS d
                     WHERE d.lease_until <= now()
                        OR (d.lock_lost_at <= now() - interval '2 seconds'
                            AND d.lock_server_start = pg_postmaster_start_time()
                            AND d.heartbeat_at < now()
                            AND d.lock_key NOT IN (SELECT h.key FROM held AS h))
                       FOR UPDATE SKIP LOCKED)
    RETURNING c.id
), look AS MATERIALIZED (
    -- Whether this sweep reads the running rows, for those of consumers it forgot or no longer
    -- known: where it forgot consumers itself, where the last read left rows behind, or where
    -- the last began scan_every ago or more (or is dated ahead of now(): a clock set back, or
    -- the row written so as to stop the reads).
    SELECT EXISTS (SELECT FROM gone)
           OR EXISTS (SELECT FROM sweep_scans AS s
                       WHERE NOT s.complete
                          OR s.scanned_at <= now() - scan_every
                          OR s.scanned_at > now()) AS due
), lost AS (
    -- Every running row is read here, and while a snapshot is held every row version that
    -- became running since it began, dead or not. Where look says no, a one-time filter
    -- skips the whole read.
    SELECT j.id
      FROM jobs AS j
     WHERE (SELECT l.due FROM look AS l)
       AND j.status = 'running'
       AND (j.locked_by IN (SELECT g.id FROM gone AS g)
            OR NOT EXISTS (SELECT 1 FROM consumers AS c WHERE c.id = j.locked_by))
     LIMIT 10000
       FOR UPDATE OF j SKIP LOCKED
), looked AS (
    -- When this read began, and whether it left rows behind (rows another sweep has locked
    -- are that sweep's to return). While another sweep holds the row, it writes it.
    UPDATE sweep_scans AS s
       SET scanned_at = now(), complete = (SELECT count(*) FROM lost) < 10000
     WHERE (SELECT l.due FROM look AS l)
       AND s.only_row IN (SELECT t.only_row FROM sweep_scans AS t FOR UPDATE SKIP LOCKED)
    RETURNING 1
), r AS (
    -- A message whose task finished it in its own transaction (finished_at set while
    -- running: kombu_pgskip.completing) is completed: its work committed, it never runs again.
    UPDATE jobs
       SET status = CASE WHEN jobs.finished_at IS NOT NULL THEN 'completed'
                         WHEN jobs.attempts >= max_attempts THEN 'failed'
                         ELSE 'pending' END::job_status,
           redelivered = jobs.redelivered OR jobs.finished_at IS NULL, locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.finished_at IS NOT NULL THEN jobs.finished_at
                              WHEN jobs.attempts >= max_attempts THEN now() END,
           last_error = CASE WHEN jobs.finished_at IS NULL AND jobs.attempts >= max_attempts
                             THEN 'consumer lost on each of ' || jobs.attempts
                                  || ' deliveries (max_attempts)'
                             ELSE jobs.last_error END
      FROM lost
     WHERE jobs.id = lost.id
    RETURNING jobs.queue, jobs.status
), due AS (
    SELECT id FROM jobs
     WHERE status = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT 10000
       FOR UPDATE SKIP LOCKED
), p AS (
    UPDATE jobs SET status = 'pending', run_at = LEAST(jobs.run_at, jobs.created_at)
      FROM due WHERE jobs.id = due.id RETURNING jobs.queue
), n AS (
    SELECT pg_notify('pgskip:' || current_schema(), d.queue)
      FROM (SELECT queue FROM r WHERE status = 'pending' UNION SELECT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM r WHERE status = 'pending'),
       (SELECT count(*) FROM r WHERE status = 'failed'),
       (SELECT count(*) FROM gone),
       (SELECT count(*) FROM p) + 0 * (SELECT count(*) FROM n);
$$;

--
-- Name: beat_slots; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.beat_slots (
    entry text NOT NULL,
    slot timestamp with time zone NOT NULL,
    task_id text NOT NULL,
    fired_at timestamp with time zone DEFAULT now() NOT NULL,
    sent_at timestamp with time zone NOT NULL
);

--
-- Name: COLUMN beat_slots.sent_at; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.beat_slots.sent_at IS 'when the slot''s message is sent (due, before any countdown): at the slot, or later for a late or paced run';

--
-- Name: bindings; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.bindings (
    exchange text NOT NULL,
    queue text NOT NULL,
    routing_key text DEFAULT ''::text NOT NULL,
    arguments jsonb DEFAULT '{}'::jsonb NOT NULL,
    pattern text
);

--
-- Name: consumers; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.consumers (
    id uuid NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    queues text[] DEFAULT '{}'::text[] NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    lease_until timestamp with time zone NOT NULL,
    lock_key bigint,
    lock_server_start timestamp with time zone,
    lock_lost_at timestamp with time zone
)
WITH (fillfactor='50');

--
-- Name: COLUMN consumers.lock_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.consumers.lock_key IS 'key of the session-level advisory lock (pg_advisory_lock(bigint)) the consumer''s process holds while it lives; NULL: the lease alone says whether it lives';

--
-- Name: COLUMN consumers.lock_server_start; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.consumers.lock_server_start IS 'pg_postmaster_start_time() of the server on which lock_key was taken';

--
-- Name: COLUMN consumers.lock_lost_at; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.consumers.lock_lost_at IS 'when a sweep first found lock_key released (a renewal clears it); two seconds later, dead';

--
-- Name: exchanges; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.exchanges (
    name text NOT NULL,
    type text NOT NULL,
    durable boolean DEFAULT true NOT NULL,
    auto_delete boolean DEFAULT false NOT NULL,
    arguments jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT exchanges_type_check CHECK ((type = ANY (ARRAY['direct'::text, 'topic'::text, 'fanout'::text, 'headers'::text])))
);

--
-- Name: jobs; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
PARTITION BY LIST (slot);

--
-- Name: TABLE jobs; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.jobs IS 'one row per message of a queue, in a ring of partitions by slot (jobs_rotation)';

--
-- Name: COLUMN jobs.unique_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs.unique_key IS 'no other message of the queue holds it while pending, scheduled or running (pgskip_unique)';

--
-- Name: COLUMN jobs.concurrency_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs.concurrency_key IS 'what a per-key concurrency limit of the queue counts by (pgskip_concurrency_key)';

--
-- Name: COLUMN jobs.slot; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs.slot IS 'the partition the message is in: 1 to jobs_rotation.slots, or 0 (jobs_kept)';

--
-- Name: jobs_1; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_1 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_2; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_2 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_3; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_3 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_4; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_4 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_5; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_5 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_6; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_6 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_7; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_7 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_8; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_8 (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT pgskip.current_slot() NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: jobs_id_seq; Type: SEQUENCE; Schema: pgskip; Owner: -
--

ALTER TABLE pgskip.jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME pgskip.jobs_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: jobs_kept; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_kept (
    id bigint NOT NULL,
    queue text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    status pgskip.job_status DEFAULT 'pending'::pgskip.job_status NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    payload json NOT NULL,
    task_name text,
    task_id text,
    attempts integer DEFAULT 0 NOT NULL,
    redelivered boolean DEFAULT false NOT NULL,
    locked_by uuid,
    locked_at timestamp with time zone,
    expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    delivery bigint,
    unique_key text,
    concurrency_key text,
    slot smallint DEFAULT 0 NOT NULL
)
WITH (fillfactor='70', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.05', autovacuum_vacuum_cost_delay='0');

--
-- Name: COLUMN jobs_kept.unique_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_kept.unique_key IS 'no other message of the queue holds it while pending, scheduled or running (pgskip_unique)';

--
-- Name: COLUMN jobs_kept.concurrency_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_kept.concurrency_key IS 'what a per-key concurrency limit of the queue counts by (pgskip_concurrency_key)';

--
-- Name: jobs_rotation; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.jobs_rotation (
    only_row boolean DEFAULT true NOT NULL,
    slot smallint NOT NULL,
    slots smallint NOT NULL,
    slot_rows bigint NOT NULL,
    first_id bigint NOT NULL,
    since timestamp with time zone DEFAULT now() NOT NULL,
    completed_retention interval DEFAULT '1 day'::interval NOT NULL,
    blocked_since timestamp with time zone,
    CONSTRAINT jobs_rotation_check CHECK (((slot >= 1) AND (slot <= slots))),
    CONSTRAINT jobs_rotation_only_row_check CHECK (only_row),
    CONSTRAINT jobs_rotation_slot_rows_check CHECK ((slot_rows > 0)),
    CONSTRAINT jobs_rotation_slots_check CHECK ((slots >= 2))
);

--
-- Name: TABLE jobs_rotation; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.jobs_rotation IS 'the slot of jobs new messages go to, and when rotate() moves on to the next one';

--
-- Name: COLUMN jobs_rotation.slot; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.slot IS 'the current slot: new messages go to jobs_<slot>';

--
-- Name: COLUMN jobs_rotation.slots; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.slots IS 'slots in the ring, jobs_1 to jobs_<slots>';

--
-- Name: COLUMN jobs_rotation.slot_rows; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.slot_rows IS 'ids the current slot gives out before the next';

--
-- Name: COLUMN jobs_rotation.first_id; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.first_id IS 'the first id given out in the current slot';

--
-- Name: COLUMN jobs_rotation.completed_retention; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.completed_retention IS 'a slot whose completed messages are younger than this is not emptied before it is needed (pgskip maintenance writes its completed_retention here)';

--
-- Name: COLUMN jobs_rotation.blocked_since; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.jobs_rotation.blocked_since IS 'since when rotate() has found the slots it must lock held by another session (NULL: it has not); meanwhile each call only tries one lock';

--
-- Name: migrations; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.migrations (
    version integer NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    compatible_with integer
);

--
-- Name: paused_queues; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.paused_queues (
    name text NOT NULL,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    paused_by text DEFAULT CURRENT_USER NOT NULL,
    reason text,
    CONSTRAINT paused_queues_name_check CHECK (((octet_length(name) >= 1) AND (octet_length(name) <= 255)))
);

--
-- Name: TABLE paused_queues; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.paused_queues IS 'queues whose messages no fetch takes until resumed (pgskip pause / resume)';

--
-- Name: COLUMN paused_queues.paused_by; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.paused_queues.paused_by IS 'the role that paused it';

--
-- Name: COLUMN paused_queues.reason; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.paused_queues.reason IS 'what the operator said when pausing (--reason)';

--
-- Name: queue_limits; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.queue_limits (
    name text NOT NULL,
    max_running integer,
    max_running_per_key integer,
    rate double precision,
    burst integer,
    tokens double precision,
    refilled_at timestamp with time zone,
    set_at timestamp with time zone DEFAULT now() NOT NULL,
    set_by text DEFAULT CURRENT_USER NOT NULL,
    CONSTRAINT queue_limits_burst_check CHECK ((burst > 0)),
    CONSTRAINT queue_limits_check CHECK (((max_running IS NOT NULL) OR (max_running_per_key IS NOT NULL) OR (rate IS NOT NULL))),
    CONSTRAINT queue_limits_check1 CHECK (((burst IS NULL) OR (rate IS NOT NULL))),
    CONSTRAINT queue_limits_max_running_check CHECK ((max_running > 0)),
    CONSTRAINT queue_limits_max_running_per_key_check CHECK ((max_running_per_key > 0)),
    CONSTRAINT queue_limits_name_check CHECK (((octet_length(name) >= 1) AND (octet_length(name) <= 255))),
    CONSTRAINT queue_limits_rate_check CHECK (((rate > (0)::double precision) AND (rate < 'Infinity'::double precision)))
);

--
-- Name: TABLE queue_limits; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.queue_limits IS 'queues whose messages only the limited fetch takes, within these limits (pgskip limit / unlimit)';

--
-- Name: COLUMN queue_limits.max_running; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.max_running IS 'most messages of the queue running at once, across every worker';

--
-- Name: COLUMN queue_limits.max_running_per_key; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.max_running_per_key IS 'most messages of one jobs.concurrency_key running at once';

--
-- Name: COLUMN queue_limits.rate; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.rate IS 'most messages started per second (a token bucket)';

--
-- Name: COLUMN queue_limits.burst; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.burst IS 'most tokens the bucket holds; NULL: max(1, ceil(rate))';

--
-- Name: COLUMN queue_limits.tokens; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.tokens IS 'tokens left at refilled_at (written by the limited fetch); NULL: a full bucket';

--
-- Name: COLUMN queue_limits.set_by; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.queue_limits.set_by IS 'the role that set the limits';

--
-- Name: queues; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.queues (
    name text NOT NULL,
    durable boolean DEFAULT true NOT NULL,
    auto_delete boolean DEFAULT false NOT NULL,
    arguments jsonb DEFAULT '{}'::jsonb NOT NULL,
    max_priority smallint,
    message_ttl bigint,
    expires bigint,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    last_used_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT queues_expires_check CHECK ((expires > 0)),
    CONSTRAINT queues_max_priority_check CHECK (((max_priority >= 0) AND (max_priority <= 255))),
    CONSTRAINT queues_message_ttl_check CHECK ((message_ttl >= 0)),
    CONSTRAINT queues_name_check CHECK (((octet_length(name) >= 1) AND (octet_length(name) <= 255)))
);

--
-- Name: sweep_scans; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.sweep_scans (
    only_row boolean DEFAULT true NOT NULL,
    scanned_at timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    complete boolean DEFAULT true NOT NULL,
    CONSTRAINT sweep_scans_only_row_check CHECK (only_row)
);

--
-- Name: TABLE sweep_scans; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.sweep_scans IS 'when a sweep last read every running message of jobs for those of unknown consumers';

--
-- Name: COLUMN sweep_scans.scanned_at; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.sweep_scans.scanned_at IS 'when the last such read began';

--
-- Name: COLUMN sweep_scans.complete; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.sweep_scans.complete IS 'false: it reached its batch limit, so the next sweep reads them again';

--
-- Name: unique_keys; Type: TABLE; Schema: pgskip; Owner: -
--

CREATE TABLE pgskip.unique_keys (
    queue text NOT NULL,
    unique_key text NOT NULL,
    job_id bigint NOT NULL
);

--
-- Name: TABLE unique_keys; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON TABLE pgskip.unique_keys IS 'which message claimed each unique key of a queue; held while jobs row job_id, of that queue and key, is pending, scheduled or running';

--
-- Name: COLUMN unique_keys.job_id; Type: COMMENT; Schema: pgskip; Owner: -
--

COMMENT ON COLUMN pgskip.unique_keys.job_id IS 'the message (jobs.id) that claimed the key last; it may have finished since (stale: the next claim takes the entry over)';

--
-- Name: jobs_1; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_1 FOR VALUES IN ('1');

--
-- Name: jobs_2; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_2 FOR VALUES IN ('2');

--
-- Name: jobs_3; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_3 FOR VALUES IN ('3');

--
-- Name: jobs_4; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_4 FOR VALUES IN ('4');

--
-- Name: jobs_5; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_5 FOR VALUES IN ('5');

--
-- Name: jobs_6; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_6 FOR VALUES IN ('6');

--
-- Name: jobs_7; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_7 FOR VALUES IN ('7');

--
-- Name: jobs_8; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_8 FOR VALUES IN ('8');

--
-- Name: jobs_kept; Type: TABLE ATTACH; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs ATTACH PARTITION pgskip.jobs_kept FOR VALUES IN ('0');

--
-- Name: beat_entries beat_entries_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.beat_entries
    ADD CONSTRAINT beat_entries_pkey PRIMARY KEY (name);

--
-- Name: beat_slots beat_slots_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.beat_slots
    ADD CONSTRAINT beat_slots_pkey PRIMARY KEY (entry, slot);

--
-- Name: bindings bindings_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.bindings
    ADD CONSTRAINT bindings_pkey PRIMARY KEY (exchange, queue, routing_key);

--
-- Name: consumers consumers_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.consumers
    ADD CONSTRAINT consumers_pkey PRIMARY KEY (id);

--
-- Name: exchanges exchanges_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.exchanges
    ADD CONSTRAINT exchanges_pkey PRIMARY KEY (name);

--
-- Name: jobs_1 jobs_1_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_1
    ADD CONSTRAINT jobs_1_pkey PRIMARY KEY (id);

--
-- Name: jobs_2 jobs_2_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_2
    ADD CONSTRAINT jobs_2_pkey PRIMARY KEY (id);

--
-- Name: jobs_3 jobs_3_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_3
    ADD CONSTRAINT jobs_3_pkey PRIMARY KEY (id);

--
-- Name: jobs_4 jobs_4_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_4
    ADD CONSTRAINT jobs_4_pkey PRIMARY KEY (id);

--
-- Name: jobs_5 jobs_5_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_5
    ADD CONSTRAINT jobs_5_pkey PRIMARY KEY (id);

--
-- Name: jobs_6 jobs_6_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_6
    ADD CONSTRAINT jobs_6_pkey PRIMARY KEY (id);

--
-- Name: jobs_7 jobs_7_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_7
    ADD CONSTRAINT jobs_7_pkey PRIMARY KEY (id);

--
-- Name: jobs_8 jobs_8_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_8
    ADD CONSTRAINT jobs_8_pkey PRIMARY KEY (id);

--
-- Name: jobs_kept jobs_kept_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_kept
    ADD CONSTRAINT jobs_kept_pkey PRIMARY KEY (id);

--
-- Name: jobs_rotation jobs_rotation_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.jobs_rotation
    ADD CONSTRAINT jobs_rotation_pkey PRIMARY KEY (only_row);

--
-- Name: migrations migrations_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.migrations
    ADD CONSTRAINT migrations_pkey PRIMARY KEY (version);

--
-- Name: paused_queues paused_queues_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.paused_queues
    ADD CONSTRAINT paused_queues_pkey PRIMARY KEY (name);

--
-- Name: queue_limits queue_limits_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.queue_limits
    ADD CONSTRAINT queue_limits_pkey PRIMARY KEY (name);

--
-- Name: queues queues_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.queues
    ADD CONSTRAINT queues_pkey PRIMARY KEY (name);

--
-- Name: sweep_scans sweep_scans_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.sweep_scans
    ADD CONSTRAINT sweep_scans_pkey PRIMARY KEY (only_row);

--
-- Name: unique_keys unique_keys_pkey; Type: CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.unique_keys
    ADD CONSTRAINT unique_keys_pkey PRIMARY KEY (queue, unique_key);

--
-- Name: beat_slots_sent; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX beat_slots_sent ON pgskip.beat_slots USING btree (entry, sent_at);

--
-- Name: bindings_queue; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX bindings_queue ON pgskip.bindings USING btree (queue);

--
-- Name: jobs_completed; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed ON ONLY pgskip.jobs USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_1 ON pgskip.jobs_1 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_2 ON pgskip.jobs_2 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_3 ON pgskip.jobs_3 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_4 ON pgskip.jobs_4 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_5 ON pgskip.jobs_5 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_6 ON pgskip.jobs_6 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_7 ON pgskip.jobs_7 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_8 ON pgskip.jobs_8 USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_completed_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_completed_kept ON pgskip.jobs_kept USING btree (finished_at) WHERE (status = 'completed'::pgskip.job_status);

--
-- Name: jobs_dequeue; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue ON ONLY pgskip.jobs USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_1 ON pgskip.jobs_1 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_2 ON pgskip.jobs_2 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_3 ON pgskip.jobs_3 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_4 ON pgskip.jobs_4 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_5 ON pgskip.jobs_5 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_6 ON pgskip.jobs_6 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_7 ON pgskip.jobs_7 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_8 ON pgskip.jobs_8 USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_dequeue_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_dequeue_kept ON pgskip.jobs_kept USING btree (queue, priority DESC, run_at, id) WHERE (status = 'pending'::pgskip.job_status);

--
-- Name: jobs_expiring; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring ON ONLY pgskip.jobs USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_1 ON pgskip.jobs_1 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_2 ON pgskip.jobs_2 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_3 ON pgskip.jobs_3 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_4 ON pgskip.jobs_4 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_5 ON pgskip.jobs_5 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_6 ON pgskip.jobs_6 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_7 ON pgskip.jobs_7 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_8 ON pgskip.jobs_8 USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_expiring_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_expiring_kept ON pgskip.jobs_kept USING btree (expires_at) WHERE ((expires_at IS NOT NULL) AND (status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status])));

--
-- Name: jobs_failed; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed ON ONLY pgskip.jobs USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_1 ON pgskip.jobs_1 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_2 ON pgskip.jobs_2 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_3 ON pgskip.jobs_3 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_4 ON pgskip.jobs_4 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_5 ON pgskip.jobs_5 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_6 ON pgskip.jobs_6 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_7 ON pgskip.jobs_7 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_8 ON pgskip.jobs_8 USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_failed_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_failed_kept ON pgskip.jobs_kept USING btree (queue, finished_at) WHERE (status = 'failed'::pgskip.job_status);

--
-- Name: jobs_running_rows; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows ON ONLY pgskip.jobs USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_1 ON pgskip.jobs_1 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_2 ON pgskip.jobs_2 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_3 ON pgskip.jobs_3 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_4 ON pgskip.jobs_4 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_5 ON pgskip.jobs_5 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_6 ON pgskip.jobs_6 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_7 ON pgskip.jobs_7 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_8 ON pgskip.jobs_8 USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_running_rows_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_running_rows_kept ON pgskip.jobs_kept USING btree (id) WHERE (status = 'running'::pgskip.job_status);

--
-- Name: jobs_scheduled; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled ON ONLY pgskip.jobs USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_1; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_1 ON pgskip.jobs_1 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_2; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_2 ON pgskip.jobs_2 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_3; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_3 ON pgskip.jobs_3 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_4; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_4 ON pgskip.jobs_4 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_5; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_5 ON pgskip.jobs_5 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_6; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_6 ON pgskip.jobs_6 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_7; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_7 ON pgskip.jobs_7 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_8; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_8 ON pgskip.jobs_8 USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: jobs_scheduled_kept; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX jobs_scheduled_kept ON pgskip.jobs_kept USING btree (run_at) WHERE (status = 'scheduled'::pgskip.job_status);

--
-- Name: queues_expiring; Type: INDEX; Schema: pgskip; Owner: -
--

CREATE INDEX queues_expiring ON pgskip.queues USING btree (last_used_at) WHERE (expires IS NOT NULL);

--
-- Name: jobs_completed_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_1;

--
-- Name: jobs_completed_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_2;

--
-- Name: jobs_completed_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_3;

--
-- Name: jobs_completed_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_4;

--
-- Name: jobs_completed_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_5;

--
-- Name: jobs_completed_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_6;

--
-- Name: jobs_completed_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_7;

--
-- Name: jobs_completed_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_8;

--
-- Name: jobs_completed_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_completed ATTACH PARTITION pgskip.jobs_completed_kept;

--
-- Name: jobs_dequeue_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_1;

--
-- Name: jobs_dequeue_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_2;

--
-- Name: jobs_dequeue_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_3;

--
-- Name: jobs_dequeue_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_4;

--
-- Name: jobs_dequeue_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_5;

--
-- Name: jobs_dequeue_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_6;

--
-- Name: jobs_dequeue_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_7;

--
-- Name: jobs_dequeue_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_8;

--
-- Name: jobs_dequeue_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_dequeue ATTACH PARTITION pgskip.jobs_dequeue_kept;

--
-- Name: jobs_expiring_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_1;

--
-- Name: jobs_expiring_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_2;

--
-- Name: jobs_expiring_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_3;

--
-- Name: jobs_expiring_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_4;

--
-- Name: jobs_expiring_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_5;

--
-- Name: jobs_expiring_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_6;

--
-- Name: jobs_expiring_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_7;

--
-- Name: jobs_expiring_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_8;

--
-- Name: jobs_expiring_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_expiring ATTACH PARTITION pgskip.jobs_expiring_kept;

--
-- Name: jobs_failed_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_1;

--
-- Name: jobs_failed_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_2;

--
-- Name: jobs_failed_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_3;

--
-- Name: jobs_failed_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_4;

--
-- Name: jobs_failed_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_5;

--
-- Name: jobs_failed_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_6;

--
-- Name: jobs_failed_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_7;

--
-- Name: jobs_failed_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_8;

--
-- Name: jobs_failed_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_failed ATTACH PARTITION pgskip.jobs_failed_kept;

--
-- Name: jobs_running_rows_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_1;

--
-- Name: jobs_running_rows_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_2;

--
-- Name: jobs_running_rows_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_3;

--
-- Name: jobs_running_rows_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_4;

--
-- Name: jobs_running_rows_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_5;

--
-- Name: jobs_running_rows_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_6;

--
-- Name: jobs_running_rows_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_7;

--
-- Name: jobs_running_rows_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_8;

--
-- Name: jobs_running_rows_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_running_rows ATTACH PARTITION pgskip.jobs_running_rows_kept;

--
-- Name: jobs_scheduled_1; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_1;

--
-- Name: jobs_scheduled_2; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_2;

--
-- Name: jobs_scheduled_3; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_3;

--
-- Name: jobs_scheduled_4; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_4;

--
-- Name: jobs_scheduled_5; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_5;

--
-- Name: jobs_scheduled_6; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_6;

--
-- Name: jobs_scheduled_7; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_7;

--
-- Name: jobs_scheduled_8; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_8;

--
-- Name: jobs_scheduled_kept; Type: INDEX ATTACH; Schema: pgskip; Owner: -
--

ALTER INDEX pgskip.jobs_scheduled ATTACH PARTITION pgskip.jobs_scheduled_kept;

--
-- Name: jobs jobs_claim_unique_key; Type: TRIGGER; Schema: pgskip; Owner: -
--

CREATE TRIGGER jobs_claim_unique_key BEFORE INSERT ON pgskip.jobs FOR EACH ROW WHEN (((new.unique_key IS NOT NULL) AND (new.status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status, 'running'::pgskip.job_status])))) EXECUTE FUNCTION pgskip.claim_unique_key();

--
-- Name: jobs jobs_reclaim_unique_key; Type: TRIGGER; Schema: pgskip; Owner: -
--

CREATE TRIGGER jobs_reclaim_unique_key AFTER UPDATE ON pgskip.jobs FOR EACH ROW WHEN (((new.unique_key IS NOT NULL) AND (new.status = ANY (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status, 'running'::pgskip.job_status])) AND ((old.status <> ALL (ARRAY['pending'::pgskip.job_status, 'scheduled'::pgskip.job_status, 'running'::pgskip.job_status])) OR (old.unique_key IS DISTINCT FROM new.unique_key) OR (old.queue <> new.queue)))) EXECUTE FUNCTION pgskip.claim_unique_key();

--
-- Name: beat_slots beat_slots_entry_fkey; Type: FK CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.beat_slots
    ADD CONSTRAINT beat_slots_entry_fkey FOREIGN KEY (entry) REFERENCES pgskip.beat_entries(name) ON DELETE CASCADE;

--
-- Name: bindings bindings_exchange_fkey; Type: FK CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.bindings
    ADD CONSTRAINT bindings_exchange_fkey FOREIGN KEY (exchange) REFERENCES pgskip.exchanges(name) ON DELETE CASCADE;

--
-- Name: bindings bindings_queue_fkey; Type: FK CONSTRAINT; Schema: pgskip; Owner: -
--

ALTER TABLE ONLY pgskip.bindings
    ADD CONSTRAINT bindings_queue_fkey FOREIGN KEY (queue) REFERENCES pgskip.queues(name) ON DELETE CASCADE;

--
-- Name: TYPE job_status; Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON TYPE pgskip.job_status FROM PUBLIC;

--
-- Name: FUNCTION beat_cron_next(after timestamp with time zone, tz text, minutes smallint[], hours smallint[], days_of_week smallint[], days_of_month smallint[], months smallint[]); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_cron_next(after timestamp with time zone, tz text, minutes smallint[], hours smallint[], days_of_week smallint[], days_of_month smallint[], months smallint[]) FROM PUBLIC;

--
-- Name: FUNCTION beat_emit(e pgskip.beat_entries, slot timestamp with time zone, sent timestamp with time zone, fired_at timestamp with time zone); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_emit(e pgskip.beat_entries, slot timestamp with time zone, sent timestamp with time zone, fired_at timestamp with time zone) FROM PUBLIC;

--
-- Name: FUNCTION beat_isoformat(t timestamp with time zone); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_isoformat(t timestamp with time zone) FROM PUBLIC;

--
-- Name: FUNCTION beat_local_to_utc(wall timestamp without time zone, tz text); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_local_to_utc(wall timestamp without time zone, tz text) FROM PUBLIC;

--
-- Name: FUNCTION beat_next_slot(e pgskip.beat_entries, after timestamp with time zone); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_next_slot(e pgskip.beat_entries, after timestamp with time zone) FROM PUBLIC;

--
-- Name: FUNCTION beat_payload(template jsonb, id_paths jsonb, task_id text, eta timestamp with time zone, expires timestamp with time zone); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.beat_payload(template jsonb, id_paths jsonb, task_id text, eta timestamp with time zone, expires timestamp with time zone) FROM PUBLIC;

--
-- Name: FUNCTION claim_unique_key(); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.claim_unique_key() FROM PUBLIC;

--
-- Name: FUNCTION current_slot(); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.current_slot() FROM PUBLIC;

--
-- Name: FUNCTION expire_queues(OUT queues bigint, OUT messages bigint); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.expire_queues(OUT queues bigint, OUT messages bigint) FROM PUBLIC;

--
-- Name: FUNCTION fire_due(now timestamp with time zone, lookahead interval); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.fire_due(now timestamp with time zone, lookahead interval) FROM PUBLIC;

--
-- Name: FUNCTION prune(completed_after interval, failed_after interval); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.prune(completed_after interval, failed_after interval) FROM PUBLIC;

--
-- Name: FUNCTION prune_completed_batch(cutoff timestamp with time zone, batch integer); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.prune_completed_batch(cutoff timestamp with time zone, batch integer) FROM PUBLIC;

--
-- Name: PROCEDURE prune_in_batches(IN completed_after interval, IN failed_after interval, IN batch integer, INOUT completed bigint, INOUT failed bigint, INOUT slots bigint); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON PROCEDURE pgskip.prune_in_batches(IN completed_after interval, IN failed_after interval, IN batch integer, INOUT completed bigint, INOUT failed bigint, INOUT slots bigint) FROM PUBLIC;

--
-- Name: FUNCTION prune_unique_keys(batch integer); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.prune_unique_keys(batch integer) FROM PUBLIC;

--
-- Name: FUNCTION rotate(OUT emptied integer, OUT moved bigint, OUT current smallint); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.rotate(OUT emptied integer, OUT moved bigint, OUT current smallint) FROM PUBLIC;

--
-- Name: FUNCTION rotation_keeps(k smallint, completed_retention interval); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.rotation_keeps(k smallint, completed_retention interval) FROM PUBLIC;

--
-- Name: FUNCTION rotation_keeps_more(k smallint, completed_retention interval, n bigint); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.rotation_keeps_more(k smallint, completed_retention interval, n bigint) FROM PUBLIC;

--
-- Name: FUNCTION sweep(max_attempts integer); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.sweep(max_attempts integer) FROM PUBLIC;

--
-- Name: FUNCTION sweep(max_attempts integer, scan_every interval); Type: ACL; Schema: pgskip; Owner: -
--

REVOKE ALL ON FUNCTION pgskip.sweep(max_attempts integer, scan_every interval) FROM PUBLIC;
