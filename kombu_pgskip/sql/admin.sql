-- SQL of the schema owner's deliberate changes, as named blocks: "-- name: description".
-- {schema} is replaced by the quoted schema identifier; values are always bound parameters.

-- queue_arguments: a declared queue's arguments, locked until the transaction ends (no row when it does not exist)
SELECT arguments FROM {schema}.queues WHERE name = %(name)s FOR UPDATE;

-- set_queue_arguments: replace a declared queue's arguments and the settings read from them (x-max-priority, x-message-ttl, x-expires); its x-expires clock starts again
UPDATE {schema}.queues
   SET arguments = %(arguments)s::jsonb, max_priority = %(max_priority)s,
       message_ttl = %(message_ttl)s, expires = %(expires)s, last_used_at = now()
 WHERE name = %(name)s;
