"""What every chaos scenario shares: workers, seeding, the task log, the verdict, the report.

Every message carries a unique integer id as its first argument (and ``chaos-<id>`` as its task
id). The task (tests/apps/chaosapp.py) appends ``start``/``finish`` lines to a per-run log file,
so a scenario counts, for every id, how many times its task started and finished, and knows when.

The verdict (:func:`verdict`): nothing lost (every id finished at least once), and every id that
started twice is among those a fault could legitimately make run again: the ids *in flight* at a
fault, read from the database, never guessed from timings:

* a kill: rows still ``running`` under the dead worker's consumers right after its process
  group is gone (executing, prefetched, or finished with the ack not yet written);
* a network cut: rows ``running`` while the proxy refuses connections (nothing can change then);
* a database restart: rows ``running`` just before it and just after it (a fetch or ack
  between the first look and the shutdown shows in the second), plus, after an immediate
  (crash) restart only, ids delivered twice as first deliveries around it: a fetch committed
  asynchronously and undone by the crash (:func:`refetched_after_crash`); and ids whose publish
  call overlapped a restart (the INSERT committed, the reply was lost, Celery published again).
"""

from __future__ import annotations

import base64
import json
import os
import random
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from kombu_pgskip.envelope import to_row
from tests.acceptance.conftest import APPS_DIR, wait_until
from tests.helpers import CeleryWorker

TASK = "chaosapp.work"
QUEUE = "chaos"
#: How soon after reconnecting a worker starts the messages it had prefetched before a fault.
PREFETCH_GRACE_S = 2.0
#: Short leases so that a dead worker's messages come back within seconds.
FAST_LEASES = {"PGSKIP_OPT_LEASE_SECONDS": "3", "PGSKIP_OPT_SWEEP_INTERVAL": "1"}
#: How long a dead consumer's rows may take to be swept back and completed with FAST_LEASES
#: (lease 3 s + sweep 1 s + a reconnect or poll), with a wide margin for a loaded machine.
REDELIVERY_WAIT_S = 30.0


def task_id(msg_id: int) -> str:
    return f"chaos-{msg_id}"


def msg_id_of(task_id_: str) -> int:
    return int(task_id_.rsplit("-", 1)[1])


# -- the task log --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    pid: int
    host: str
    at: float  # time.time() in the worker
    tag: str  # the delivery tag when Celery passes it to the task, else "-"
    redelivered: bool


@dataclass
class Runs:
    """The task log, parsed: per id, every start and every finish, in log order."""

    starts: dict[int, list[Event]] = field(default_factory=lambda: defaultdict(list))
    finishes: dict[int, list[Event]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def read(cls, path: Path) -> Runs:
        runs = cls()
        try:
            text = path.read_text()
        except FileNotFoundError:
            return runs
        for line in text.splitlines():
            parts = line.split()
            if len(parts) != 7:
                continue  # a line being written right now
            what, msg, pid, host, at, tag, redelivered = parts
            target = runs.starts if what == "start" else runs.finishes
            target[int(msg)].append(Event(int(pid), host, float(at), tag, redelivered == "1"))
        return runs

    def finished_count(self) -> int:
        return len(self.finishes)

    def first_finish(self, msg: int) -> float | None:
        events = self.finishes.get(msg)
        return min(e.at for e in events) if events else None


class FinishCounter:
    """Counts distinct finished ids, reading only what was appended since the last call.

    Polling a 100,000-line log from scratch ten times a second would cost the workers under
    test a good part of a core.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._done: set[bytes] = set()

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        self._done.update(line.split(b" ", 2)[1] for line in lines if line[:7] == b"finish ")
        return len(self._done)


def wait_progress(progress: Callable[[], int], n: int, what: str, timeout: float = 120) -> None:
    """Wait until ``progress()`` (a :class:`FinishCounter`) reaches ``n``."""
    wait_until(lambda: progress() >= n, timeout, what)


def wait_ids_finished(path: Path, ids: Iterable[int], timeout: float, what: str) -> None:
    """Wait until every id in ``ids`` finished at least once."""
    wanted = set(ids)
    wait_until(lambda: wanted <= set(Runs.read(path).finishes), timeout, what)


def wait_finished(path: Path, n: int, timeout: float, what: str) -> None:
    counter = FinishCounter(path)
    deadline = time.monotonic() + timeout
    while counter() < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {counter()} of {n} ids finished after {timeout}s")
        time.sleep(0.25)


def wait_all_completed(db_url: str, n: int, timeout: float, *, kept: bool = True) -> None:
    """Until every row of the queue is ``completed`` (the workers must still run); with
    ``kept`` false (workers with ``keep_completed=False``), until no row is left.

    A task that finished just before its worker was killed may have had its ack still queued
    (acks are written with the next fetch): its row stays ``running`` under the dead consumer
    until a live worker's sweeper returns it (``lease_seconds`` plus the sweep interval) and it
    runs again. Nothing is lost, but the table only converges once that has happened.
    """
    deadline = time.monotonic() + timeout
    expected = {"completed": n} if kept else {}
    while (counts := job_status_counts(db_url)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"rows not all completed after {timeout}s: {counts}")
        time.sleep(0.25)


def refetched_after_crash(runs: Runs, crashed_at: float, back_at: float) -> set[int]:
    """Ids a crash made the broker hand out twice as first deliveries.

    A fetch committed asynchronously can be undone by a server crash after the worker got its
    rows: the row is ``pending`` again with ``redelivered`` false, and is fetched again. Such an
    id has two starts, neither redelivered, the first before the worker could have reconnected
    (``back_at`` plus a moment for messages it had prefetched), the second after the crash.
    """
    out: set[int] = set()
    for msg, starts in runs.starts.items():
        if len(starts) < 2 or any(s.redelivered for s in starts):
            continue
        first, *later = sorted(s.at for s in starts)
        if first <= back_at + PREFETCH_GRACE_S and max(later) >= crashed_at:
            out.add(msg)
    return out


# -- publishing ---------------------------------------------------------------------------------


def publisher(broker_url: str) -> Celery:
    app = Celery("chaos-publisher", broker=broker_url, set_as_current=False)
    app.conf.task_default_queue = QUEUE
    return app


def seed(db_url: str, broker_url: str, ids: Iterable[int], sleep: float = 0.0) -> float:
    """Put one ``chaosapp.work(id[, sleep])`` message per id in the queue; returns seconds taken.

    Celery publishes one real message (to a scratch queue); the others are that message with
    their own id, task id and arguments, written with ``COPY``: a backlog of 100,000 in seconds
    instead of minutes. The rows are exactly what ``send_task`` would have stored.
    """
    started = time.monotonic()
    scratch = f"chaos-template-{uuid.uuid4().hex[:8]}"
    app = publisher(broker_url)
    try:
        app.send_task(TASK, args=(0,), queue=scratch, task_id=task_id(0))
    finally:
        app.close()
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "DELETE FROM pgskip.jobs WHERE queue = %s RETURNING payload", (scratch,)
        ).fetchone()
        assert row is not None
        template: dict[str, Any] = row[0]
        conn.execute("DELETE FROM pgskip.queues WHERE name = %s", (scratch,))
        body = json.loads(base64.b64decode(template["body"]))
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY pgskip.jobs (queue, priority, status, payload, task_name, task_id) FROM STDIN"
            ) as copy,
        ):
            headers, props = template["headers"], template["properties"]
            delivery_info = {**props["delivery_info"], "routing_key": QUEUE}
            for msg in ids:
                args = (msg, sleep) if sleep else (msg,)
                tid = task_id(msg)
                message = {
                    **template,
                    "body": base64.b64encode(json.dumps([list(args), *body[1:]]).encode()).decode(),
                    "headers": {**headers, "id": tid, "root_id": tid, "argsrepr": repr(args)},
                    "properties": {
                        **props,
                        "correlation_id": tid,
                        "delivery_tag": str(uuid.uuid4()),
                        "delivery_info": delivery_info,
                    },
                }
                new = to_row(QUEUE, message, eta_threshold=2.0, max_message_size=1 << 20)
                copy.write_row(
                    (new.queue, new.priority, new.status, new.payload, new.task_name, new.task_id)
                )
    return time.monotonic() - started


def running_ids_of(db_url: str, worker_pid: int) -> set[int]:
    """Ids whose rows are ``running`` under consumers registered by process ``worker_pid``."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT j.task_id FROM pgskip.jobs j JOIN pgskip.consumers c ON c.id = j.locked_by"
            " WHERE j.status = 'running' AND c.pid = %s",
            (worker_pid,),
        ).fetchall()
    return {msg_id_of(r[0]) for r in rows}


def running_ids(db_url: str) -> set[int]:
    """Ids whose rows are ``running`` (delivered to some consumer, not yet settled)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT task_id FROM pgskip.jobs WHERE status = 'running' AND queue = %s", (QUEUE,)
        ).fetchall()
    return {msg_id_of(r[0]) for r in rows}


def job_status_counts(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status::text, count(*) FROM pgskip.jobs WHERE queue = %s GROUP BY 1", (QUEUE,)
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


# -- workers ------------------------------------------------------------------------------------


class Fleet:
    """Named ``chaosapp`` workers that can be killed and restarted under the same name."""

    def __init__(
        self,
        broker_url: str,
        log_path: Path,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        env: dict[str, str] | None = None,
    ) -> None:
        self.broker_url = broker_url
        self.log_path = log_path
        self.pool = pool
        self.concurrency = concurrency
        self.env = {**FAST_LEASES, **(env or {})}
        self.workers: dict[str, CeleryWorker] = {}
        self.retired: list[CeleryWorker] = []

    def start(
        self, names: Sequence[str], wait: bool = True, extra_args: Sequence[str] = ()
    ) -> None:
        for name in names:
            worker = CeleryWorker(
                "chaosapp",
                self.broker_url,
                cwd=APPS_DIR,
                pool=self.pool,
                concurrency=self.concurrency,
                hostname=f"{name}@%h",
                extra_env={
                    **self.env,
                    "PGSKIP_CHAOS_LOG": str(self.log_path),
                    "PGSKIP_CHAOS_HOST": name,
                },
                extra_args=list(extra_args),
            )
            self.workers[name] = worker.start(wait_ready=False)
        if wait:
            for name in names:
                self.workers[name].wait_for_log(r"@\S+ ready\.", timeout=60)

    def ready(self, name: str) -> bool:
        return "ready." in self.workers[name].log_text()

    def kill(self, name: str) -> tuple[int, float]:
        """SIGKILL the worker's process group; returns (its pid, when the signal was sent).

        Returns once every process of the group is gone, so the database state of its rows is
        final when the caller looks.
        """
        worker = self.workers.pop(name)
        pid = worker.pid
        at = time.time()
        worker.kill9()
        self.retired.append(worker)
        return pid, at

    def all_running(self) -> bool:
        return all(w.is_running() for w in self.workers.values())

    def stop(self) -> None:
        """Kill every worker; keep their logs (and print their tails) if a test is failing."""
        failing = sys.exc_info()[0] is not None
        if failing:
            print(self.logs_tail())
        for worker in self.workers.values():
            worker.kill9()  # the verdict is already in: no need for a warm shutdown
        for worker in [*self.workers.values(), *self.retired]:
            if failing:
                print(f"kept worker log {worker.log_path}")
            else:
                worker.remove_log()
        self.workers.clear()
        self.retired.clear()

    def logs_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {name} ---\n{w.log_text()[-chars:]}" for name, w in self.workers.items()
        )


def kill_and_restart(
    fleet: Fleet,
    db_url: str,
    kills: int,
    progress: Callable[[], int],
    total: int,
    rng: random.Random,
) -> list[tuple[str, float, set[int]]]:
    """Kill a random ready worker ``kills`` times as the run progresses, restarting each.

    Kill k happens once ``progress()`` passes k/(kills+1) of ``total``. Returns, per kill, the
    worker's name, the time, and the ids in flight on it (from the database, see module doc).
    """
    out: list[tuple[str, float, set[int]]] = []
    for k in range(1, kills + 1):
        wait_progress(progress, total * k // (kills + 1), f"kill {k}'s turn")
        wait_until(lambda: any(fleet.ready(n) for n in fleet.workers), 60, "a ready worker")
        name = rng.choice(sorted(n for n in fleet.workers if fleet.ready(n)))
        pid, at = fleet.kill(name)
        out.append((name, at, running_ids_of(db_url, pid)))
        fleet.start([name], wait=False)
    return out


# -- verdict and report -------------------------------------------------------------------------


@dataclass
class Figures:
    scenario: str
    messages: int
    faults: int
    fault_kind: str
    duplicates: int
    lost: int
    in_flight_at_faults: int
    recovery_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.extra.items())
        return (
            f"chaos {self.scenario}: messages={self.messages} {self.fault_kind}={self.faults} "
            f"duplicates={self.duplicates} (in flight at faults: {self.in_flight_at_faults}) "
            f"lost={self.lost} recovery={self.recovery_s:.1f}s wall={self.wall_s:.1f}s {extra}"
        ).rstrip()


def verdict(
    runs: Runs, ids: Iterable[int], in_flight: set[int], maybe: Iterable[int] = ()
) -> tuple[int, int]:
    """Assert nothing lost and duplicates only among ``in_flight``; returns (dups, lost).

    ``ids`` must each finish; ``maybe`` (publishes that raised) may run or not, at most once
    unless in flight at a fault.
    """
    expected = set(ids)
    finished = set(runs.finishes)
    lost = expected - finished
    started = Counter({m: len(s) for m, s in runs.starts.items()})
    dups = {m for m, n in started.items() if n > 1}
    unexpected = (set(runs.starts) | finished) - expected - set(maybe)
    assert not unexpected, f"ids nobody published ran: {sorted(unexpected)[:20]}"
    assert not lost, f"{len(lost)} messages lost, e.g. {sorted(lost)[:20]}"
    stray = dups - in_flight
    assert not stray, (
        f"{len(stray)} messages ran twice without being in flight at a fault, e.g. "
        f"{[(m, runs.starts[m]) for m in sorted(stray)[:5]]}"
    )
    return len(dups), len(lost)


def recovery_after(runs: Runs, fault_at: float, in_flight: set[int]) -> float:
    """Seconds from ``fault_at`` until every id in flight then had finished (after it)."""
    latest = fault_at
    for msg in in_flight:
        after = [e.at for e in runs.finishes.get(msg, []) if e.at >= fault_at]
        done = max(after) if after else (runs.first_finish(msg) or fault_at)
        latest = max(latest, done)
    return latest - fault_at


def report(figures: Figures, path: Path) -> None:
    """Append the figures as a JSON line to ``path`` and print the one-line summary."""
    line = {**asdict(figures), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")
    print(figures.summary())


def report_path(default: Path) -> Path:
    return Path(os.environ.get("PGSKIP_CHAOS_REPORT") or default)
