-- pgskip: compatible-with 0001
-- 0001_initial: the message table, queues, exchanges and bindings, consumers and their leases.
--
-- The runner executes this file with search_path set to the target schema (default "pgskip"),
-- so names here are unqualified. Functions pin their search_path with SET search_path FROM
-- CURRENT so that callers with any search_path (pg_cron, other roles) reach the same tables.

-- Queues declared by kombu (queue_declare). Messages do not reference this table: a message can
-- be published to a queue nobody declared yet, as with Redis.
CREATE TABLE queues (
    name          text PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 255),
    durable       boolean NOT NULL DEFAULT true,
    auto_delete   boolean NOT NULL DEFAULT false,
    arguments     jsonb NOT NULL DEFAULT '{}',
    -- x-max-priority: priorities above it are clamped to it; NULL means 0-9 as AMQP.
    max_priority  smallint CHECK (max_priority BETWEEN 0 AND 255),
    -- x-message-ttl and x-expires, in milliseconds.
    message_ttl   bigint CHECK (message_ttl >= 0),
    expires       bigint CHECK (expires > 0),
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_used_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE exchanges (
    name         text PRIMARY KEY,
    type         text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout', 'headers')),
    durable      boolean NOT NULL DEFAULT true,
    auto_delete  boolean NOT NULL DEFAULT false,
    arguments    jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE bindings (
    exchange     text NOT NULL REFERENCES exchanges (name) ON DELETE CASCADE,
    queue        text NOT NULL REFERENCES queues (name) ON DELETE CASCADE,
    routing_key  text NOT NULL DEFAULT '',
    arguments    jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (exchange, queue, routing_key)
);
CREATE INDEX bindings_queue ON bindings (queue);

-- A live consumer (one per consuming kombu channel). Its lease is renewed by a heartbeat thread
-- in the worker; when the lease runs out, the rows it holds go back to pending. One row per
-- consumer is renewed instead of one per held message.
CREATE TABLE consumers (
    id            uuid PRIMARY KEY,
    hostname      text NOT NULL,
    pid           integer NOT NULL,
    queues        text[] NOT NULL DEFAULT '{}',
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    lease_until   timestamptz NOT NULL
) WITH (fillfactor = 50);

CREATE TYPE job_status AS ENUM ('scheduled', 'pending', 'running', 'completed', 'failed');

-- One row per message. Task ids are not unique: task.retry() publishes a new message with the
-- same task id.
CREATE TABLE jobs (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue        text NOT NULL,
    priority     smallint NOT NULL DEFAULT 0,
    status       job_status NOT NULL DEFAULT 'pending',
    -- Not deliverable before run_at. Far-future ETAs are stored as 'scheduled' and promoted to
    -- 'pending' when due, so they stay out of the dequeue index.
    run_at       timestamptz NOT NULL DEFAULT now(),
    -- The kombu message as JSON: body (encoded), headers, properties, content type/encoding.
    payload      json NOT NULL,
    task_name    text,
    task_id      text,
    attempts     integer NOT NULL DEFAULT 0,
    redelivered  boolean NOT NULL DEFAULT false,
    -- Lease owner: the consumer holding the row while it is running; its deadline is the
    -- owner's consumers.lease_until.
    locked_by    uuid,
    locked_at    timestamptz,
    -- x-message-ttl: not delivered after this instant (dropped by the sweeper).
    expires_at   timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    last_error   text
) WITH (
    -- Room on each page for HOT updates; aggressive autovacuum because rows churn.
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- The dequeue path: only pending rows, in fetch order.
CREATE INDEX jobs_dequeue ON jobs (queue, priority DESC, run_at, id) WHERE status = 'pending';
-- Promotion of due scheduled rows.
CREATE INDEX jobs_scheduled ON jobs (run_at) WHERE status = 'scheduled';
-- Fenced transitions and the sweeper: rows held by a consumer.
CREATE INDEX jobs_running ON jobs (locked_by) WHERE status = 'running';
-- Dropping messages whose TTL ran out (few rows have one).
CREATE INDEX jobs_expiring ON jobs (expires_at)
    WHERE expires_at IS NOT NULL AND status IN ('pending', 'scheduled');
-- Listing and retrying dead letters.
CREATE INDEX jobs_failed ON jobs (queue, finished_at) WHERE status = 'failed';

-- Every insert of deliverable rows wakes listening workers at commit (NOTIFY is transactional:
-- a rolled-back insert wakes nobody). Identical notifications in one transaction are merged by
-- PostgreSQL, so a bulk insert sends one per queue.
CREATE FUNCTION notify_jobs_inserted() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_notify('pgskip:' || TG_TABLE_SCHEMA, q.queue)
       FROM (SELECT DISTINCT queue FROM new_rows WHERE status = 'pending') AS q;
    -- Far-future messages: tell workers when the earliest is due, so one of them promotes it
    -- on time instead of at its next poll.
    PERFORM pg_notify('pgskip:' || TG_TABLE_SCHEMA || ':scheduled',
                      extract(epoch FROM min(run_at))::text)
       FROM new_rows WHERE status = 'scheduled' HAVING count(*) > 0;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_notify_insert
    AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_jobs_inserted();
