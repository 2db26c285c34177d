-- pgskip: compatible-with 0004
-- 0009_consumers_by_queue: publishes find a queue's consumers that want a NOTIFY by an index.
--
-- A publish decides whether to NOTIFY by reading the polling flags of the queue's consumers
-- (migration 0008): every quiet publish, and one announcement in eight. That read scanned
-- every row of consumers, one per consuming channel of every worker (its task queues, its
-- remote-control queue), so its cost grew with the fleet: 2,000 rows added about 200 us to a
-- quiet publish (docs/performance.md, fifteenth session).
--
-- This GIN index holds the consumers that do not poll, by queue: the read first asks it
-- whether one of them consumes the queue (one lookup), and only when none does looks for any
-- consumer of the queue at all, which stops at the first it finds. fastupdate is off: a lookup
-- would otherwise also read the list of entries not yet merged into the index. The flag
-- changes rarely (a worker starts or stops polling); lease renewals, which are frequent,
-- change no indexed column and stay HOT updates.
CREATE INDEX IF NOT EXISTS consumers_notified ON consumers USING gin (queues)
    WITH (fastupdate = off) WHERE NOT polling;
