"""Least privilege: the GRANTs a worker role and a publisher role need on the broker's schema.

Three roles (docs/security.md):

owner
    owns the schema (runs ``pgskip migrate``, ``beat-sync``, ``maintenance``; its pg_cron jobs
    run as it) and runs ``pgskip grant``. Never used by workers or web processes.
worker
    consumes: fetches, acks, requeues, fails, leases, sweeps, promotes scheduled messages,
    expires queues; declares and deletes queues, exchanges and bindings; publishes (tasks that
    start tasks, remote-control replies, events). It cannot change the schema (no ``CREATE``
    on it, owns nothing), a declared queue's arguments, nor the periodic-task tables.
publisher
    inserts messages (only the columns a publish writes) and declares what Celery declares on
    first publish (queues, exchanges, bindings: insert, never change or delete). Of ``jobs``
    it may read only the columns ``INSERT ... RETURNING`` and queue sizes need (``id``,
    ``queue``, ``status``): not the bodies, headers or errors of other messages. It may not
    update or delete messages, and executes no function of the schema.

Every statement names the role and schema through ``psycopg.sql.Identifier``. Grants only add:
running the command again changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from . import exceptions
from .urls import connect, mask_url, to_conninfo

ALL_ROWS = "SELECT, INSERT, UPDATE, DELETE"
#: The slots of jobs (migration 0027): partitions jobs_1 to jobs_8, and jobs_kept.
JOB_SLOTS = 8

# (table, privileges, columns): columns restrict the privileges to them (column-level grant).
Privilege = tuple[str, str, tuple[str, ...]]
#: Declaring refreshes a queue's x-expires clock; nothing else of a declared queue, exchange
#: or binding changes after its first declaration (AMQP: a different one fails), except by
#: the owner (``pgskip queue-args``).
QUEUE_CLOCK: Privilege = ("queues", "UPDATE", ("last_used_at",))
WORKER_PRIVILEGES: tuple[Privilege, ...] = (
    ("jobs", ALL_ROWS, ()),
    ("queues", "SELECT, INSERT, DELETE", ()),
    QUEUE_CLOCK,
    ("exchanges", "SELECT, INSERT, DELETE", ()),
    ("bindings", "SELECT, INSERT, DELETE", ()),
    ("consumers", ALL_ROWS, ()),
    ("migrations", "SELECT", ()),
    # Every fetch skips the paused queues; only the owner pauses and resumes (migration 0021).
    ("paused_queues", "SELECT", ()),
    # The limited fetch reads a queue's limits and spends its bucket's tokens; only the owner
    # sets the limits (migration 0025).
    ("queue_limits", "SELECT", ()),
    ("queue_limits", "UPDATE", ("tokens", "refilled_at")),
    # rotate(): the ring of jobs' slots moves on, and a slot that holds nothing to keep is
    # emptied with TRUNCATE, no more than the DELETE above allows (migration 0027).
    ("jobs_rotation", "SELECT", ()),
    ("jobs_rotation", "UPDATE", ("slot", "first_id", "since", "blocked_since")),
    *((f"jobs_{k}", "TRUNCATE", ()) for k in range(1, JOB_SLOTS + 1)),
    # sweep(): when a sweep last read every running message (migration 0030).
    ("sweep_scans", "SELECT", ()),
    ("sweep_scans", "UPDATE", ("scanned_at", "complete")),
)
#: The columns a publish writes: a publisher cannot insert a message already running under a
#: consumer, already attempted, or with an id of its choosing.
PUBLISHED_COLUMNS = (
    "queue",
    "priority",
    "status",
    "run_at",
    "payload",
    "task_name",
    "task_id",
    "expires_at",
    "unique_key",
    "concurrency_key",
    # The current slot, read by the publish's own statement (migration 0027).
    "slot",
)
PUBLISHER_PRIVILEGES: tuple[Privilege, ...] = (
    ("jobs", "INSERT", PUBLISHED_COLUMNS),
    # INSERT ... RETURNING id (publish) and queue (routed publish); counts for queue_declare.
    ("jobs", "SELECT", ("id", "queue", "status")),
    # The current slot of jobs, which the publish writes (migration 0027).
    ("jobs_rotation", "SELECT", ()),
    ("queues", "SELECT", ()),
    (
        "queues",
        "INSERT",
        ("name", "durable", "auto_delete", "arguments", "max_priority", "message_ttl", "expires"),
    ),
    QUEUE_CLOCK,
    ("exchanges", "SELECT", ()),
    ("exchanges", "INSERT", ("name", "type", "durable", "auto_delete", "arguments")),
    ("bindings", "SELECT", ()),
    ("bindings", "INSERT", ("exchange", "queue", "routing_key", "arguments", "pattern")),
    # Routing skips queues past their x-expires that no live consumer consumes.
    ("consumers", "SELECT", ()),
    ("migrations", "SELECT", ()),
)
#: The maintenance a live worker runs itself, as the pg_cron jobs do when none runs.
WORKER_FUNCTIONS = (
    "expire_queues()",
    "sweep(integer)",
    "sweep(integer, interval)",
    "rotate()",
    "rotation_keeps(smallint, interval)",
    "rotation_keeps_more(smallint, interval, bigint)",
    "current_slot()",
)
#: The default of jobs.slot, which inserts that do not write the slot use (migration 0027).
PUBLISHER_FUNCTIONS = ("current_slot()",)


@dataclass(frozen=True)
class Grant:
    role: str
    what: str  # "worker" or "publisher"
    statement: sql.Composed

    def text(self) -> str:
        return self.statement.as_string(None)


def grant_statements(
    database: str, schema: str, *, workers: list[str], publishers: list[str]
) -> list[Grant]:
    """The GRANTs for the worker and publisher roles, in the order to run them."""
    if not workers and not publishers:
        raise exceptions.ConfigurationError("name at least one --worker or --publisher role")
    ident = sql.Identifier(schema)
    grants: list[Grant] = []
    for what, roles, table_privs in (
        ("worker", workers, WORKER_PRIVILEGES),
        ("publisher", publishers, PUBLISHER_PRIVILEGES),
    ):
        for role in roles:
            who = sql.Identifier(role)

            def add(statement: sql.Composed, role: str = role, what: str = what) -> None:
                grants.append(Grant(role, what, statement))

            add(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), who))
            add(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, who))
            for table, privileges, columns in table_privs:
                cols: sql.Composable = sql.SQL("")
                if columns:
                    cols = sql.SQL(" ({})").format(sql.SQL(", ").join(map(sql.Identifier, columns)))
                add(
                    sql.SQL("GRANT {}{} ON {} TO {}").format(
                        sql.SQL(privileges), cols, sql.Identifier(schema, table), who
                    )
                )
            for function in WORKER_FUNCTIONS if what == "worker" else PUBLISHER_FUNCTIONS:
                add(
                    sql.SQL("GRANT EXECUTE ON FUNCTION {}.{} TO {}").format(
                        ident, sql.SQL(function), who
                    )
                )
    return grants


def database_of(url: str) -> str:
    params = conninfo_to_dict(to_conninfo(url))
    return str(params.get("dbname") or params.get("user") or "postgres")


def apply_grants(url: str, grants: list[Grant]) -> None:
    """Run ``grants`` in one transaction as the role of ``url`` (the schema's owner)."""
    import psycopg

    with connect(url, autocommit=False) as conn:
        try:
            for grant in grants:
                conn.execute(grant.statement)
            conn.commit()
        except psycopg.Error as exc:
            conn.rollback()
            translated = exceptions.translate(exc, url_for_messages=mask_url(url))
            if translated is exc:
                raise exceptions.ConfigurationError(
                    f"GRANT failed, nothing was granted: {exc} (run `pgskip grant` as the "
                    "schema's owner; the roles must exist: CREATE ROLE name LOGIN PASSWORD ...)"
                ) from exc
            raise translated from exc


__all__ = ["Grant", "apply_grants", "database_of", "grant_statements"]
