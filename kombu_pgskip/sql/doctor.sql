-- SQL of `pgskip doctor`, as named blocks: "-- name: description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.
-- %(schema)s is the schema's name as a value.

-- schema_owner: the schema's owner (no row when the schema does not exist)
SELECT n.nspowner::regrole::text FROM pg_namespace AS n WHERE n.nspname = %(schema)s;

-- routines: every function and procedure of the schema: name(arguments), kind (f or p), whether SECURITY DEFINER, its configured search_path (NULL when none), whether PUBLIC may execute it
SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')', p.prokind::text,
       p.prosecdef,
       (SELECT substr(c, length('search_path=') + 1)
          FROM unnest(p.proconfig) AS c
         WHERE c LIKE 'search\_path=%%') AS search_path,
       EXISTS (SELECT 1
                 FROM aclexplode(COALESCE(p.proacl, acldefault('f', p.proowner))) AS a
                WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public_execute
  FROM pg_proc AS p
  JOIN pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = %(schema)s
 ORDER BY 1;

-- public_types: the schema's types that PUBLIC may use (in functions and operators of its own)
SELECT t.oid::regtype::text
  FROM pg_type AS t
  JOIN pg_namespace AS n ON n.oid = t.typnamespace
 WHERE n.nspname = %(schema)s AND t.typcategory <> 'A'
   AND EXISTS (SELECT 1 FROM aclexplode(COALESCE(t.typacl, acldefault('T', t.typowner))) AS a
                WHERE a.grantee = 0 AND a.privilege_type = 'USAGE')
 ORDER BY 1;

-- creators: the roles that may create objects in schema %(name)s other than superusers, its owner, members of its owner and the schema's own roles pg_* (no row when no such schema)
SELECT r.rolname::text
  FROM pg_roles AS r, pg_namespace AS n
 WHERE n.nspname = %(name)s
   AND NOT r.rolsuper AND r.oid <> n.nspowner AND NOT pg_has_role(r.oid, n.nspowner, 'USAGE')
   AND r.rolname !~ '^pg_'
   AND has_schema_privilege(r.oid, n.oid, 'CREATE')
 ORDER BY 1;

-- broker_roles: the roles that may use the schema, other than superusers, its owner and members of its owner: name, whether it may delete messages (a worker, as `pgskip grant` makes one)
SELECT r.rolname::text, has_table_privilege(r.oid, c.oid, 'DELETE')
  FROM pg_roles AS r, pg_namespace AS n
  JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = 'jobs'
 WHERE n.nspname = %(schema)s
   AND NOT r.rolsuper AND r.oid <> n.nspowner AND NOT pg_has_role(r.oid, n.nspowner, 'USAGE')
   AND r.rolname !~ '^pg_'
   AND has_schema_privilege(r.oid, n.oid, 'USAGE')
 ORDER BY 1;

-- privileges: what role %(role)s may do to the schema's tables and sequences (directly, as a member of another role, or through PUBLIC): (relation, privilege, column), column NULL for the whole relation; routines it may execute as (name(arguments), 'EXECUTE', NULL)
SELECT c.relname::text, p.priv, NULL::text
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                         'TRIGGER']) AS p(priv)
 WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
   AND has_table_privilege(%(role)s, c.oid, p.priv)
UNION ALL
SELECT c.relname::text, p.priv, a.attname::text
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
  JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'REFERENCES']) AS p(priv)
 WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
   AND NOT has_table_privilege(%(role)s, c.oid, p.priv)
   AND has_column_privilege(%(role)s, c.oid, a.attnum, p.priv)
UNION ALL
SELECT c.relname::text, p.priv, NULL::text
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 CROSS JOIN unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) AS p(priv)
 WHERE n.nspname = %(schema)s AND c.relkind = 'S'
   AND has_sequence_privilege(%(role)s, c.oid, p.priv)
UNION ALL
SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')', 'EXECUTE', NULL::text
  FROM pg_proc AS p
  JOIN pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = %(schema)s AND has_function_privilege(%(role)s, p.oid, 'EXECUTE')
 ORDER BY 1, 2, 3;

-- foreign_owners: objects of the schema owned by a role other than the schema's owner (an owner may do anything to its object): (object, owner)
SELECT c.oid::regclass::text, c.relowner::regrole::text
  FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relowner <> n.nspowner
UNION ALL
SELECT p.oid::regprocedure::text, p.proowner::regrole::text
  FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = %(schema)s AND p.proowner <> n.nspowner
UNION ALL
SELECT t.oid::regtype::text, t.typowner::regrole::text
  FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
 WHERE n.nspname = %(schema)s AND t.typowner <> n.nspowner AND t.typcategory <> 'A'
 ORDER BY 1;

-- role_search_path: the search_path role %(role)s's sessions in this database start with, as set for the role in this database, for the role, or for the database (NULL: none of these, so the server's, "$user", public unless postgresql.conf says otherwise)
SELECT (SELECT substr(c, length('search_path=') + 1)
          FROM pg_db_role_setting AS s, unnest(s.setconfig) AS c
         WHERE c LIKE 'search\_path=%%'
           AND (s.setrole, s.setdatabase) = (r.oid, d.oid))
       , (SELECT substr(c, length('search_path=') + 1)
            FROM pg_db_role_setting AS s, unnest(s.setconfig) AS c
           WHERE c LIKE 'search\_path=%%'
             AND (s.setrole, s.setdatabase) = (r.oid, 0::oid))
       , (SELECT substr(c, length('search_path=') + 1)
            FROM pg_db_role_setting AS s, unnest(s.setconfig) AS c
           WHERE c LIKE 'search\_path=%%'
             AND (s.setrole, s.setdatabase) = (0::oid, d.oid))
  FROM pg_roles AS r, pg_database AS d
 WHERE r.rolname = %(role)s AND d.datname = current_database();

-- jobs_storage: the storage parameters set on the schema's jobs table, or once it is partitioned (migration 0027) on jobs_kept, the partition vacuum looks after (NULL when none is), whether autovacuum runs at all on this server (autovacuum and track_counts), and that table's name; no row when there is no such table
SELECT c.reloptions,
       current_setting('autovacuum') = 'on' AND current_setting('track_counts') = 'on',
       c.relname::text
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname IN ('jobs', 'jobs_kept') AND c.relkind = 'r'
 ORDER BY c.relname = 'jobs_kept' DESC
 LIMIT 1;

-- invalid_indexes: indexes on the schema's tables that queries may not use (pg_index.indisvalid false, as a failed or a running CREATE INDEX CONCURRENTLY leaves them): (index, table, its definition, the pid of a concurrent index build running on that table now, NULL when none is or this role may not see it)
SELECT i.indexrelid::regclass::text, i.indrelid::regclass::text,
       pg_get_indexdef(i.indexrelid),
       (SELECT p.pid FROM pg_stat_progress_create_index AS p
         WHERE p.relid = i.indrelid
           AND p.command IN ('CREATE INDEX CONCURRENTLY', 'REINDEX CONCURRENTLY')
         ORDER BY p.index_relid = i.indexrelid DESC
         LIMIT 1)
  FROM pg_index AS i
  JOIN pg_class AS t ON t.oid = i.indrelid
  JOIN pg_namespace AS n ON n.oid = t.relnamespace
 WHERE n.nspname = %(schema)s AND NOT i.indisvalid
 ORDER BY 1;
