"""``pgskip doctor``: checks of an installed schema, one line each, for CI and deploy checks.

Each check says ``ok``, ``WARN`` or ``FAIL`` with what it found and what to do; the command
exits non-zero when one fails. A warning does not change the exit status.

**Failures** are what breaks the broker, stops something it needs, or lets a role do more than
it should; **warnings** are what slows it down or may be deliberate, and what could not be
checked.

Operations:

* the schema's version against what this package ships: behind (FAIL: run ``pgskip migrate``),
  newer and outside the window of versions this code runs against (FAIL: upgrade the package),
  newer inside it (WARN), migrations missing below the newest one recorded (FAIL);
* the storage parameters the migrations give ``jobs`` (fillfactor and its autovacuum
  settings): one reset (FAIL) or changed (WARN); autovacuum off for the table or the server
  (FAIL);
* invalid indexes on the schema's tables, as a failed ``CREATE INDEX CONCURRENTLY`` leaves them
  (FAIL; WARN while a concurrent build runs on that table);
* the xmin horizon (``health.sql``: sessions, prepared transactions, replication slots): held
  longer than the threshold (``xmin_threshold``, default 300 s), or by an inactive replication
  slot (WARN, naming the pid, application or slot);
* the ring of ``jobs``' slots: rotations refused a slot's lock for longer than the same
  threshold (WARN, naming the sessions or prepared transactions that hold one: a transaction
  that read ``jobs`` and stays open, even without a snapshot, stops every slot being emptied);
* pg_cron (:mod:`kombu_pgskip.cron`): the latest run of one of the schema's jobs failed (FAIL,
  with what to change, e.g. for ``connection failed``); pg_cron missing or unreadable, no jobs,
  inactive jobs, no recent run of a job due every minute, runs not logged (WARN).

Security (docs/security.md): what would let a role other than the schema's owner destroy
messages or run code as the owner; each finding is a failure:

* a function or procedure of the schema executable by PUBLIC (a trigger function attached to
  a table of the caller's own runs as its owner);
* a function without the search path ``<schema>, pg_catalog, pg_temp`` (a closer match for a
  built-in, created by another role in a schema on the path, would run in its place);
* a ``SECURITY DEFINER`` function but the trigger function that claims unique keys
  (``claim_unique_key()``: grants do the job for every other one);
* a type of the schema usable by PUBLIC (an operator over it could be defined elsewhere);
* a role other than the owner that may create objects in the schema, or in a schema on a
  function's path, or in a schema on a broker role's own default search path;
* a role with more privileges than ``pgskip grant`` gives a worker or a publisher, PUBLIC with
  any, or an object of the schema owned by another role.

Run it as the schema's owner (or a superuser): the catalogs it reads are readable by every
role, but only the owner sees the schema as the checks assume, and pg_cron shows a role only
its own jobs. Without ``pg_read_all_stats`` the durations of other roles' transactions are not
visible, and the xmin check names those holders without judging them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import cron, exceptions
from .grants import (
    PUBLISHER_FUNCTIONS,
    PUBLISHER_PRIVILEGES,
    WORKER_FUNCTIONS,
    WORKER_PRIVILEGES,
    Privilege,
)
from .health import HorizonHolder, ring_block
from .health import _remedy as _horizon_remedy
from .migrate import applied_migrations, load_migrations, require_version, window_floor
from .sql import queries_in, quote_ident
from .urls import Connection, connect, mask_url

#: Procedures commit between batches, which a SET clause forbids: their bodies qualify every
#: name and operator instead.
QUALIFIED_PROCEDURES = frozenset({"prune_in_batches"})
#: The one function of ours that runs as its owner: the trigger of ``jobs`` that claims a
#: message's unique key in ``unique_keys`` (migration 0026), a table no other role may read or
#: write. No role but the owner may execute it (so none may attach it to a table of its own),
#: and it pins the search path, as every function does.
DEFINER_FUNCTIONS = frozenset({"claim_unique_key()"})

#: A check's outcome: passed, passed with a warning (the exit status stays 0), failed.
OK, WARN, FAIL = "ok", "warn", "fail"
_LABELS = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL"}

#: Seconds a snapshot or transaction may hold the xmin horizon back before the check warns
#: (as the workers' ``xmin_horizon_warning`` transport option does by default).
DEFAULT_XMIN_THRESHOLD = 300.0
#: The migration that records refused locks of the ring's slots (``jobs_rotation.blocked_since``).
RING_BLOCK_VERSION = 28
#: At most this many holders of the xmin horizon are read (the oldest ones).
MAX_HOLDERS = 10

#: The storage parameters migration 0001 gives ``jobs``: room for HOT updates, and a vacuum
#: after 2 % of the rows (+1000) changed, with no cost delay (docs/operations.md, "Autovacuum").
JOBS_RELOPTIONS = {
    "fillfactor": "70",
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
    "autovacuum_analyze_scale_factor": "0.05",
    "autovacuum_vacuum_cost_delay": "0",
}


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` is :data:`OK`, :data:`WARN` or :data:`FAIL`;
    ``detail`` what it found and what to do, on one line; ``advice`` further lines, when the
    remedy takes several (pg_cron's connection settings)."""

    name: str
    status: str
    detail: str
    advice: str | None = None

    @property
    def ok(self) -> bool:
        """Passed: ``ok``, or a warning (which leaves the exit status 0)."""
        return self.status != FAIL

    def line(self) -> str:
        return f"{_LABELS[self.status]}  {self.name}: {self.detail}"

    def text(self) -> str:
        """The line, and the advice below it, indented."""
        if not self.advice:
            return self.line()
        return self.line() + "".join(f"\n      {a}" for a in self.advice.splitlines())

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "advice": self.advice}  # fmt: skip


def split_search_path(value: str) -> list[str]:
    """A ``search_path`` setting's schema names, unquoted (``"a b", public`` -> a b, public)."""
    names: list[str] = []
    current: list[str] = []
    quoted = False
    i = 0
    while i < len(value):
        ch = value[i]
        if quoted:
            if ch == '"' and value[i + 1 : i + 2] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ",":
            names.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    last = "".join(current).strip()
    if last or names:
        names.append(last)
    return [n for n in names if n]


def expected_privileges(privileges: Iterable[Privilege]) -> set[tuple[str, str, str | None]]:
    """(table, privilege, column or None) for every privilege of a ``grants`` list."""
    return {
        (table, privilege.strip(), column)
        for table, listed, columns in privileges
        for privilege in listed.split(",")
        for column in (columns or (None,))
    }


class Doctor:
    """The checks of one schema through one connection (its owner's).

    ``url`` is that connection's, for the checks that open their own (pg_cron lives in another
    database); ``cron=False`` leaves the pg_cron check out (periodic tasks and maintenance run
    by ``pgskip tick`` from elsewhere); ``cron_database`` is where pg_cron lives when the role
    cannot find it (:func:`kombu_pgskip.cron.locate`).
    """

    def __init__(
        self,
        conn: Connection,
        schema: str,
        *,
        url: str | None = None,
        xmin_threshold: float = DEFAULT_XMIN_THRESHOLD,
        cron: bool = True,
        cron_database: str | None = None,
    ) -> None:
        self.conn = conn
        self.schema = schema
        self.url = url
        self.xmin_threshold = xmin_threshold
        self.cron = cron and url is not None
        self.cron_database = cron_database
        self.q = queries_in("doctor.sql", schema)

    def rows(self, query: str, **params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(self.q[query], {"schema": self.schema, **params}).fetchall()

    def run(self) -> list[Check]:
        """The schema's owner, the operational checks, then the security checks."""
        owner = self.rows("schema_owner")
        if not owner:
            return [
                Check(
                    "schema",
                    FAIL,
                    f"schema {self.schema!r} not installed: run `celery -A proj pgskip migrate`",
                )
            ]
        checks = [Check("schema", OK, f"{self.schema!r}, owned by {owner[0][0]}")]
        checks.extend(self.operations())
        checks.extend(self.security())
        return checks

    def operations(self) -> list[Check]:
        checks = [
            self.schema_version(),
            self.jobs_storage(),
            self.invalid_indexes(),
            self.xmin_horizon(),
            self.ring(),
        ]
        if self.cron:
            checks.append(self.pg_cron())
        return checks

    def security(self) -> list[Check]:
        routines = self.rows("routines")
        checks = [
            self.public_routines(routines),
            self.search_paths(routines),
            self.security_definer(routines),
            self.public_types(),
            self.creators_in_schema(),
            self.creators_on_function_paths(routines),
            self.foreign_owners(),
            self.public_privileges(),
        ]
        for role, worker in self.rows("broker_roles"):
            checks.append(self.role_privileges(str(role), bool(worker)))
            checks.append(self.role_search_path(str(role)))
        return checks

    # -- the schema's version ---------------------------------------------------------------------

    def schema_version(self) -> Check:
        name = "schema version"
        package = load_migrations()
        shipped = package[-1].version if package else 0
        applied = applied_migrations(self.conn, self.schema)
        current = applied[-1].version if applied else 0
        try:
            require_version(self.schema, current, applied=applied)
        except exceptions.SchemaError as exc:
            return Check(name, FAIL, str(exc))
        recorded = {a.version for a in applied}
        gaps = [m.label for m in package if m.version < current and m.version not in recorded]
        if gaps:
            return Check(
                name,
                FAIL,
                f"{self._names(gaps)} not recorded in {self._ident()}.migrations, although "
                f"{applied[-1].label} is: `celery -A proj pgskip migrate` would run them again. "
                "Their rows were deleted by hand, or a runner failed between files: compare the "
                "schema with migrations/schema.sql of this release before restoring the rows",
            )
        known = {m.version: m.compatible_with for m in package}
        claims = {
            a.version: a.compatible_with if a.compatible_with is not None else known.get(a.version)
            for a in applied
        }
        window = f"code built for schema {window_floor(current, claims):04d} to {current:04d}"
        if current > shipped:
            return Check(
                name,
                WARN,
                f"{current:04d}, newer than this kombu-pgskip's {shipped:04d}, which runs "
                f"against it ({window} does): upgrade the kombu-pgskip package where this runs "
                f"(its checks know only what {shipped:04d} installs)",
            )
        return Check(name, OK, f"{current:04d}, as this kombu-pgskip ships ({window} runs on it)")

    # -- jobs: storage parameters and indexes -----------------------------------------------------

    def jobs_storage(self) -> Check:
        name = "autovacuum settings of jobs"
        row = self.rows("jobs_storage")
        if not row:
            table = f"{self._ident()}.jobs"
            return Check(name, FAIL, f"no table {table}: run `celery -A proj pgskip migrate`")
        options, server_autovacuum, relname = row[0]
        # Since migration 0027, jobs_kept: the partition vacuum looks after.
        table = f"{self._ident()}.{relname}"
        have = dict(str(o).split("=", 1) for o in options or ())
        if not server_autovacuum:
            return Check(
                name,
                FAIL,
                "autovacuum is off on this server (autovacuum or track_counts): nothing "
                f"removes the dead rows every message leaves in {table}, which grows and slows "
                "every fetch; set autovacuum = on and track_counts = on in postgresql.conf and "
                "SELECT pg_reload_conf()",
            )
        if "autovacuum_enabled" in have and not _on(have["autovacuum_enabled"]):
            return Check(
                name,
                FAIL,
                f"autovacuum is off for {table} (autovacuum_enabled={have['autovacuum_enabled']})"
                ": nothing removes the dead rows every message leaves, so the table grows and "
                f"every fetch slows down; run `ALTER TABLE {table} RESET (autovacuum_enabled);` "
                "as the owner",
            )
        missing = [k for k in JOBS_RELOPTIONS if k not in have]
        changed = [
            k for k in JOBS_RELOPTIONS if k in have and not _same(have[k], JOBS_RELOPTIONS[k])
        ]
        restore = ", ".join(f"{k} = {JOBS_RELOPTIONS[k]}" for k in missing + changed)
        fix = (
            f"`ALTER TABLE {table} SET ({restore});` as the owner restores them (its lock lets "
            "reads and writes go on)"
        )
        if missing:
            return Check(
                name,
                FAIL,
                f"{self._names(missing)} no longer set, so the server's defaults apply: the "
                "migrations set them because every message leaves dead rows behind, which a "
                "vacuum after 20 % of the table changed (the default) lets pile up and slow "
                f'fetches down (docs/operations.md, "Autovacuum"); {fix}',
            )
        if changed:
            values = [f"{k}={have[k]} (the migrations set {JOBS_RELOPTIONS[k]})" for k in changed]
            return Check(
                name,
                WARN,
                f"{self._names(values)}: if that was not deliberate, {fix}",
            )
        return Check(
            name, OK, ", ".join(f"{k}={v}" for k, v in JOBS_RELOPTIONS.items()) + ", as migrated"
        )

    def invalid_indexes(self) -> Check:
        name = "indexes valid"
        rows = self.rows("invalid_indexes")
        if not rows:
            return Check(name, OK, f"every index on the tables of {self._ident()}")
        building = [(str(r[0]), r[3]) for r in rows if r[3] is not None]
        broken = [(str(r[0]), str(r[1])) for r in rows if r[3] is None]
        if not broken:
            shown = [f"{index} (a concurrent build on its table runs: pid {pid})"
                     for index, pid in building]  # fmt: skip
            return Check(
                name,
                WARN,
                f"{self._names(shown)}: not used by queries until the build ends; run the "
                "doctor again when it has",
            )
        leftovers = [i for i, _t in broken if re.search(r"_cc(new|old)[0-9]*$", i)]
        fixes = [f"`REINDEX INDEX CONCURRENTLY {i};`" for i, _t in broken if i not in leftovers]
        fixes += [f"`DROP INDEX CONCURRENTLY {i};`" for i in leftovers]
        copies = "; a name ending in _ccnew or _ccold is a copy an interrupted REINDEX left"
        return Check(
            name,
            FAIL,
            f"{self._names([f'{i} on {t}' for i, t in broken])} INVALID (a CREATE INDEX "
            "CONCURRENTLY or REINDEX CONCURRENTLY that failed or was cancelled): queries cannot "
            f"use it, and writes may still pay for updating it. Run {self._names(fixes)} as "
            f"the owner (reads and writes go on meanwhile{copies if leftovers else ''}); if a "
            "unique index fails again, remove the duplicate rows first",
        )

    # -- the xmin horizon -------------------------------------------------------------------------

    def xmin_horizon(self) -> Check:
        name = "xmin horizon"
        rows = self.conn.execute(
            queries_in("health.sql", self.schema)["xmin_holders"], {"limit": MAX_HOLDERS}
        ).fetchall()
        holders = [_holder(r) for r in rows]
        threshold = self.xmin_threshold
        held = [
            h
            for h in holders
            if (h.held_seconds is not None and h.held_seconds >= threshold)
            or (h.kind == "replication slot" and h.state == "inactive")
        ]
        if held:
            first = held[0]
            more = f"; and {len(held) - 1} more" if len(held) > 1 else ""
            return Check(
                name,
                WARN,
                f"held back by {_described(first)}{more}: dead rows of "
                f"{self._ident()}.jobs cannot be vacuumed while it lasts, so the table and its "
                f"indexes grow and fetches slow down. To fix: {_horizon_remedy(first)}",
            )
        if not holders:
            return Check(
                name,
                OK,
                "no session, prepared transaction or replication slot holds it back",
            )
        oldest = holders[0]
        unseen = sum(1 for h in holders if h.held_seconds is None)
        note = (
            f"; {unseen} of the {len(holders)} holders with a duration this role cannot see "
            "(pg_read_all_stats shows it)"
            if unseen
            else ""
        )
        return Check(
            name,
            OK,
            f"nothing held longer than {threshold:.0f}s; the oldest: {_brief(oldest)}{note}",
        )

    # -- the ring of jobs' slots ------------------------------------------------------------------

    def ring(self) -> Check:
        name = "jobs ring"
        if not any(
            a.version >= RING_BLOCK_VERSION for a in applied_migrations(self.conn, self.schema)
        ):
            return Check(name, WARN, "not checked: the schema predates migration 0028")
        block = ring_block(
            self.conn.execute(
                queries_in("health.sql", self.schema)["ring_blocked"], {"limit": MAX_HOLDERS}
            ).fetchall()
        )
        if block is None:
            return Check(name, OK, "rotations get the locks of the slots they empty")
        if block.seconds < self.xmin_threshold:
            return Check(
                name,
                OK,
                f"a slot's lock refused for {block.seconds:.0f}s (under "
                f"{self.xmin_threshold:.0f}s): the ring waits for it",
            )
        return Check(name, WARN, block.describe(self._ident()))

    # -- pg_cron ----------------------------------------------------------------------------------

    def pg_cron(self) -> Check:
        name = "pg_cron runs the schema's jobs"
        assert self.url is not None
        skip = "; --no-cron leaves this check out"
        try:
            server = cron.locate(self.url, self.cron_database, schedule=False)
        except cron.PgCronMissing as exc:
            reason = exc.context.get("reason", str(exc))
            return Check(
                name,
                WARN,
                f"{reason}: periodic tasks are not sent and old messages not pruned unless "
                "`celery -A proj pgskip tick` runs every minute from elsewhere; `celery -A "
                f"proj pgskip beat-sync` says how to install pg_cron{skip}",
            )
        except exceptions.PgSkipError as exc:
            first, _, rest = str(exc).partition("\n")
            return Check(name, WARN, f"not checked: {first}{skip}", advice=rest or None)
        prefix = cron.job_prefix(server.app_database, self.schema)
        try:
            with cron.cron_session(self.url, server) as conn:
                jobs = cron.list_jobs(conn, prefix)
                runs = cron.recent_runs(conn, prefix) if jobs else []
                settings = cron.read_settings(conn)
        except cron.PgCronPermissionDenied:
            role = _role(server.user)
            return Check(
                name,
                WARN,
                f"not checked: role {server.user} may not read pg_cron's jobs (no USAGE on "
                f"schema cron): run `GRANT USAGE ON SCHEMA cron TO {role};` in database "
                f"{server.cron_database!r} as a superuser{skip}",
            )
        except exceptions.PgSkipError as exc:
            first, _, rest = str(exc).partition("\n")
            return Check(name, WARN, f"not checked: {first}{skip}", advice=rest or None)
        where = f"pg_cron {server.version} in database {server.cron_database!r}"
        if not jobs:
            return Check(
                name,
                WARN,
                f"{where} has no job named {prefix}*: periodic tasks are not sent and old "
                "messages not pruned unless `celery -A proj pgskip tick` runs every minute from "
                f"elsewhere; `celery -A proj pgskip beat-sync` installs them{skip}",
            )
        failed = [r for r in runs if r.failed]
        if failed:
            run = failed[0]
            others = f" (and of {len(failed) - 1} more of its jobs)" if len(failed) > 1 else ""
            return Check(
                name,
                FAIL,
                f"{where}: the latest run of {run.job} failed{others}: "
                f"{run.message or 'no message'}",
                advice=cron.failure_remedy(run, settings),
            )
        inactive = [j for j in jobs if not j.active]
        if inactive:
            fixes = [f"SELECT cron.alter_job({j.jobid}, active := true);" for j in inactive]
            return Check(
                name,
                WARN,
                f"{self._names([j.name for j in inactive])} inactive in {where}: pg_cron does "
                f"not run them; if that was not deliberate, run `{' '.join(fixes)}` there",
            )
        if settings.log_run is False:
            return Check(
                name,
                WARN,
                f"{where}: cron.log_run is off, so pg_cron keeps no record of its runs and "
                "whether it can run these jobs was not checked",
            )
        latest = {r.job: r for r in runs}
        frequent = [j for j in jobs if _every_minute(j.schedule)]
        recent = cron.RECENT.total_seconds()
        ages = {job: run.age for job, run in latest.items()}
        stale = [j.name for j in frequent if not _within(ages.get(j.name), recent)]
        if stale:
            return Check(
                name,
                WARN,
                f"{where} has not run {self._names(stale)} in the last "
                f"{cron.RECENT.total_seconds() / 60:.0f} minutes, though they are due every "
                "minute: is its launcher running (SELECT pid FROM pg_stat_activity WHERE "
                "backend_type = 'pg_cron launcher')? Are all cron.max_running_jobs busy? The "
                "server log says more",
            )
        waiting = [j.name for j in jobs if j.name not in latest]
        not_yet = f"; not run yet: {self._names(waiting)}" if waiting else ""
        ran = len(jobs) - len(waiting)
        return Check(
            name,
            OK,
            f"{where}: the latest run of each of its {len(jobs)} jobs succeeded"
            if not waiting
            else f"{where}: the latest run of {ran} of its {len(jobs)} jobs succeeded{not_yet}",
        )

    # -- routines ---------------------------------------------------------------------------------

    @staticmethod
    def _names(items: Sequence[str]) -> str:
        return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    def public_routines(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "routines not executable by PUBLIC"
        bad = [str(r[0]) for r in routines if r[4]]
        if not bad:
            return Check(name, OK, f"{len(routines)} routines")
        fix = f"REVOKE ALL ON ALL ROUTINES IN SCHEMA {self._ident()} FROM PUBLIC"
        return Check(name, FAIL, f"{self._names(bad)}: run `{fix};` as the owner")

    def search_paths(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "functions pin a safe search_path"
        safe = [self.schema, "pg_catalog", "pg_temp"]
        bad = []
        for signature, kind, _definer, path, _public in routines:
            if kind == "p" and str(signature).split("(")[0] in QUALIFIED_PROCEDURES:
                continue
            if path is None or split_search_path(str(path)) != safe:
                bad.append(f"{signature} ({'no search_path' if path is None else path})")
        if not bad:
            return Check(name, OK, f"{self._ident()}, pg_catalog, pg_temp")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)}: run `celery -A proj pgskip migrate` (migration 0012 sets "
            f"SET search_path = {self._ident()}, pg_catalog, pg_temp on each)",
        )

    def security_definer(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "no SECURITY DEFINER function but claim_unique_key()"
        bad = [str(r[0]) for r in routines if r[2] and str(r[0]) not in DEFINER_FUNCTIONS]
        if not bad:
            definers = [str(r[0]) for r in routines if r[2]]
            if definers:
                return Check(name, OK, f"only {self._names(definers)} runs as its owner")
            return Check(name, OK, "none runs as its owner")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)} run as their owner: ALTER FUNCTION ... SECURITY INVOKER, "
            "and grant the roles that call them what they need",
        )

    def public_types(self) -> Check:
        name = "types not usable by PUBLIC"
        bad = [str(r[0]) for r in self.rows("public_types")]
        if not bad:
            return Check(name, OK, "none")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)}: another role can define operators over them; run "
            f"`REVOKE USAGE ON TYPE {bad[0]} FROM PUBLIC;` (each) as the owner",
        )

    # -- who can create what where ---------------------------------------------------------------

    def _creators(self, schema: str) -> list[str]:
        return [str(r[0]) for r in self.rows("creators", name=schema)]

    def creators_in_schema(self) -> Check:
        name = "no other role creates in the schema"
        bad = self._creators(self.schema)
        if not bad:
            return Check(name, OK, "only the owner")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)} may create objects in {self._ident()}: run "
            f"`REVOKE CREATE ON SCHEMA {self._ident()} FROM {bad[0]};` as the owner",
        )

    def creators_on_function_paths(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "no other role creates in a schema on a function's search_path"
        schemas = sorted(
            {
                s
                for r in routines
                if r[3] is not None
                for s in split_search_path(str(r[3]))
                if s not in (self.schema, "pg_catalog", "pg_temp")
            }
        )
        bad = [f"{role} in {s}" for s in schemas for role in self._creators(s)]
        if not bad:
            return Check(name, OK, "none")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)}: a function they create there can run as the owner; run "
            "`celery -A proj pgskip migrate` (every function's path becomes the schema and "
            "pg_catalog only)",
        )

    def role_search_path(self, role: str) -> Check:
        name = f"role {role}: default search_path"
        row = self.rows("role_search_path", role=role)
        setting = next((v for v in (row[0] if row else ()) if v is not None), None)
        path = split_search_path(setting if setting is not None else '"$user", public')
        schemas = [role if s == "$user" else s for s in path]
        bad = [
            f"{creator} in {s}"
            for s in schemas
            if s not in ("pg_catalog", "pg_temp")
            for creator in self._creators(s)
            if creator != role
        ]
        shown = setting if setting is not None else '"$user", public (the default)'
        if not bad:
            return Check(name, OK, shown)
        return Check(
            name,
            FAIL,
            f"{shown}, where {self._names(bad)} may create objects: a function or operator "
            f"they create there can run with {role}'s privileges in its sessions that do not "
            "set their own path (kombu-pgskip's own do, unless listen=False for PgBouncer); "
            f"run `ALTER ROLE {role} SET search_path = pg_catalog, pg_temp;` as a superuser, "
            "or revoke CREATE on those schemas",
        )

    # -- privileges ---------------------------------------------------------------------------

    def foreign_owners(self) -> Check:
        name = "every object owned by the schema's owner"
        bad = [f"{obj} ({owner})" for obj, owner in self.rows("foreign_owners")]
        if not bad:
            return Check(name, OK, "yes")
        return Check(
            name,
            FAIL,
            f"{self._names(bad)} belong to another role, which may change or drop them: "
            "ALTER ... OWNER TO the schema's owner",
        )

    def _held(self, role: str) -> set[tuple[str, str, str | None]]:
        return {(str(r[0]), str(r[1]), r[2]) for r in self.rows("privileges", role=role)}

    def public_privileges(self) -> Check:
        name = "PUBLIC has no privilege on the schema"
        # (EXECUTE: the routines check above)
        held = {p for p in self._held("public") if p[1] != "EXECUTE"}
        bad = sorted(self._describe(held))
        if not bad:
            return Check(name, OK, "none")
        return Check(
            name,
            FAIL,
            f"PUBLIC (every role) holds {self._names(bad)}: REVOKE them as the owner",
        )

    def role_privileges(self, role: str, worker: bool) -> Check:
        what = "worker" if worker else "publisher"
        name = f"role {role}: privileges of a {what}"
        expected = expected_privileges(WORKER_PRIVILEGES if worker else PUBLISHER_PRIVILEGES)
        functions = WORKER_FUNCTIONS if worker else PUBLISHER_FUNCTIONS
        expected |= {(f, "EXECUTE", None) for f in functions}
        held = self._held(role)
        extra = held - expected
        # A column privilege is covered by the same privilege on the whole table.
        extra = {e for e in extra if not (e[2] is not None and (e[0], e[1], None) in expected)}
        if not extra:
            return Check(name, OK, f"as `pgskip grant --{what}` gives")
        return Check(
            name,
            FAIL,
            f"more than `pgskip grant --{what}` gives: {self._names(sorted(self._describe(extra)))}"
            f"; REVOKE them as the owner (a role's privileges through membership and PUBLIC "
            "count too)",
        )

    @staticmethod
    def _describe(privileges: Iterable[tuple[str, str, str | None]]) -> list[str]:
        return [
            f"{priv} on {table}" + (f"({column})" if column else "")
            for table, priv, column in privileges
        ]

    def _ident(self) -> str:
        return quote_ident(self.schema)


def _on(value: str) -> bool:
    """A boolean storage parameter as PostgreSQL reads it (``on``, ``true``, ``yes``, ``1``)."""
    return value.strip().lower() in ("on", "true", "yes", "1", "t", "y")


def _same(have: str, want: str) -> bool:
    try:
        return float(have) == float(want)
    except ValueError:
        return have == want


def _role(name: str) -> str:
    """A role's name as SQL writes it: bare when it may be, else quoted."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else quote_ident(name)


def _within(age: float | None, limit: float) -> bool:
    """Whether a run ended at most ``limit`` seconds ago (``age`` None: never, or not ended)."""
    return age is not None and age <= limit


def _every_minute(schedule: str) -> bool:
    """pg_cron schedules that run at least once a minute: ``* * * * *`` and ``N seconds``."""
    return schedule.split() == ["*"] * 5 or schedule.strip().endswith("seconds")


def _holder(row: Sequence[Any]) -> HorizonHolder:
    """A row of ``health.sql``'s ``xmin_holders``."""
    return HorizonHolder(
        kind=str(row[0]),
        who=str(row[1]),
        user=row[2],
        application_name=row[3],
        state=row[4],
        xmin=str(row[5]),
        xmin_age=int(row[6]),
        held_seconds=row[7],
        xact_seconds=row[8],
        query=row[9],
    )


def _brief(holder: HorizonHolder) -> str:
    """The holder in a few words: what, whose, how old."""
    age = f"xmin {holder.xmin_age} transactions old"
    if holder.kind == "replication slot":
        return f"replication slot {holder.who!r} ({holder.state}), {age}"
    if holder.kind == "session":
        what = f"backend pid {holder.who} (application_name={holder.application_name or ''!r})"
    else:
        what = f"{holder.kind} {holder.who!r}"
    held = (
        f"held for {holder.held_seconds:.0f}s"
        if holder.held_seconds is not None
        else "held for a time not visible to this role"
    )
    return f"{what}, {held}, {age}"


def _described(holder: HorizonHolder) -> str:
    """The holder as the workers' warning names it, where its duration is known."""
    if holder.held_seconds is None:
        return _brief(holder)
    return holder.describe(holder.held_seconds)


def run_doctor(
    url: str,
    schema: str,
    *,
    xmin_threshold: float = DEFAULT_XMIN_THRESHOLD,
    cron: bool = True,
    cron_database: str | None = None,
) -> list[Check]:
    """Every check of ``schema`` at ``url`` (see :class:`Doctor` for the options)."""
    with exceptions.translating(url_for_messages=mask_url(url)), connect(url) as conn:
        return Doctor(
            conn,
            schema,
            url=url,
            xmin_threshold=xmin_threshold,
            cron=cron,
            cron_database=cron_database,
        ).run()


__all__ = [
    "DEFAULT_XMIN_THRESHOLD",
    "FAIL",
    "JOBS_RELOPTIONS",
    "OK",
    "WARN",
    "Check",
    "Doctor",
    "run_doctor",
    "split_search_path",
]
