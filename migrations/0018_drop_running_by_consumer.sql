-- pgskip: compatible-with 0016
-- 0018_drop_running_by_consumer: the index of running rows keyed by consumer goes.
--
-- Migration 0017 built jobs_running_rows, keyed by id, which serves every statement that used
-- this one. Code of 0016 runs with either.
DROP INDEX IF EXISTS jobs_running;
