"""Real ``celery worker`` subprocesses of :mod:`bench.benchapp`, and the stamps they leave."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from .benchapp import make_app
from .brokers import Broker
from .common import REPO


def new_queue(tag: str) -> str:
    return f"bench.{tag}.{uuid.uuid4().hex[:8]}"


class StampDir:
    """A temporary directory the workers' ``bench.noop`` tasks write their start stamps to."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="bench-stamps-"))

    def read(self) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = []
        for f in self.path.glob("stamps-*.txt"):
            for line in f.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2:
                    with contextlib.suppress(ValueError):  # a line being written right now
                        out.append((int(parts[0]), float(parts[1])))
        return out

    def count(self, skip_negative: bool = True) -> int:
        n = 0
        for f in self.path.glob("stamps-*.txt"):
            for line in f.read_text().splitlines():
                if not skip_negative or not line.startswith("-"):
                    n += 1
        return n

    def wait_for(self, n: int, timeout: float, poll: float = 0.05) -> int:
        """Wait until ``n`` stamps (index >= 0) exist or ``timeout`` passes; return the count."""
        deadline = time.monotonic() + timeout
        last, _last_change = -1, time.monotonic()
        while True:
            c = self.count()
            if c >= n:
                return c
            now = time.monotonic()
            if c != last:
                last, _last_change = c, now
            if now >= deadline:
                return c
            time.sleep(poll)

    def wait_index(self, index: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(i == index for i, _ in self.read()):
                return True
            time.sleep(0.05)
        return False

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Worker:
    """One ``celery -A bench.benchapp worker`` process (its own session, stopped by group)."""

    def __init__(
        self,
        broker: Broker,
        queue: str,
        stamps: StampDir,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        name: str = "bench",
        log_dir: Path | None = None,
        acks_late: bool = False,
        celery_defaults: bool = False,
    ) -> None:
        self.broker = broker
        self.acks_late = acks_late
        self.celery_defaults = celery_defaults
        self.queue = queue
        self.stamps = stamps
        self.pool = pool
        self.concurrency = concurrency
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.log_path = (log_dir or stamps.path) / f"worker-{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        # Out of the box a worker gossips, mingles and sends heartbeats; the measurements
        # turn that off for every broker, except those of Celery's defaults.
        quiet = (
            []
            if self.celery_defaults
            else [
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.benchapp",
            "worker",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-Q",
            self.queue,
            "-n",
            f"{self.name}@%h",
            *quiet,
            "-l",
            "WARNING",
        ]

    def start(self) -> Worker:
        env = dict(os.environ)
        env.update(
            BENCH_BROKER_URL=self.broker.url or "",
            BENCH_QUEUE=self.queue,
            BENCH_TRANSPORT_OPTIONS=json.dumps(self.broker.transport_options),
            BENCH_STAMP_DIR=str(self.stamps.path),
            BENCH_ACKS_LATE="1" if self.acks_late else "0",
            BENCH_CELERY_DEFAULTS="1" if self.celery_defaults else "0",
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(),
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill the worker's whole process group.

        Nothing a worker does after a measurement matters, and its warm (and even cold)
        shutdown can take seconds; the next measurement empties the broker anyway.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop_all(workers: Iterable[Worker]) -> None:
    for w in workers:
        w.stop()


def publisher_app(broker: Broker, queue: str, *, celery_defaults: bool = False) -> Any:
    return make_app(
        broker.publisher_url or "",
        queue,
        broker.transport_options,
        celery_defaults=celery_defaults,
    )


@contextlib.contextmanager
def idle_worker(
    broker: Broker, tag: str, processes: int = 1, *, celery_defaults: bool = False
) -> Iterator[tuple[Any, StampDir, list[Worker]]]:
    """Started ``-P threads -c 4`` workers (``processes`` of them, on one queue) and a
    publisher app for that queue (the caller checks :func:`warm_up`); stopped, cleaned up and
    the queue deleted on exit. ``celery_defaults``: workers as they run out of the box (remote
    control, gossip, mingle and heartbeats on)."""
    queue = new_queue(tag)
    app = publisher_app(broker, queue, celery_defaults=celery_defaults)
    stamps = StampDir()
    workers = [
        Worker(
            broker,
            queue,
            stamps,
            pool="threads",
            concurrency=4,
            name=f"{tag}{k}",
            celery_defaults=celery_defaults,
        )
        for k in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        yield app, stamps, workers
    finally:
        stop_all(workers)
        stamps.cleanup()
        app.close()
        broker.delete_queues([queue])


def publish_backlog(
    broker: Broker, app: Any, n: int, *, countdown: float | None = None, start: int = 0
) -> float:
    """Publish ``n`` noop tasks as fast as this broker takes them; returns the seconds taken.

    pgskip writes them with ``apply_async_in``, 1,000 per transaction (the fastest durable way
    it has); the others with ``apply_async`` one by one. Only the backlog's existence matters
    to the measurements that use this, not how fast it was made.
    """
    task = app.tasks["bench.noop"]
    opts: dict[str, Any] = {}
    if countdown is not None:
        opts["countdown"] = countdown
    t0 = time.perf_counter()
    if broker.name.startswith("pgskip") and broker.db_url:
        from kombu_pgskip import apply_async_in

        with psycopg.connect(broker.db_url) as conn:
            for lo in range(start, start + n, 1000):
                with conn.transaction():
                    for i in range(lo, min(start + n, lo + 1000)):
                        apply_async_in(conn, task, kwargs={"i": i}, **opts)
    else:
        for i in range(start, start + n):
            task.apply_async(kwargs={"i": i}, **opts)
    return time.perf_counter() - t0


def warm_up(app: Any, stamps: StampDir, timeout: float = 60.0) -> bool:
    """Publish one task (index -1) and wait until a worker has started it: the worker is up."""
    app.tasks["bench.noop"].apply_async(kwargs={"i": -1})
    return stamps.wait_index(-1, timeout)
