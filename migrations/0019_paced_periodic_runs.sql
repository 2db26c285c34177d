-- pgskip: compatible-with 0018
-- 0019_paced_periodic_runs: the runs of a periodic entry never come in a burst.
--
-- Until 0018, fire_due() sent every slot at most `grace` late as if it were on time: the slots
-- between a `beat-sync` and pg_cron's first tick, or those a late tick found, were all sent at
-- that tick, at the same instant (four runs of a 10-second entry within 3 ms). Now:
--
-- * a late slot within the grace runs once, at once, and stands for the other late ones. An
--   interval entry then counts its next run from that one, one interval later, as celery beat
--   counts from its last run (on a whole second); a crontab or relative entry keeps its wall
--   clock, and when its next slot comes sooner than the late one is late (and within the
--   grace) that next run stands for it instead, so that two runs never come closer than half
--   the gap between their slots or, if that is less, than the grace;
-- * slots missed beyond the grace follow the entry's policy as before ('latest': one run, by
--   the same rule; 'skip': none); 'all' runs every one, oldest first, paced: each at least
--   60 s / max_catchup after the previous one (no more than the interval of an interval
--   entry), never several at the same instant;
-- * fire_due() inserts the slots up to 90 seconds ahead by default (it was one minute), so
--   that a minutely tick up to half a minute late finds no slot late.
--
-- beat_slots.sent_at records when each slot's message is sent (it becomes due, before any
-- countdown): at its slot, or later for a late or paced run. beat_entries.relative says which
-- entries keep to the wall clock. Code of 0018 runs with this schema: it reads neither column
-- and calls fire_due() with the same arguments.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

ALTER TABLE beat_slots ADD COLUMN sent_at timestamptz;
-- As beat_emit() of 0004 sent them: at the slot, or when fired if that was later.
UPDATE beat_slots SET sent_at = greatest(slot, fired_at);
ALTER TABLE beat_slots ALTER COLUMN sent_at SET NOT NULL;
COMMENT ON COLUMN beat_slots.sent_at IS
    'when the slot''s message is sent (due, before any countdown): at the slot, or later for a '
    'late or paced run';
-- An entry's next and last runs (beat-list), its newest run (pacing), its messages sent later
-- than now (a changed entry's are replaced).
CREATE INDEX beat_slots_sent ON beat_slots (entry, sent_at);

-- schedule_key is kombu_pgskip.schedule_spec's name of the schedule ("every 1 hour, relative
-- [Europe/Berlin]"): relative schedules are rounded to the wall clock as Celery rounds them.
ALTER TABLE beat_entries ADD COLUMN relative boolean NOT NULL
    GENERATED ALWAYS AS (strpos(schedule_key, ', relative') > 0) STORED;
COMMENT ON COLUMN beat_entries.relative IS
    'a relative=True schedule (kept to the wall clock after a late run, as crontab entries are)';

-- Insert the messages of one (entry, slot), sent at `sent`, unless that slot was fired already;
-- returns the task id, or NULL when it had been fired. Messages sent after fired_at are stored
-- 'scheduled' (workers promote them when due): that is how sub-minute intervals are staggered.
CREATE FUNCTION beat_emit(e beat_entries, slot timestamptz, sent timestamptz,
                          fired_at timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
    -- TTL from the message or the queue.
    FOR inserted IN
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
REVOKE ALL ON FUNCTION beat_emit(beat_entries, timestamptz, timestamptz, timestamptz) FROM PUBLIC;

-- Fire every entry's due slots up to now + lookahead. Called by pg_cron every minute (or by
-- `pgskip tick`, or by `beat-sync` right after it stores the schedule); safe to call any number
-- of times from any number of sessions: each entry is locked while its cursor (next_slot)
-- advances, and beat_slots' primary key refuses a second message for a slot. Returns how many
-- (entry, slot) pairs were fired.
CREATE OR REPLACE FUNCTION fire_due(now timestamptz DEFAULT now(),
                                    lookahead interval DEFAULT '90 seconds')
RETURNS integer
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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

DROP FUNCTION beat_emit(beat_entries, timestamptz, timestamptz);
