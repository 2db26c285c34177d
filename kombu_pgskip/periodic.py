"""Periodic tasks without celery beat: ``beat_schedule`` stored in PostgreSQL, fired by pg_cron.

``celery -A proj pgskip beat-sync`` (:func:`beat_sync`):

1. turns every entry into a schedule spec (:mod:`kombu_pgskip.schedule_spec`) and into the exact
   messages celery beat would send for it: Celery builds them itself (``task.apply_async`` or
   ``app.send_task`` with the entry's args, kwargs and options plus the ``celery_beat_task``
   header, as ``celery.beat.Scheduler.apply_async`` does) on an in-memory kombu channel, and
   the payloads are kept as templates. Entries that cannot be honoured (``solar``, lazy
   ``BeatLazyFunc`` arguments, custom schedule classes) are refused all together, naming each
   entry and the reason, before anything is written: nothing is half-synced;
2. checks that pg_cron can be used (:func:`kombu_pgskip.cron.locate`; a dry run goes on
   without it and says why it could not be used);
3. in one transaction, inserts new entries, updates changed ones, deletes the ones that left
   the config, fires the schedule up to half a tick after the next tick, and reports each
   change; running it again changes nothing;
4. installs or updates one pg_cron job per database and schema that runs
   ``SELECT <schema>.fire_due()`` every minute (in another database than pg_cron's through
   ``cron.schedule_in_database``). ``pgskip beat-sync`` then checks, from
   ``cron.job_run_details``, that pg_cron can run it (:func:`kombu_pgskip.cron.check_runs`).

``fire_due()`` inserts each due slot's messages with a fresh task id; each (entry, slot) gets
exactly one message however often and from wherever it runs (a row lock per entry and a
primary key on ``beat_slots``). Slots up to 90 seconds ahead (:data:`DEFAULT_LOOKAHEAD`, one
and a half ticks) are inserted ``scheduled`` with their exact ``run_at`` (sub-minute intervals
are staggered that way); workers promote them. ``beat-sync`` inserts the slots up to half a
tick after the next tick itself (:func:`sync_lookahead`): the first run of an interval entry
comes one interval after the sync, as with celery beat, wherever in the minute the sync falls.

The runs of an entry never come in a burst. A slot found late (a late or missed tick, an
outage) runs once, at once, standing for the other late ones, if the newest late slot is at
most ``grace`` (default 120 s) late or by the ``latest`` policy. An interval entry then counts
its next run one interval from that one, as celery beat does; a crontab or relative entry
keeps to the wall clock, and when its next slot is nearer than the late one is late (and
within the grace), that next run stands for the late one instead. Slots missed beyond the grace
follow the entry's policy:

``latest`` (default)
    one run, by the rule above, as celery beat sends one after a restart; none for a crontab
    entry whose newest missed slot is older than ``beat_cron_starting_deadline`` when that is
    set.
``all``
    every missed slot, oldest first, paced: each run at least 60 s / ``max_catchup`` (default
    100) after the previous one, and no more than an interval entry's interval.
``skip``
    none.

Configure with ``app.conf.pgskip_beat_missed``, ``pgskip_beat_grace`` (seconds or timedelta),
``pgskip_beat_max_catchup``, or per entry with the options ``pgskip_missed``, ``pgskip_grace``,
``pgskip_max_catchup`` (removed from the options before the message is built).

Known differences from celery beat: Celery's ``before_task_publish``/``after_task_publish``
signals run once, at sync, not at every firing; routing (exchange to queues) is resolved at
sync; interval entries count from the sync, not from a beat process's start.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import kombu
from kombu.transport import memory, virtual
from kombu.utils.json import dumps
from psycopg.types.json import Jsonb

from . import cron, exceptions
from .envelope import message_keys, priority_of, refuse_nul, ttl_ms_of
from .schedule_spec import (
    CrontabSpec,
    IntervalSpec,
    Refused,
    Spec,
    spec_for,
    zone,
)
from .sql import queries_in
from .urls import Connection, connect, mask_url

logger = logging.getLogger(__name__)

MISSED_POLICIES = ("latest", "all", "skip")
DEFAULT_GRACE = timedelta(minutes=2)
DEFAULT_MAX_CATCHUP = 100
#: How often ``fire_due()`` runs: pg_cron's minute (or ``pgskip tick`` from cron).
DEFAULT_TICK = timedelta(minutes=1)
#: Each run inserts the slots up to one and a half ticks ahead, so that a tick up to half a
#: tick late finds no slot late. The SQL function's default is the same.
LOOKAHEAD_TICKS = 1.5
DEFAULT_LOOKAHEAD = DEFAULT_TICK * LOOKAHEAD_TICKS
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_OUR_OPTIONS = ("pgskip_missed", "pgskip_grace", "pgskip_max_catchup")


class ScheduleRefused(exceptions.ConfigurationError):
    """Some beat_schedule entries cannot be honoured; nothing was synced."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {name}: {reason}" for name, reason in problems)
        super().__init__(
            f"beat_schedule not synced (nothing was changed); fix or remove these entries:\n{lines}"
        )


@dataclass(frozen=True)
class MissedPolicy:
    missed: str = "latest"
    grace: timedelta = DEFAULT_GRACE
    max_catchup: int = DEFAULT_MAX_CATCHUP
    deadline: timedelta | None = None

    def describe(self) -> str:
        text = f"missed={self.missed}, grace={_seconds(self.grace)}s"
        if self.missed == "all":
            text += f", max_catchup={self.max_catchup}"
        if self.deadline is not None:
            text += f", deadline={_seconds(self.deadline)}s"
        return text


@dataclass(frozen=True)
class EntryPlan:
    """One ``beat_schedule`` entry, ready to store."""

    name: str
    task: str
    spec: Spec
    timezone: str
    policy: MissedPolicy
    messages: list[dict[str, Any]]
    id_paths: list[list[str]]
    fixed_task_id: str | None
    eta_offset: timedelta | None
    expires_offset: timedelta | None
    digest: str = field(default="")

    @property
    def queues(self) -> list[str]:
        return sorted({str(m["queue"]) for m in self.messages})

    def describe(self) -> str:
        return f"{self.task} {self.spec.describe()} [{self.timezone}] -> {', '.join(self.queues)}"

    def params(self) -> dict[str, Any]:
        spec = self.spec
        params: dict[str, Any] = {
            "name": self.name,
            "task": self.task,
            "kind": spec.kind,
            "timezone": self.timezone,
            "minutes": None,
            "hours": None,
            "days_of_week": None,
            "days_of_month": None,
            "months": None,
            "first_slot": None,
            "every_us": None,
            "every_days": None,
            # The timezone is part of what a slot means: changing it restarts the sequence.
            "schedule_key": f"{spec.key} [{self.timezone}]",
            "description": spec.describe(),
            "missed": self.policy.missed,
            "grace": self.policy.grace,
            "deadline": self.policy.deadline,
            "max_catchup": self.policy.max_catchup,
            "messages": Jsonb(self.messages, dumps=dumps),
            "id_paths": Jsonb(self.id_paths),
            "fixed_task_id": self.fixed_task_id,
            "eta_offset": self.eta_offset,
            "expires_offset": self.expires_offset,
            "digest": self.digest,
        }
        if isinstance(spec, CrontabSpec):
            params.update(
                minutes=list(spec.minutes),
                hours=list(spec.hours),
                days_of_week=list(spec.days_of_week),
                days_of_month=list(spec.days_of_month),
                months=list(spec.months),
            )
        elif isinstance(spec, IntervalSpec):
            params.update(first_slot=spec.first, every_us=_micros(spec.every))
        else:
            params.update(first_slot=spec.first, every_days=spec.every_days)
        return params


@dataclass(frozen=True)
class Change:
    """``+`` added, ``~`` changed, ``-`` removed, ``=`` unchanged."""

    sign: str
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.sign} {self.name}: {self.detail}"


@dataclass
class SyncResult:
    changes: list[Change]
    cron_changes: list[str]
    dry_run: bool
    #: Where pg_cron is (None with ``use_cron=False``, and in a dry run without pg_cron).
    server: cron.CronServer | None = None
    #: The newest run id of the schema's pg_cron jobs before this sync (for
    #: :func:`kombu_pgskip.cron.check_runs`); None in a dry run and without pg_cron.
    run_mark: int | None = None
    #: In a dry run: why pg_cron cannot be used (a real sync would stop with this).
    cron_problem: str | None = None

    @property
    def changed(self) -> bool:
        return any(c.sign != "=" for c in self.changes) or bool(self.cron_changes)


# -- building the messages celery beat would send -----------------------------------------------


class _CaptureChannel(memory.Channel):  # type: ignore[misc]
    """A kombu channel that keeps what is published instead of delivering it."""

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.connection.captured.append((queue, message))


class _CaptureTransport(memory.Transport):  # type: ignore[misc]
    Channel = _CaptureChannel
    global_state = virtual.BrokerState()

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.captured: list[tuple[str, dict[str, Any]]] = []


def _find_paths(node: Any, value: str, path: list[str]) -> list[list[str]]:
    if isinstance(node, dict):
        found: list[list[str]] = []
        for k, v in node.items():
            found += _find_paths(v, value, [*path, str(k)])
        return found
    return [path] if node == value else []


def _decoded_body(message: dict[str, Any]) -> bytes:
    body = message.get("body", b"")
    if message.get("properties", {}).get("body_encoding") == "base64":
        return base64.b64decode(body)
    return body.encode() if isinstance(body, str) else bytes(body)


def _capture(
    app: Any, task: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """Have Celery build and publish the entry's message as beat would; return what it sent."""
    opts = dict(options)
    headers = dict(opts.get("headers") or {})
    headers["celery_beat_task"] = True  # celery.beat.Scheduler.apply_async does the same
    opts["headers"] = headers
    conn = kombu.Connection(
        transport=_CaptureTransport,
        transport_options=dict(app.conf.broker_transport_options or {}),
    )
    with conn:
        producer = app.amqp.Producer(conn, auto_declare=False)
        registered = app.tasks.get(task)
        if registered is not None:
            result = registered.apply_async(args, kwargs, producer=producer, **opts)
        else:
            result = app.send_task(task, args, kwargs, producer=producer, **opts)
        captured = list(conn.transport.captured)
    return captured, str(result.id)


def _policy_for(
    app: Any, name: str, options: dict[str, Any], spec: Spec, base: MissedPolicy
) -> MissedPolicy:
    missed = options.get("pgskip_missed", base.missed)
    if missed not in MISSED_POLICIES:
        raise Refused(f"pgskip_missed={missed!r}: expected one of {', '.join(MISSED_POLICIES)}")
    grace = _as_timedelta(options.get("pgskip_grace", base.grace), "pgskip_grace")
    try:
        max_catchup = int(options.get("pgskip_max_catchup", base.max_catchup))
    except (TypeError, ValueError):
        raise Refused("pgskip_max_catchup must be an integer") from None
    if max_catchup < 1:
        raise Refused("pgskip_max_catchup must be >= 1")
    deadline = base.deadline
    if isinstance(spec, CrontabSpec) and deadline is None:
        starting = app.conf.get("beat_cron_starting_deadline")
        if starting is not None:
            deadline = timedelta(seconds=float(starting))
    return MissedPolicy(missed=missed, grace=grace, max_catchup=max_catchup, deadline=deadline)


def _as_timedelta(value: Any, what: str) -> timedelta:
    if isinstance(value, timedelta):
        result = value
    else:
        try:
            result = timedelta(seconds=float(value))
        except (TypeError, ValueError):
            raise Refused(f"{what}={value!r}: expected seconds or a timedelta") from None
    if result < timedelta(0):
        raise Refused(f"{what} must not be negative")
    return result


def default_policy(
    app: Any, *, missed: str | None = None, grace: float | None = None
) -> MissedPolicy:
    """The app-wide missed-slot policy: CLI values, else ``app.conf.pgskip_beat_*``, else the
    defaults."""
    conf = app.conf
    chosen = missed or conf.get("pgskip_beat_missed") or "latest"
    if chosen not in MISSED_POLICIES:
        raise exceptions.ConfigurationError(
            f"pgskip_beat_missed={chosen!r}: expected one of {', '.join(MISSED_POLICIES)}"
        )
    try:
        grace_td = _as_timedelta(
            grace if grace is not None else conf.get("pgskip_beat_grace", DEFAULT_GRACE),
            "pgskip_beat_grace",
        )
        max_catchup = int(conf.get("pgskip_beat_max_catchup", DEFAULT_MAX_CATCHUP))
    except (Refused, TypeError, ValueError) as exc:
        raise exceptions.ConfigurationError(str(exc)) from None
    if max_catchup < 1:
        raise exceptions.ConfigurationError("pgskip_beat_max_catchup must be >= 1")
    return MissedPolicy(missed=chosen, grace=grace_td, max_catchup=max_catchup)


def beat_entries(app: Any) -> dict[str, dict[str, Any]]:
    """``beat_schedule`` as celery beat sees it: task modules imported (``add_periodic_task``),
    plus ``celery.backend_cleanup`` when beat would add it."""
    app.loader.import_default_modules()
    app.finalize(auto=True)
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in (app.conf.beat_schedule or {}).items():
        if hasattr(entry, "schedule") and hasattr(entry, "task") and not isinstance(entry, dict):
            entries[str(name)] = {
                "task": entry.task,
                "schedule": entry.schedule,
                "args": entry.args,
                "kwargs": entry.kwargs,
                "options": entry.options,
            }
        else:
            entries[str(name)] = dict(entry)
    # celery.beat.Scheduler.install_default_entries
    if (
        app.conf.result_expires
        and not app.backend.supports_autoexpire
        and "celery.backend_cleanup" not in entries
    ):
        from celery.schedules import crontab

        entries["celery.backend_cleanup"] = {
            "task": "celery.backend_cleanup",
            "schedule": crontab("0", "4", "*"),
            "options": {"expires": 12 * 3600},
        }
    return entries


def plan_entries(app: Any, *, now: datetime, policy: MissedPolicy | None = None) -> list[EntryPlan]:
    """Every entry of the app's ``beat_schedule`` as an :class:`EntryPlan`.

    Raises :class:`ScheduleRefused` listing every entry that cannot be honoured, and why.
    """
    from celery.beat import BeatLazyFunc

    base = policy or default_policy(app)
    problems: list[tuple[str, str]] = []
    plans: list[EntryPlan] = []
    try:
        tz = zone(app.timezone)
    except Refused as exc:
        raise ScheduleRefused([("(all entries)", str(exc))]) from None
    if app.conf.task_always_eager:
        raise ScheduleRefused(
            [
                (
                    "(all entries)",
                    "task_always_eager is set: Celery would run the tasks here instead of "
                    "sending messages",
                )
            ]
        )
    if int(app.conf.task_protocol or 2) < 2:
        raise ScheduleRefused(
            [
                (
                    "(all entries)",
                    "task_protocol 1 puts the task id in the message body; periodic tasks need "
                    "protocol 2 (Celery's default)",
                )
            ]
        )
    for name, entry in sorted(beat_entries(app).items()):
        try:
            plans.append(
                _plan_one(app, name, entry, tz=tz, now=now, base=base, lazy_type=BeatLazyFunc)
            )
        except Refused as exc:
            problems.append((name, str(exc)))
    if problems:
        raise ScheduleRefused(problems)
    return plans


def _plan_one(
    app: Any,
    name: str,
    entry: dict[str, Any],
    *,
    tz: Any,
    now: datetime,
    base: MissedPolicy,
    lazy_type: type,
) -> EntryPlan:
    unknown = set(entry) - {"task", "schedule", "args", "kwargs", "options", "relative"}
    if unknown:
        raise Refused(f"unknown keys {sorted(unknown)} (celery beat would refuse them too)")
    task = entry.get("task")
    if not isinstance(task, str) or not task:
        raise Refused("'task' must be a task name")
    if "schedule" not in entry:
        raise Refused("no 'schedule'")
    args = list(entry.get("args") or ())
    kwargs = dict(entry.get("kwargs") or {})
    if any(isinstance(v, lazy_type) for v in [*args, *kwargs.values()]):
        raise Refused(
            "args/kwargs contain BeatLazyFunc values, which are evaluated in the beat process "
            "at each run; PostgreSQL sends a fixed message: compute the value in the task instead"
        )
    options = dict(entry.get("options") or {})
    spec = spec_for(entry["schedule"], tz=tz, now=now, relative=bool(entry.get("relative")))
    policy = _policy_for(app, name, options, spec, base)
    for key in _OUR_OPTIONS:
        options.pop(key, None)
    try:
        captured, task_id = _capture(app, task, args, kwargs, options)
    except Exception as exc:
        raise Refused(f"Celery could not build its message: {type(exc).__name__}: {exc}") from None
    if not captured:
        raise Refused("Celery routed the message to no queue")
    for _queue, message in captured:
        try:
            refuse_nul(dumps(message))
        except exceptions.ConfigurationError as exc:
            raise Refused(str(exc)) from None
    fixed_task_id = str(options["task_id"]) if options.get("task_id") else None
    messages: list[dict[str, Any]] = []
    id_paths: list[list[str]] = []
    registered = app.tasks.get(task)
    countdown = options.get("countdown")
    expires = options["expires"] if "expires" in options else getattr(registered, "expires", None)
    eta_offset = (
        timedelta(seconds=float(countdown))
        if isinstance(countdown, (int, float)) and not options.get("eta")
        else None
    )
    expires_offset = (
        timedelta(seconds=float(expires))
        if isinstance(expires, (int, float)) and not isinstance(expires, bool)
        else None
    )
    for queue, message in captured:
        if task_id.encode() in _decoded_body(message):
            raise Refused("the message body contains the task id (message protocol 1)")
        props = message.get("properties", {})
        if fixed_task_id is None:
            paths = _find_paths(
                {"headers": message.get("headers", {}), "properties": props}, task_id, []
            )
            if ["properties", "delivery_tag"] not in paths and "delivery_tag" in props:
                paths.append(["properties", "delivery_tag"])
            if not id_paths:
                id_paths = paths
        unique_key, concurrency_key = message_keys(message)
        captured_message = {
            "queue": queue,
            "priority": priority_of(message),
            "ttl_ms": ttl_ms_of(message),
            "payload": message,
        }
        # Only where given, so that an entry without keys is stored as before.
        if unique_key is not None:
            captured_message["unique_key"] = unique_key
        if concurrency_key is not None:
            captured_message["concurrency_key"] = concurrency_key
        messages.append(captured_message)
    plan = EntryPlan(
        name=name,
        task=task,
        spec=spec,
        timezone=tz.key,
        policy=policy,
        messages=messages,
        id_paths=id_paths,
        fixed_task_id=fixed_task_id,
        eta_offset=eta_offset,
        expires_offset=expires_offset,
    )
    return EntryPlan(**{**plan.__dict__, "digest": _digest(plan, task_id)})


def _digest(plan: EntryPlan, task_id: str) -> str:
    """A fingerprint of what the entry sends and when, blind to what changes at every capture."""
    normal = []
    for m in plan.messages:
        payload = copy.deepcopy(m["payload"])
        for path in plan.id_paths:
            node = payload
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = "<id>"
        headers = payload.setdefault("headers", {})
        props = payload.setdefault("properties", {})
        headers["origin"] = "<origin>"  # the syncing process's name
        props["reply_to"] = "<reply_to>"  # a per-process uuid
        props["delivery_tag"] = "<tag>"
        if plan.eta_offset is not None:
            headers["eta"] = "<eta>"
        if plan.expires_offset is not None:
            headers["expires"] = "<expires>"
        normal.append({**m, "payload": payload})
    doc = {
        "task": plan.task,
        "schedule": plan.spec.key,
        "tz": plan.timezone,
        "policy": plan.policy.describe(),
        "messages": normal,
        "fixed": plan.fixed_task_id,
        "eta": _seconds(plan.eta_offset),
        "expires": _seconds(plan.expires_offset),
        "ids": bool(plan.id_paths),
    }
    return hashlib.sha256(dumps(doc, sort_keys=True).encode()).hexdigest()


# -- storing -----------------------------------------------------------------------------------


def db_clock(url: str) -> tuple[datetime, str]:
    """The database server's ``now()`` and database name."""
    with connect(url) as conn:
        row = conn.execute(queries_in("periodic.sql", "pgskip")["db_clock"]).fetchone()
    assert row is not None
    return row[0], str(row[1])


def store_entries(
    url: str,
    schema: str,
    plans: list[EntryPlan],
    *,
    dry_run: bool = False,
    tick: timedelta | None = None,
) -> list[Change]:
    """Make the stored entries exactly ``plans``, in one transaction; return what changed.

    With ``tick`` (the period of the scheduler that runs ``fire_due()``), the same transaction
    then fires the schedule as a tick would, up to half a tick after the next tick
    (:func:`sync_lookahead`): every slot until the scheduler takes over is inserted at its
    exact time, none is left to be found late. A dry run fires nothing."""
    q = queries_in("periodic.sql", schema)
    changes: list[Change] = []
    with connect(url, autocommit=False) as conn:
        try:
            rows = conn.execute(q["beat_lock_entries"]).fetchall()
            existing = {str(r[0]): (str(r[1]), str(r[2])) for r in rows}
            described = _describe_existing(conn, schema, existing)
            now = conn.execute(q["db_clock"]).fetchone()[0]  # type: ignore[index]
            for plan in plans:
                have = existing.pop(plan.name, None)
                params = plan.params()
                if have is None:
                    conn.execute(q["beat_insert_entry"], params)
                    conn.execute(q["beat_restart_cursor"], {"name": plan.name})
                    changes.append(Change("+", plan.name, plan.describe()))
                    continue
                digest, key = have
                if digest == plan.digest:
                    changes.append(Change("=", plan.name, plan.describe()))
                    continue
                conn.execute(q["beat_update_entry"], params)
                conn.execute(q["beat_forget_waiting"], {"name": plan.name})
                if key != params["schedule_key"]:
                    conn.execute(q["beat_restart_cursor"], {"name": plan.name})
                changes.append(Change("~", plan.name, _what_changed(described[plan.name], plan)))
            for name in sorted(existing):
                conn.execute(q["beat_forget_waiting"], {"name": name})
                conn.execute(q["beat_delete_entry"], {"name": name})
                changes.append(Change("-", name, "removed (no longer in beat_schedule)"))
            if tick is not None and not dry_run:
                conn.execute(q["fire_due"], {"now": now, "lookahead": sync_lookahead(now, tick)})
            changes = _with_next_runs(conn, schema, changes, {p.name: p for p in plans})
        except BaseException:
            conn.rollback()
            raise
        if dry_run:
            conn.rollback()
        else:
            conn.commit()
    return changes


def sync_lookahead(now: datetime, tick: timedelta) -> timedelta:
    """How far ahead of ``now`` ``beat-sync`` fires the schedule itself: to half a tick after the
    next tick, where that tick (which inserts a tick and a half ahead) takes over with the same
    margin as between two ticks. Ticks come on multiples of their period, as pg_cron's and
    cron's minutes do."""
    period = _micros(tick)
    since_epoch = _micros(now - _EPOCH)
    next_tick = timedelta(microseconds=period - since_epoch % period)
    return next_tick + tick * (LOOKAHEAD_TICKS - 1)


def _with_next_runs(
    conn: Connection, schema: str, changes: list[Change], plans: dict[str, EntryPlan]
) -> list[Change]:
    """Added and changed entries say when they run next, as stored."""
    q = queries_in("periodic.sql", schema)
    next_runs = {str(r[0]): r[5] for r in conn.execute(q["beat_list"]).fetchall()}
    out = []
    for change in changes:
        if change.sign in "+~" and change.name in next_runs:
            nxt = next_runs[change.name]
            tz = zone(plans[change.name].timezone)
            when = (
                "; never runs again"
                if nxt is None
                else f"; next run {nxt.astimezone(tz).isoformat(sep=' ')}"
            )
            change = Change(change.sign, change.name, change.detail + when)
        out.append(change)
    return out


def _describe_existing(
    conn: Connection, schema: str, existing: dict[str, tuple[str, str]]
) -> dict[str, dict[str, Any]]:
    q = queries_in("periodic.sql", schema)
    out: dict[str, dict[str, Any]] = {}
    for row in conn.execute(q["beat_list"]).fetchall():
        out[str(row[0])] = {
            "task": row[1],
            "description": row[2],
            "timezone": row[3],
            "missed": row[4],
            "queues": sorted(row[9] or []),
        }
    return out


def _what_changed(old: dict[str, Any], plan: EntryPlan) -> str:
    parts = []
    if old["task"] != plan.task:
        parts.append(f"task {old['task']} -> {plan.task}")
    if old["description"] != plan.spec.describe() or old["timezone"] != plan.timezone:
        parts.append(
            f"schedule {old['description']} [{old['timezone']}] -> "
            f"{plan.spec.describe()} [{plan.timezone}]"
        )
    if old["queues"] != plan.queues:
        parts.append(f"queues {', '.join(old['queues'])} -> {', '.join(plan.queues)}")
    if old["missed"] != plan.policy.missed:
        parts.append(f"missed {old['missed']} -> {plan.policy.missed}")
    if not parts:
        parts.append("message (args, kwargs, options or policy) changed")
    return "; ".join(parts)


def tick_of(server: cron.CronServer | None, plans: list[EntryPlan]) -> tuple[str, timedelta]:
    """The firing job's pg_cron schedule and period: a minute, or (pg_cron 1.5 and later, an
    entry shorter than a minute) a few seconds. Without pg_cron, ``pgskip tick`` every minute."""
    if server is None:
        return "* * * * *", DEFAULT_TICK
    periods = [p.spec.every.total_seconds() for p in plans if isinstance(p.spec, IntervalSpec)]
    schedule, seconds = cron.tick_schedule(server, min(periods) if periods else None)
    return schedule, timedelta(seconds=seconds)


def fire_job(
    server: cron.CronServer, schema: str, plans: list[EntryPlan], conn: Connection
) -> list[cron.Job]:
    """The pg_cron job that fires the schedule (none when the schedule is empty)."""
    if not plans:
        return []
    from psycopg import sql

    schedule, tick = tick_of(server, plans)
    if tick == DEFAULT_TICK:
        command = sql.SQL("SELECT {}.fire_due()").format(sql.Identifier(schema))
    else:
        lookahead = (tick * LOOKAHEAD_TICKS).total_seconds()
        command = sql.SQL("SELECT {}.fire_due(lookahead => {})").format(
            sql.Identifier(schema), sql.Literal(f"{lookahead:g} seconds")
        )
    return [
        cron.Job(
            name=cron.job_prefix(server.app_database, schema) + "fire",
            schedule=schedule,
            command=command.as_string(conn),
            database=server.app_database,
        )
    ]


def beat_sync(
    app: Any,
    url: str,
    schema: str,
    *,
    dry_run: bool = False,
    use_cron: bool = True,
    policy: MissedPolicy | None = None,
    cron_database: str | None = None,
) -> SyncResult:
    """Store the app's ``beat_schedule`` and install the pg_cron job that fires it.

    Order of operations, so that a failure leaves nothing half-done: every entry is checked
    and its messages built; pg_cron and the role's privileges are checked; the entries are
    written in one transaction, which also fires them up to half a tick after pg_cron's next
    tick (so the first runs come on time, never in a burst at that tick); then the pg_cron job
    is installed (idempotent, so running the command again after fixing a pg_cron problem
    completes it).

    A dry run needs no pg_cron: when it cannot be used, the reason is in the result's
    ``cron_problem`` instead of raised.
    """
    now, _ = db_clock(url)
    plans = plan_entries(app, now=now, policy=policy)
    server: cron.CronServer | None = None
    cron_problem: str | None = None
    if use_cron:
        try:
            server = cron.locate(url, cron_database)
        except cron.PgCronError as exc:
            if not dry_run:
                raise
            cron_problem = str(exc)
    _, tick = tick_of(server, plans)
    changes = store_entries(url, schema, plans, dry_run=dry_run, tick=tick)
    cron_changes: list[str] = []
    mark: int | None = None
    if server is not None and not dry_run:
        prefix = cron.job_prefix(server.app_database, schema)
        with cron.cron_session(url, server) as conn:
            mark = cron.run_mark(conn, prefix)
            cron_changes = cron.ensure_jobs(
                conn,
                server,
                fire_job(server, schema, plans, conn),
                manage_prefixes=[prefix + "fire"],
            )
    for change in changes:
        if change.sign != "=":
            logger.info("beat-sync %s", change, extra={"action": "beat_sync"})
    return SyncResult(
        changes=changes,
        cron_changes=cron_changes,
        dry_run=dry_run,
        server=server,
        run_mark=mark,
        cron_problem=cron_problem,
    )


# -- reading and firing ------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredEntry:
    name: str
    task: str
    schedule: str
    timezone: str
    missed: str
    #: When its next message is sent: its next slot, or later for a late or paced run.
    next_run: datetime | None
    #: When its last message was sent.
    last_run: datetime | None
    last_task_id: str | None
    last_fired_at: datetime | None
    queues: list[str]


def list_entries(url: str, schema: str) -> list[StoredEntry]:
    q = queries_in("periodic.sql", schema)
    with exceptions.translating(url_for_messages=mask_url(url)), connect(url) as conn:
        rows = conn.execute(q["beat_list"]).fetchall()
    return [
        StoredEntry(
            str(r[0]),
            str(r[1]),
            str(r[2]),
            str(r[3]),
            str(r[4]),
            r[5],
            r[6],
            r[7],
            r[8],
            sorted(r[9] or []),
        )
        for r in rows
    ]


def fire_due(
    url: str,
    schema: str,
    *,
    now: datetime | None = None,
    lookahead: timedelta = DEFAULT_LOOKAHEAD,
) -> int:
    """Run ``<schema>.fire_due()`` once (what the pg_cron job does): fire the due slots and insert
    those up to ``now + lookahead``; returns the slots fired."""
    with connect(url) as conn:
        row = conn.execute(
            queries_in("periodic.sql", schema)["fire_due"], {"now": now, "lookahead": lookahead}
        ).fetchone()
    return int(row[0]) if row else 0


def _seconds(delta: timedelta | None) -> float | None:
    return None if delta is None else delta.total_seconds()


def _micros(delta: timedelta) -> int:
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


__all__ = [
    "Change",
    "EntryPlan",
    "MissedPolicy",
    "ScheduleRefused",
    "StoredEntry",
    "SyncResult",
    "beat_sync",
    "db_clock",
    "default_policy",
    "fire_due",
    "list_entries",
    "plan_entries",
    "store_entries",
]
