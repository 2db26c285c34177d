-- Runtime SQL of periodic tasks, pg_cron and maintenance, as named blocks: "-- name: description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- Blocks named cron_* run in the database that holds pg_cron (cron.database_name).

-- db_clock: the database's clock and name (sync computes interval starts from the database's time)
SELECT now(), current_database();

-- beat_lock_entries: lock every stored entry in name order (the order fire_due locks them in)
SELECT name, digest, schedule_key
  FROM {schema}.beat_entries
 ORDER BY name
   FOR UPDATE;

-- beat_insert_entry: store a new entry; its cursor starts at its first slot after now
INSERT INTO {schema}.beat_entries AS e (
    name, task, kind, timezone, minutes, hours, days_of_week, days_of_month, months,
    first_slot, every_us, every_days, schedule_key, description, missed, grace, deadline,
    max_catchup, messages, id_paths, fixed_task_id, eta_offset, expires_offset, digest)
VALUES (
    %(name)s, %(task)s, %(kind)s, %(timezone)s, %(minutes)s, %(hours)s, %(days_of_week)s,
    %(days_of_month)s, %(months)s, %(first_slot)s, %(every_us)s, %(every_days)s,
    %(schedule_key)s, %(description)s, %(missed)s, %(grace)s, %(deadline)s, %(max_catchup)s,
    %(messages)s, %(id_paths)s, %(fixed_task_id)s, %(eta_offset)s, %(expires_offset)s,
    %(digest)s)
RETURNING name;

-- beat_update_entry: replace an entry's definition (then beat_forget_waiting, and beat_restart_cursor for a new schedule)
UPDATE {schema}.beat_entries
   SET task = %(task)s, kind = %(kind)s, timezone = %(timezone)s, minutes = %(minutes)s,
       hours = %(hours)s, days_of_week = %(days_of_week)s, days_of_month = %(days_of_month)s,
       months = %(months)s,
       first_slot = CASE WHEN schedule_key = %(schedule_key)s THEN first_slot
                         ELSE %(first_slot)s END,
       every_us = %(every_us)s, every_days = %(every_days)s, schedule_key = %(schedule_key)s,
       description = %(description)s, missed = %(missed)s, grace = %(grace)s,
       deadline = %(deadline)s, max_catchup = %(max_catchup)s, messages = %(messages)s,
       id_paths = %(id_paths)s, fixed_task_id = %(fixed_task_id)s, eta_offset = %(eta_offset)s,
       expires_offset = %(expires_offset)s, digest = %(digest)s, updated_at = now()
 WHERE name = %(name)s;

-- beat_forget_waiting: delete an entry's messages still to be sent ('scheduled', sent after now) and their slot records, and move its cursor back to the first of them: they fire again with the new definition
WITH w AS (
    DELETE FROM {schema}.jobs AS j
     USING {schema}.beat_slots AS s
     WHERE s.entry = %(name)s AND s.sent_at > now()
       AND j.status = 'scheduled' AND j.run_at > now() AND j.task_id = s.task_id
    RETURNING j.task_id
), forgotten AS (
    DELETE FROM {schema}.beat_slots
     WHERE entry = %(name)s AND task_id IN (SELECT task_id FROM w)
    RETURNING slot
)
UPDATE {schema}.beat_entries
   SET next_slot = LEAST(next_slot, (SELECT min(slot) FROM forgotten))
 WHERE name = %(name)s;

-- beat_restart_cursor: a new or rescheduled entry starts at its first slot after now
UPDATE {schema}.beat_entries AS e
   SET next_slot = {schema}.beat_next_slot(e, now())
 WHERE name = %(name)s;

-- beat_delete_entry: remove an entry (its slot records go with it)
DELETE FROM {schema}.beat_entries WHERE name = %(name)s;

-- beat_list: stored entries with their next run and their last run (the newest message already sent)
SELECT e.name, e.task, e.description, e.timezone, e.missed,
       COALESCE((SELECT min(s.sent_at) FROM {schema}.beat_slots AS s
                  WHERE s.entry = e.name AND s.sent_at > now()), e.next_slot) AS next_run,
       last.sent_at, last.task_id, last.fired_at,
       (SELECT array_agg(DISTINCT m.value->>'queue') FROM jsonb_array_elements(e.messages) AS m)
  FROM {schema}.beat_entries AS e
  LEFT JOIN LATERAL (
        SELECT s.sent_at, s.task_id, s.fired_at FROM {schema}.beat_slots AS s
         WHERE s.entry = e.name AND s.sent_at <= now()
         ORDER BY s.sent_at DESC
         LIMIT 1
  ) AS last ON true
 ORDER BY e.name;

-- beat_slots_of: the slots fired for an entry, oldest first, with their task ids and when their messages are sent
SELECT slot, task_id, fired_at, sent_at
  FROM {schema}.beat_slots
 WHERE entry = %(name)s
 ORDER BY slot;

-- fire_due: fire every due slot and insert those up to now + lookahead (what the pg_cron job runs); returns how many slots fired
SELECT {schema}.fire_due(COALESCE(%(now)s::timestamptz, now()), %(lookahead)s::interval);

-- sweep: return dead consumers' rows, promote due scheduled rows (what the sweep job runs)
SELECT requeued, failed, consumers_forgotten, promoted FROM {schema}.sweep(%(max_attempts)s);

-- prune: delete old completed and failed rows in one transaction (schemas before 0007)
SELECT completed, failed, slots FROM {schema}.prune(%(completed_after)s::interval, %(failed_after)s::interval);

-- prune_in_batches: the same, committing after each batch of completed rows (what the prune job runs); a statement of its own, outside any transaction block
CALL {schema}.prune_in_batches(%(completed_after)s::interval, %(failed_after)s::interval, %(batch)s::integer);

-- has_routine: does the schema have this function or procedure (expire_queues(), prune_in_batches())
SELECT to_regprocedure(%(signature)s) IS NOT NULL;

-- failed_list: failed messages matching the filters, oldest failure first
SELECT id, queue, task_name, task_id, attempts, finished_at, last_error
  FROM {schema}.jobs
 WHERE status = 'failed'
   AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
   AND (%(task)s::text IS NULL OR task_name LIKE %(task)s::text ESCAPE '\')
   AND (%(older_than)s::interval IS NULL OR finished_at < now() - %(older_than)s::interval)
 ORDER BY finished_at, id
 LIMIT %(limit)s;

-- failed_matching: (fragment, included as {@failed_matching}) the ids of failed messages matching the filters, oldest first, locked
SELECT id FROM {schema}.jobs
 WHERE status = 'failed'
   AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
   AND (%(task)s::text IS NULL OR task_name LIKE %(task)s::text ESCAPE '\')
   AND (%(older_than)s::interval IS NULL OR finished_at < now() - %(older_than)s::interval)
 ORDER BY finished_at, id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- failed_retry: put failed messages matching the filters back to pending with a fresh attempt count; wakes workers. A message takes its unique key back if no other message of its queue holds it, else it comes back without it (the claim trigger of jobs, migration 0026; of several retried together with one key, one keeps it)
WITH picked AS ({@failed_matching}), r AS (
    UPDATE {schema}.jobs AS j
       SET status = 'pending', attempts = 0, redelivered = false, run_at = now(),
           locked_by = NULL, locked_at = NULL, finished_at = NULL
      FROM picked
     WHERE j.id = picked.id
    RETURNING j.id, j.queue
), n AS (
    SELECT pg_notify(%(channel)s, d.queue) FROM (SELECT DISTINCT queue FROM r) AS d
)
SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM n);

-- failed_purge: delete failed messages matching the filters; returns the exact count
WITH picked AS ({@failed_matching}), d AS (
    DELETE FROM {schema}.jobs AS j USING picked WHERE j.id = picked.id RETURNING 1
)
SELECT count(*) FROM d;

-- cron_probe: run in the app's database: is pg_cron installed, and where does its launcher run (visible to superusers and pg_read_all_stats members only, as is cron.database_name)
SELECT current_database(),
       current_user,
       (SELECT datname FROM pg_stat_activity WHERE backend_type = 'pg_cron launcher' LIMIT 1),
       (SELECT default_version FROM pg_available_extensions WHERE name = 'pg_cron'),
       current_setting('server_version_num')::integer,
       pg_has_role(current_user, 'pg_read_all_stats', 'USAGE');

-- cron_extension: the pg_cron version in this database (no row: extension not created)
SELECT extversion FROM pg_extension WHERE extname = 'pg_cron';

-- cron_usage: may the current user use the cron schema at all (the other checks need it)
SELECT has_schema_privilege('cron', 'USAGE');

-- cron_privileges: may the current user schedule jobs in this database, and in another one
SELECT has_function_privilege('cron.schedule(text,text,text)', 'EXECUTE'),
       CASE WHEN to_regprocedure('cron.schedule_in_database(text,text,text,text,text,boolean)') IS NULL
            THEN false
            ELSE has_function_privilege('cron.schedule_in_database(text,text,text,text,text,boolean)', 'EXECUTE')
       END;

-- cron_schedule: create or update a job running in pg_cron's own database (upsert by name)
SELECT cron.schedule(%(name)s::text, %(schedule)s::text, %(command)s::text);

-- cron_schedule_in_database: create or update a job running in another database (upsert by name)
SELECT cron.schedule_in_database(%(name)s::text, %(schedule)s::text, %(command)s::text, %(database)s::text);

-- cron_jobs: this user's jobs whose name starts with the prefix
SELECT jobid, jobname, schedule, command, database, active
  FROM cron.job
 WHERE starts_with(jobname, %(prefix)s)
 ORDER BY jobname;

-- cron_unschedule: remove one job
SELECT cron.unschedule(%(jobid)s::bigint);

-- cron_last_runs: the latest run of each job whose name starts with the prefix (by run id: a run that could not connect has no start time)
SELECT DISTINCT ON (j.jobname) j.jobname, d.status, d.start_time, d.return_message
  FROM cron.job AS j
  JOIN cron.job_run_details AS d ON d.jobid = j.jobid
 WHERE starts_with(j.jobname, %(prefix)s)
 ORDER BY j.jobname, d.runid DESC;

-- cron_settings: how pg_cron runs jobs and the server's port; a row only for what this role may read (the cron.* settings are superusers' and pg_read_all_settings')
SELECT name, setting
  FROM pg_settings
 WHERE name IN ('cron.host', 'cron.use_background_workers', 'cron.log_run', 'port');

-- cron_run_mark: the newest run id of the jobs whose name starts with the prefix (0 when none); later runs have higher ids
SELECT COALESCE(max(d.runid), 0)
  FROM cron.job AS j
  JOIN cron.job_run_details AS d ON d.jobid = j.jobid
 WHERE starts_with(j.jobname, %(prefix)s);

-- cron_runs_after: the runs, finished or not, of the jobs whose name starts with the prefix with a run id above the mark, newest first; a run that could not connect has no start or end time
SELECT j.jobname, d.runid, d.status, d.return_message, d.database, d.username, d.end_time,
       extract(epoch FROM now() - d.end_time)::float8
  FROM cron.job AS j
  JOIN cron.job_run_details AS d ON d.jobid = j.jobid
 WHERE starts_with(j.jobname, %(prefix)s) AND d.runid > %(mark)s
 ORDER BY d.runid DESC
 LIMIT 50;

-- cron_recent_runs: the latest finished runs (at most per_job) of each job whose name starts with the prefix, newest first
SELECT j.jobname, r.runid, r.status, r.return_message, r.database, r.username, r.end_time,
       extract(epoch FROM now() - r.end_time)::float8
  FROM cron.job AS j
 CROSS JOIN LATERAL (
        SELECT d.runid, d.status, d.return_message, d.database, d.username, d.end_time
          FROM cron.job_run_details AS d
         WHERE d.jobid = j.jobid AND d.status IN ('succeeded', 'failed')
         ORDER BY d.runid DESC
         LIMIT %(per_job)s
  ) AS r
 WHERE starts_with(j.jobname, %(prefix)s)
 ORDER BY r.runid DESC;
