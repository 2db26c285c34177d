"""The crash scenario: how long after a worker is SIGKILLed does an ``acks_late`` run finish?

``python -m bench.crash [--brokers pgskip,rabbitmq] [--tasks 1500] [--task-ms 40] [--runs 1]``

Per broker and run: ``--tasks`` tasks of :mod:`bench.crashapp` (each sleeps ``--task-ms``) wait in
a fresh queue; two prefork workers (``-c 2``, ``--prefetch-multiplier 1``, ``acks_late`` with
``reject_on_worker_lost``) start on it. Once half of the tasks have finished, one worker's whole
process group gets SIGKILL and the worker is started again. Measured, from the tasks' own log
(one clock for every broker):

* ``after_kill_s``: from the kill until every task has finished at least once (the figure
  compared between brokers);
* ``recovery_s``: from the kill until every task that had started on the killed worker without
  finishing there has finished elsewhere;
* ``duplicates``: tasks that started more than once; for pgskip also ``in_flight``, the rows
  ``running`` under the killed worker's consumers right after the kill (a duplicate outside it
  would be a bug), and ``lost`` (tasks that never finished: always 0, or the run fails).

Brokers run with their defaults (pgskip: ``lease_seconds`` 30, ``sweep_interval`` 10, unless
``--lease`` / ``--sweep`` say otherwise). Results are printed, and written as JSON to ``--out``
(default ``bench/results/crash-<time>.json``). Nothing is asserted but the absence of loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from .brokers import BenchEnv, Broker
from .common import REPO, code_state, log, machine_info


@dataclass
class TaskLog:
    """The scenario's task log, parsed: per task, its starts and finishes (the worker's
    process group, time)."""

    starts: dict[int, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    finishes: dict[int, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def read(cls, path: Path) -> TaskLog:
        out = cls()
        with contextlib.suppress(FileNotFoundError):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) != 4:
                    continue  # a line being written right now
                target = out.starts if parts[0] == "start" else out.finishes
                target[int(parts[1])].append((int(parts[2]), float(parts[3])))
        return out


class CrashWorker:
    """``celery -A bench.crashapp worker -P prefork -c N`` in a session of its own."""

    def __init__(self, broker: Broker, queue: str, log_path: Path, name: str, concurrency: int):
        self.broker = broker
        self.queue = queue
        self.log_path = log_path
        self.name = name
        self.concurrency = concurrency
        self.out = Path(tempfile.gettempdir()) / f"bench-crash-{name}-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, transport_options: dict[str, Any]) -> CrashWorker:
        env = dict(os.environ)
        env.update(
            BENCH_BROKER_URL=self.broker.url or "",
            BENCH_QUEUE=self.queue,
            BENCH_TRANSPORT_OPTIONS=json.dumps(transport_options),
            BENCH_CRASH_LOG=str(self.log_path),
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        argv = [
            sys.executable, "-m", "celery", "-A", "bench.crashapp", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "--prefetch-multiplier", "1",
            "-Q", self.queue, "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
        ]  # fmt: skip
        with open(self.out, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> float:
        """SIGKILL the worker's process group; returns when the signal was sent, once every
        process of the group is gone."""
        assert self.proc is not None
        at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        self.proc = None
        return at

    def stop(self) -> None:
        if self.proc is not None:
            self.kill()
        with contextlib.suppress(FileNotFoundError):
            self.out.unlink()


def _in_flight(broker: Broker, pid: int) -> set[int] | None:
    """For pgskip: the tasks whose rows are ``running`` under the consumers of process
    ``pid``; None for other brokers (they do not say)."""
    if not broker.name.startswith("pgskip") or not broker.db_url:
        return None
    with psycopg.connect(broker.db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT j.payload::json->'headers'->>'argsrepr' FROM pgskip.jobs AS j"
            " JOIN pgskip.consumers AS c ON c.id = j.locked_by"
            " WHERE j.status = 'running' AND c.pid = %s",
            (pid,),
        ).fetchall()
    return {int(r[0].strip("()").split(",")[0]) for r in rows if r[0]}


def run_once(
    broker: Broker, tasks: int, task_s: float, transport_options: dict[str, Any]
) -> dict[str, Any]:
    from .crashapp import TASK, make_app

    broker.reset()
    queue = f"bench.crash.{uuid.uuid4().hex[:8]}"
    log_path = Path(tempfile.gettempdir()) / f"bench-crash-{uuid.uuid4().hex[:8]}.log"
    app = make_app(broker.publisher_url or "", queue, transport_options)
    workers = [CrashWorker(broker, queue, log_path, f"crash{k}", 2) for k in (1, 2)]
    try:
        with app.producer_or_acquire() as producer:
            for i in range(tasks):
                app.send_task(TASK, args=(i, task_s), queue=queue, producer=producer)
        started = time.time()
        for worker in workers:
            worker.start(transport_options)
        while len(TaskLog.read(log_path).finishes) < tasks // 2:
            if time.time() - started > 300:
                raise RuntimeError(f"{broker.name}: half the tasks not done after 300 s")
            time.sleep(0.02)
        victim = workers[0]
        pid = victim.pid
        killed_at = victim.kill()
        in_flight = _in_flight(broker, pid)
        victim.start(transport_options)
        deadline = time.monotonic() + 300
        while len(TaskLog.read(log_path).finishes) < tasks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{broker.name}: not every task finished within 300 s")
            time.sleep(0.05)
        time.sleep(1.0)  # late duplicates
        runs = TaskLog.read(log_path)
    finally:
        for worker in workers:
            worker.stop()
        with contextlib.suppress(Exception):
            app.close()
        broker.delete_queues([queue])
        with contextlib.suppress(FileNotFoundError):
            log_path.unlink()
    done_at = max(min(t for _, t in f) for f in runs.finishes.values())
    cut = {i for i, s in runs.starts.items() if any(p == pid for p, _ in s)}
    cut = {i for i in cut if not any(p == pid for p, _ in runs.finishes.get(i, []))}
    recovery = max(
        (max(t for _, t in runs.finishes[i] if t >= killed_at) for i in cut), default=killed_at
    )
    duplicates = {i for i, s in runs.starts.items() if len(s) > 1}
    lost = set(range(tasks)) - set(runs.finishes)
    if lost:
        raise RuntimeError(f"{broker.name}: {len(lost)} tasks lost")
    result: dict[str, Any] = {
        "broker": broker.name,
        "tasks": tasks,
        "task_ms": round(task_s * 1000),
        "after_kill_s": round(done_at - killed_at, 2),
        "recovery_s": round(recovery - killed_at, 2),
        "duplicates": len(duplicates),
        "cut_on_killed_worker": len(cut),
        "lost": 0,
        "wall_s": round(done_at - started, 2),
    }
    if in_flight is not None:
        result["in_flight"] = len(in_flight)
        result["duplicates_outside_in_flight"] = len(duplicates - in_flight)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="pgskip,rabbitmq")
    parser.add_argument("--tasks", type=int, default=1500)
    parser.add_argument("--task-ms", type=float, default=40.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--lease", type=float, help="pgskip lease_seconds (default 30)")
    parser.add_argument("--sweep", type=float, help="pgskip sweep_interval (default 10)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    wanted = [b.strip() for b in args.brokers.split(",") if b.strip()]
    results: list[dict[str, Any]] = []
    with BenchEnv(want=set(wanted)) as env:
        for name in wanted:
            broker = env.brokers.get(name)
            if broker is None or not broker.available:
                log(f"{name}: unavailable ({broker.reason if broker else 'unknown broker'})")
                continue
            options = dict(broker.transport_options)
            if name.startswith("pgskip"):
                if args.lease is not None:
                    options["lease_seconds"] = args.lease
                if args.sweep is not None:
                    options["sweep_interval"] = args.sweep
            for k in range(args.runs):
                result = run_once(broker, args.tasks, args.task_ms / 1000.0, options)
                result["run"] = k + 1
                log(" ".join(f"{key}={value}" for key, value in result.items()))
                results.append(result)
    out = args.out or REPO / "bench" / "results" / f"crash-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": machine_info(), "code": code_state(), "argv": sys.argv, "results": results},
            indent=2,
            default=str,
        )
    )
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
