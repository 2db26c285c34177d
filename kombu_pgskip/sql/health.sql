-- Runtime SQL of the worker's health checks, as named blocks: "-- name: description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.

-- xmin_holders: what holds back this database's xmin horizon (sessions with an old snapshot or xid, prepared transactions, replication slots), oldest first; held_seconds is a lower bound from the server's clock (NULL when not visible to this role)
SELECT h.kind, h.who, h.usename, h.application_name, h.state, h.xmin::text, age(h.xmin),
       h.held_seconds, h.xact_seconds, h.query
  FROM (
        SELECT 'session' AS kind, a.pid::text AS who, a.usename::text AS usename,
               a.application_name, a.state, COALESCE(a.backend_xmin, a.backend_xid) AS xmin,
               -- An idle transaction's snapshot cannot move; an active one is as old as its statement.
               extract(epoch FROM now() - CASE WHEN a.state LIKE 'idle in transaction%%'
                                               THEN a.state_change ELSE a.query_start END)::float8
                   AS held_seconds,
               extract(epoch FROM now() - a.xact_start)::float8 AS xact_seconds,
               a.query
          FROM pg_stat_activity AS a
         WHERE a.pid <> pg_backend_pid()
           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND (a.datname = current_database() OR a.backend_type = 'walsender')
           AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
        UNION ALL
        SELECT 'prepared transaction', p.gid, p.owner::text, NULL, 'prepared', p.transaction,
               extract(epoch FROM now() - p.prepared)::float8,
               extract(epoch FROM now() - p.prepared)::float8, NULL
          FROM pg_prepared_xacts AS p
         WHERE p.database = current_database()
        UNION ALL
        SELECT 'replication slot', s.slot_name::text, NULL, NULL,
               CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.xmin, NULL, NULL, NULL
          FROM pg_replication_slots AS s
         WHERE s.xmin IS NOT NULL
       ) AS h
 ORDER BY age(h.xmin) DESC
 LIMIT %(limit)s;

-- write_access: may this session write, and if not, why: (read only, standby, where default_transaction_read_only was set, user, database)
SELECT current_setting('transaction_read_only') = 'on',
       pg_is_in_recovery(),
       (SELECT source FROM pg_settings WHERE name = 'default_transaction_read_only'),
       current_user::text,
       current_database()::text;

-- ring_blocked: how many seconds ago a rotation was first refused the lock of a slot of jobs it would empty (NULL while rotations get their locks), and the sessions and prepared transactions that hold a lock on a slot other than the current one and began before that refusal or over a second ago, or whose start this role may not see (but the broker's own sessions, which hold a slot for a statement): kind, pid or gid, user, application, state, seconds since its transaction began, its query; oldest first, one row with NULLs when there is none
SELECT extract(epoch FROM now() - r.blocked_since)::float8,
       h.kind, h.who, h.usename, h.application_name, h.state, h.xact_seconds, h.query
  FROM {schema}.jobs_rotation AS r
  LEFT JOIN LATERAL (
        SELECT DISTINCT
               CASE WHEN l.pid IS NULL THEN 'prepared transaction' ELSE 'session' END AS kind,
               COALESCE(l.pid::text, p.gid) AS who,
               COALESCE(a.usename, p.owner)::text AS usename, a.application_name,
               CASE WHEN l.pid IS NULL THEN 'prepared' ELSE a.state END AS state,
               extract(epoch FROM now() - COALESCE(a.xact_start, p.prepared))::float8
                   AS xact_seconds,
               a.query
          FROM pg_locks AS l
          JOIN pg_inherits AS i ON i.inhrelid = l.relation
          JOIN pg_class AS c ON c.oid = l.relation
          LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
          -- A prepared transaction's locks have no pid; its xid lock shares their
          -- virtualtransaction.
          LEFT JOIN pg_locks AS x
                 ON l.pid IS NULL AND x.pid IS NULL AND x.locktype = 'transactionid'
                AND x.virtualtransaction = l.virtualtransaction
          LEFT JOIN pg_prepared_xacts AS p ON p.transaction = x.transactionid
         WHERE r.blocked_since IS NOT NULL  -- otherwise nothing is read
           AND i.inhparent = '{schema}.jobs'::regclass
           AND c.relname NOT IN ('jobs_kept', 'jobs_' || r.slot)
           AND l.locktype = 'relation' AND l.granted
           AND l.database = (SELECT d.oid FROM pg_database AS d
                              WHERE d.datname = current_database())
           AND l.pid IS DISTINCT FROM pg_backend_pid()
           AND (COALESCE(a.xact_start, p.prepared)
                    <= GREATEST(r.blocked_since, now() - interval '1 second')
                OR (COALESCE(a.xact_start, p.prepared) IS NULL
                    AND a.application_name IS DISTINCT FROM 'kombu-pgskip'))
       ) AS h ON true
 ORDER BY h.xact_seconds DESC NULLS LAST
 LIMIT %(limit)s;
