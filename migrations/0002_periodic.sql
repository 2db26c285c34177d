-- pgskip: compatible-with 0001
-- 0002_periodic: periodic tasks fired inside PostgreSQL (pg_cron calls fire_due() every minute
-- instead of running celery beat), and the maintenance functions pg_cron runs.
--
-- `pgskip beat-sync` stores app.conf.beat_schedule in beat_entries. fire_due() walks each
-- entry's slots (the instants celery beat would send it) and inserts the message captured at
-- sync time with a fresh task id. beat_slots has one row per (entry, slot): the primary key makes
-- a second firing of the same slot, from any session, insert nothing. The slot semantics are
-- those of kombu_pgskip/schedule_spec.py, which the tests check against Celery's own classes.

CREATE TABLE beat_entries (
    name            text PRIMARY KEY,
    task            text NOT NULL,
    kind            text NOT NULL CHECK (kind IN ('crontab', 'interval', 'days')),
    -- The app's timezone (an IANA name); crontab fields and relative days are wall-clock times there.
    timezone        text NOT NULL,
    -- crontab: the field sets as Celery expands them (day of week: Sunday = 0).
    minutes         smallint[],
    hours           smallint[],
    days_of_week    smallint[],
    days_of_month   smallint[],
    months          smallint[],
    -- interval: slots at first_slot + k * every_us microseconds (elapsed time), k >= 0.
    -- days: local midnight every every_days days, starting at first_slot.
    first_slot      timestamptz,
    every_us        bigint CHECK (every_us > 0),
    every_days      integer CHECK (every_days > 0),
    schedule_key    text NOT NULL,
    description     text NOT NULL,
    -- What happens to slots that were not fired in time (the database or pg_cron was down):
    -- 'latest' fires one message for the newest missed slot, as celery beat does after a
    -- restart; 'all' fires every missed slot (at most max_catchup per run, oldest first);
    -- 'skip' fires none. A slot at most `grace` late is not missed. `deadline` (celery's
    -- beat_cron_starting_deadline) drops a 'latest' catch-up older than it.
    missed          text NOT NULL DEFAULT 'latest' CHECK (missed IN ('latest', 'all', 'skip')),
    grace           interval NOT NULL DEFAULT '2 minutes',
    deadline        interval,
    max_catchup     integer NOT NULL DEFAULT 100 CHECK (max_catchup > 0),
    -- The messages celery beat would send, as built by Celery at sync time:
    -- [{"queue": ..., "priority": ..., "ttl_ms": ..., "payload": <the row payload>}].
    messages        jsonb NOT NULL,
    -- Paths in the payload that hold the task id (headers.id, headers.root_id, ...), replaced
    -- by a new uuid per slot; fixed_task_id when the entry's options set task_id.
    id_paths        jsonb NOT NULL DEFAULT '[]',
    fixed_task_id   text,
    -- countdown and relative expires: headers eta/expires = send time + offset.
    eta_offset      interval,
    expires_offset  interval,
    digest          text NOT NULL,
    -- The first slot not handled yet (NULL: the schedule never fires again).
    next_slot       timestamptz,
    last_slot       timestamptz,
    last_task_id    text,
    last_fired_at   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (kind <> 'crontab' OR (minutes IS NOT NULL AND hours IS NOT NULL
           AND days_of_week IS NOT NULL AND days_of_month IS NOT NULL AND months IS NOT NULL)),
    CHECK (kind <> 'interval' OR (first_slot IS NOT NULL AND every_us IS NOT NULL)),
    CHECK (kind <> 'days' OR (first_slot IS NOT NULL AND every_days IS NOT NULL))
);

CREATE TABLE beat_slots (
    entry     text NOT NULL REFERENCES beat_entries (name) ON DELETE CASCADE,
    slot      timestamptz NOT NULL,
    task_id   text NOT NULL,
    fired_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (entry, slot)
);

-- A naive wall time in `tz` as an instant, exactly as Python's zoneinfo does with fold=0 (what
-- Celery's arithmetic produces): a wall time that occurs twice (clocks went back) is its first
-- occurrence; one that never occurs (clocks went forward) takes the offset from before the change.
-- PostgreSQL's own `wall AT TIME ZONE tz` picks the second occurrence, hence this function.
CREATE FUNCTION beat_local_to_utc(wall timestamp, tz text) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
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

-- The first crontab slot strictly after `after`: the earliest wall time later than the wall time
-- of `after` on which every field matches (day of month AND day of week, as Celery), as an
-- instant (beat_local_to_utc). This is celery.schedules.crontab's next run after a run at `after`.
CREATE FUNCTION beat_cron_next(after timestamptz, tz text, minutes smallint[], hours smallint[],
                               days_of_week smallint[], days_of_month smallint[],
                               months smallint[])
RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
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

-- The first slot of an entry strictly after `after` (NULL: none).
CREATE FUNCTION beat_next_slot(e beat_entries, after timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
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

-- ISO 8601 in UTC, as Celery's eta/expires headers (it writes isoformat() of an aware datetime).
CREATE FUNCTION beat_isoformat(t timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || '+00:00'
$$;

-- The payload of one firing: the captured message with a new task id, and eta/expires moved to
-- this firing's send time.
CREATE FUNCTION beat_payload(template jsonb, id_paths jsonb, task_id text, eta timestamptz,
                             expires timestamptz)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
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

-- Insert the messages of one (entry, slot), unless that slot was fired already; returns the
-- task id, or NULL when it had been fired. Slots still in the future are stored 'scheduled'
-- (workers promote them when due): that is how sub-minute intervals are staggered.
CREATE FUNCTION beat_emit(e beat_entries, slot timestamptz, fired_at timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    tid      text := COALESCE(e.fixed_task_id, gen_random_uuid()::text);
    -- Celery builds beat's message when it sends it: at the slot, or now for a late one.
    sent     timestamptz := greatest(slot, fired_at);
    due      timestamptz := greatest(slot, fired_at) + COALESCE(e.eta_offset, interval '0');
BEGIN
    INSERT INTO beat_slots (entry, slot, task_id) VALUES (e.name, slot, tid)
        ON CONFLICT ON CONSTRAINT beat_slots_pkey DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Same rules as the broker's publish: priority clamped to the queue's x-max-priority,
    -- TTL from the message or the queue.
    INSERT INTO jobs (queue, priority, status, run_at, payload, task_name, task_id, expires_at)
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
             + make_interval(secs => LEAST((msg.value->>'ttl_ms')::bigint, q.message_ttl) / 1000.0)
      FROM jsonb_array_elements(e.messages) AS msg
      LEFT JOIN queues AS q ON q.name = msg.value->>'queue';
    RETURN tid;
END;
$$;

-- Fire every entry's due slots up to now + lookahead. Called by pg_cron every minute (or by
-- `pgskip tick`); safe to call any number of times from any number of sessions: each entry is
-- locked while its cursor (next_slot) advances, and beat_slots' primary key refuses a second
-- message for a slot. Returns how many (entry, slot) pairs were fired.
CREATE FUNCTION fire_due(now timestamptz DEFAULT now(), lookahead interval DEFAULT '1 minute')
RETURNS integer
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    e          beat_entries;
    horizon    timestamptz := fire_due.now + fire_due.lookahead;
    on_time    timestamptz;
    s          timestamptz;
    late       timestamptz;
    n_late     integer;
    steps      integer;
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
        on_time := fire_due.now - e.grace;
        s := e.next_slot;
        last_s := NULL;
        last_tid := NULL;
        IF s < on_time THEN
            -- Missed slots.
            late := NULL;
            n_late := 0;
            IF e.missed = 'all' THEN
                WHILE s IS NOT NULL AND s < on_time AND n_late < e.max_catchup LOOP
                    tid := beat_emit(e, s, fire_due.now);
                    IF tid IS NOT NULL THEN
                        fired := fired + 1;
                        last_s := s;
                        last_tid := tid;
                    END IF;
                    n_late := n_late + 1;
                    s := beat_next_slot(e, s);
                END LOOP;
            ELSIF e.kind = 'interval' THEN
                s := beat_next_slot(e, on_time - interval '1 microsecond');
                late := s - interval '1 microsecond' * e.every_us::float8;
            ELSE
                steps := 0;
                WHILE s IS NOT NULL AND s < on_time LOOP
                    late := s;
                    steps := steps + 1;
                    IF steps >= 50000 THEN
                        -- A very long outage: restart the walk a day before the grace window.
                        s := beat_next_slot(e, greatest(s, on_time - interval '1 day'));
                        steps := 0;
                    ELSE
                        s := beat_next_slot(e, s);
                    END IF;
                END LOOP;
            END IF;
            IF e.missed = 'latest' AND late IS NOT NULL
               AND (s IS NULL OR s > fire_due.now)
               AND (e.deadline IS NULL OR late >= fire_due.now - e.deadline) THEN
                -- One message stands for the missed ones, unless a slot is due now anyway.
                tid := beat_emit(e, late, fire_due.now);
                IF tid IS NOT NULL THEN
                    fired := fired + 1;
                    last_s := late;
                    last_tid := tid;
                END IF;
            END IF;
        END IF;
        IF s IS NULL OR s >= on_time THEN
            WHILE s IS NOT NULL AND s <= horizon LOOP
                tid := beat_emit(e, s, fire_due.now);
                IF tid IS NOT NULL THEN
                    fired := fired + 1;
                    last_s := s;
                    last_tid := tid;
                END IF;
                s := beat_next_slot(e, s);
            END LOOP;
        END IF;
        UPDATE beat_entries
           SET next_slot = s,
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

-- Maintenance, run by pg_cron (see kombu_pgskip/maintenance.py) or by `pgskip tick`.

-- Return the rows of consumers whose lease ran out to 'pending' (or to 'failed' past
-- max_attempts deliveries), forget those consumers, and promote due 'scheduled' rows. The same
-- statement live workers run (queries.sql: sweep, promote_scheduled), for when none is running.
CREATE FUNCTION sweep(max_attempts integer DEFAULT 20)
RETURNS TABLE (requeued bigint, failed bigint, consumers_forgotten bigint, promoted bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
WITH lost AS (
    SELECT j.id
      FROM jobs AS j
     WHERE j.status = 'running'
       AND NOT EXISTS (SELECT 1 FROM consumers AS c
                        WHERE c.id = j.locked_by AND c.lease_until > now())
       FOR UPDATE OF j SKIP LOCKED
), r AS (
    UPDATE jobs
       SET status = CASE WHEN jobs.attempts >= max_attempts THEN 'failed'
                         ELSE 'pending' END::job_status,
           redelivered = true, locked_by = NULL, locked_at = NULL,
           finished_at = CASE WHEN jobs.attempts >= max_attempts THEN now() END,
           last_error = CASE WHEN jobs.attempts >= max_attempts
                             THEN 'consumer lost on each of ' || jobs.attempts
                                  || ' deliveries (max_attempts)'
                             ELSE jobs.last_error END
      FROM lost
     WHERE jobs.id = lost.id
    RETURNING jobs.queue, jobs.status
), gone AS (
    DELETE FROM consumers WHERE lease_until <= now() RETURNING id
), due AS (
    SELECT id FROM jobs
     WHERE status = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT 10000
       FOR UPDATE SKIP LOCKED
), p AS (
    UPDATE jobs SET status = 'pending' FROM due WHERE jobs.id = due.id RETURNING jobs.queue
), n AS (
    SELECT pg_notify('pgskip:' || current_schema(), d.queue)
      FROM (SELECT queue FROM r WHERE status = 'pending' UNION SELECT queue FROM p) AS d
)
SELECT (SELECT count(*) FROM r WHERE status = 'pending'),
       (SELECT count(*) FROM r WHERE status = 'failed'),
       (SELECT count(*) FROM gone),
       (SELECT count(*) FROM p) + 0 * (SELECT count(*) FROM n);
$$;

-- Delete completed rows finished longer ago than completed_after, failed ones older than
-- failed_after (NULL keeps them), and fired-slot records past the catch-up horizon.
CREATE FUNCTION prune(completed_after interval DEFAULT '1 day',
                      failed_after interval DEFAULT '14 days')
RETURNS TABLE (completed bigint, failed bigint, slots bigint)
LANGUAGE sql SET search_path FROM CURRENT AS $$
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
