-- pgskip: compatible-with 0019
-- 0029_maintenance_without_jit: the functions workers and pg_cron call run their statements
-- without JIT compilation.
--
-- PostgreSQL compiles a statement's expressions with LLVM when its estimated cost passes
-- jit_above_cost (100,000 by default; jit is on in most packaged servers). The statements of
-- sweep() join jobs, a table of nine partitions, to CTEs whose sizes the planner cannot know,
-- and are estimated past that, and past the cost where it also inlines and optimizes: each call
-- compiled them anew, about 1.9 s of server CPU for a sweep that otherwise takes 5-10 ms, on a
-- table of 80,000 messages. Every worker sweeps every sweep_interval (10 s): about a fifth of a
-- core of the server per worker. None of these statements runs long enough for compiled
-- expressions to pay for their compilation. The transport's own sessions turn jit off
-- as well (kombu_pgskip.urls.connect); this covers pg_cron's sessions, `pgskip tick`, and
-- workers behind PgBouncer, whose sessions keep the server's setting.

SELECT pg_catalog.set_config(
    'search_path', pg_catalog.format('%I, pg_catalog, pg_temp', pg_catalog.current_schema()), true);

ALTER FUNCTION sweep(integer) SET jit = off;
ALTER FUNCTION prune(interval, interval) SET jit = off;
ALTER FUNCTION prune_completed_batch(timestamptz, integer) SET jit = off;
ALTER FUNCTION prune_unique_keys(integer) SET jit = off;
ALTER FUNCTION expire_queues() SET jit = off;
ALTER FUNCTION fire_due(timestamptz, interval) SET jit = off;
ALTER FUNCTION rotate() SET jit = off;
