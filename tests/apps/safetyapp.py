"""The Celery app the safety tests (held snapshot, bad input, security) run in real workers.

Configuration comes from the environment: ``$PGSKIP_BROKER_URL`` (the broker, possibly as a
least-privileged role), ``PGSKIP_OPT_<NAME>`` (transport options) and ``$SAFETY_RUNS_DSN``: where
``safetyapp.record`` writes what it received into ``safety_runs`` (a superuser's connection to
the test database, so the instrumentation needs no grant of the role under test; the table is
created by ``tests.safety_support.create_runs_table``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import psycopg
from celery import Celery

import kombu_pgskip  # noqa: F401  (registers the pgskip:// scheme)

BROKER_URL = os.environ.get("PGSKIP_BROKER_URL", "pgskip://postgres@127.0.0.1:5432/postgres")

app = Celery("safetyapp", broker=BROKER_URL)
app.conf.update(
    task_default_queue="default",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        k[len("PGSKIP_OPT_") :].lower(): v
        for k, v in os.environ.items()
        if k.startswith("PGSKIP_OPT_")
    },
)


@app.task(name="safetyapp.noop")
def noop(*args: Any, **kwargs: Any) -> None:
    return None


def _record(self: Any, *args: Any, **kwargs: Any) -> None:
    with psycopg.connect(os.environ["SAFETY_RUNS_DSN"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO safety_runs (task, args, kwargs) VALUES (%s, %s, %s)",
            (self.name, json.dumps(args), json.dumps(kwargs)),
        )


record = app.task(bind=True, name="safetyapp.record")(_record)


def register_named(name: str) -> None:
    """Also register ``record`` under ``name`` (task names with quotes, unicode ...)."""
    app.task(bind=True, name=name)(_record)


for _name in json.loads(os.environ.get("SAFETY_EXTRA_TASK_NAMES", "[]")):
    register_named(_name)
