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
