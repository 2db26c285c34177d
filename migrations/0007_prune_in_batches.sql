-- pgskip: compatible-with 0004
-- 0007_prune_in_batches: the prune job deletes in batches, each in a transaction of its own.
--
-- prune() deletes every completed row that came of age in one statement. With the default
-- retention of a day and an hourly job, that is an hour of messages: 3.6 million rows at
-- 1,000 tasks/s, one transaction that holds back the xmin horizon while it runs, so that no
-- vacuum anywhere in the database can remove what died meanwhile. prune_in_batches() deletes
-- `batch` rows at a time, oldest first (through the jobs_completed index of migration 0006),
-- and commits after each batch; failed rows and old fired-slot records (few) are left to
-- prune() in a last transaction. It returns how many rows of each kind it deleted.
--
-- A procedure that commits must be called on its own: a lone `CALL` statement, outside an
-- explicit transaction block (as pg_cron runs a job's command, in both of its modes, and as
-- `pgskip tick` runs it). And it cannot carry a `SET search_path` clause, which would forbid
-- transaction control, so it is created with this schema's name written into its body.
DO $migration$
BEGIN
    EXECUTE format($create$
CREATE PROCEDURE %1$I.prune_in_batches(
    completed_after interval DEFAULT '1 day',
    failed_after interval DEFAULT '14 days',
    batch integer DEFAULT 10000,
    INOUT completed bigint DEFAULT NULL,
    INOUT failed bigint DEFAULT NULL,
    INOUT slots bigint DEFAULT NULL)
LANGUAGE plpgsql AS $body$
DECLARE
    cutoff timestamptz := pg_catalog.now() - completed_after;
    n bigint;
BEGIN
    IF batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'prune_in_batches: batch must be a positive number of rows, not %%', batch;
    END IF;
    completed := 0;
    IF completed_after IS NOT NULL THEN
        LOOP
            DELETE FROM %1$I.jobs
             WHERE id IN (SELECT id FROM %1$I.jobs
                           WHERE status = 'completed' AND finished_at < cutoff
                           ORDER BY finished_at
                           LIMIT batch);
            GET DIAGNOSTICS n = ROW_COUNT;
            completed := completed + n;
            COMMIT;
            EXIT WHEN n < batch;
        END LOOP;
    END IF;
    SELECT p.failed, p.slots INTO failed, slots FROM %1$I.prune(NULL, failed_after) AS p;
END
$body$
$create$, current_schema());
END
$migration$;
