"""Helpers shared by the benchmarks: quiet-machine wait, statistics, process trees, timing."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class Mode:
    """Sizes and durations of one run of the suite (``--short`` or ``--full``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        short = name == "short"
        self.runs = 1 if short else 3
        self.load_wait = 5.0 if short else 20.0
        self.load_sample = 0.5 if short else 1.0
        self.quiet_budget: float | None = 15.0 if short else 600.0  # seconds in all
        # Celery worker side: backlog size, and how long a slow broker may take.
        self.backlog = 1000 if short else 5000
        self.backlog_slow = 400 if short else 2000  # kombu's SQLAlchemy transport
        self.worker_timeout = 20.0 if short else 120.0
        # Celery end to end: tasks published by one publisher to an idle worker.
        self.e2e_tasks = 1000 if short else 5000
        self.e2e_tasks_slow = 300 if short else 2000
        # Latency samples (one task at a time on an idle worker).
        self.latency_samples = 100 if short else 300
        self.latency_gap = 0.01 if short else 0.02
        # Raw kombu: seconds of publishing (then those messages are consumed).
        self.raw_seconds = 1.0 if short else 3.0
        self.raw_consume_cap = 5.0 if short else 30.0
        # Raw SQL ceilings: seconds per measurement.
        self.sql_seconds = 1.0 if short else 3.0
        self.sql_prefill = 30_000 if short else 120_000
        # Scaling curve.
        self.scaling_procs = (1, 2, 4, 8)
        self.scaling_backlog = 1500 if short else 5000
        self.scaling_brokers = ("pgskip",) if short else None  # None: all
        # Memory with far-future countdowns.
        self.memory_tasks = 2000 if short else 100_000
        self.memory_tasks_slow = 500 if short else 20_000
        self.memory_settle = 2.0 if short else 30.0
        # Steady state: messages through the queue with pruning.
        self.steady_messages = 60_000 if short else 1_000_000
        self.steady_retention = 3.0 if short else 10.0


def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[k]


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as fh:
        parts = [float(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts), idle


def busy_cores(sample: float = 1.0) -> float:
    """How many cores were busy over ``sample`` seconds (while the bench itself is idle)."""
    total0, idle0 = _cpu_times()
    time.sleep(sample)
    total1, idle1 = _cpu_times()
    dt = total1 - total0
    if dt <= 0:
        return 0.0
    return (os.cpu_count() or 1) * (1.0 - (idle1 - idle0) / dt)


def loadavg1() -> float:
    return os.getloadavg()[0]


def wait_quiet(max_wait: float, sample: float = 1.0) -> dict[str, float]:
    """Wait (up to ``max_wait`` s) until the machine is quiet; return what was seen.

    Quiet means a 1-minute load average below 1.0, or, since our own previous measurement keeps
    that average up for a minute after it ends, fewer than 0.5 cores busy over a one-second
    sample taken while the bench is idle (other engineers' tests show up there at once).
    """
    start = time.monotonic()
    while True:
        la = loadavg1()
        busy = busy_cores(sample)
        waited = time.monotonic() - start
        if la < 1.0 or busy < 0.5 or waited >= max_wait:
            return {
                "loadavg1": round(la, 2),
                "busy_cores": round(busy, 2),
                "waited_s": round(waited, 1),
                "quiet": la < 1.0 or busy < 0.5,
            }


def rss_tree_kb(pid: int) -> int:
    """Resident memory (kB) of ``pid`` and all its descendants."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def fdatasync_rate(seconds: float = 1.0, directory: str = "/tmp") -> float:
    """fdatasync() calls per second of one 8 kB write on the disk holding ``directory``."""
    path = Path(directory) / f"bench-fsync-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        buf = b"\0" * 8192
        n = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            os.pwrite(fd, buf, 0)
            os.fdatasync(fd)
            n += 1
        return n / seconds
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            info["mem_total_gb"] = round(int(fh.readline().split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import celery
    import kombu
    import psycopg

    info["celery"] = celery.__version__
    info["kombu"] = kombu.__version__
    info["psycopg"] = psycopg.__version__
    try:
        import redis

        info["redis_py"] = redis.__version__
    except ImportError:
        pass
    try:
        import sqlalchemy

        info["sqlalchemy"] = sqlalchemy.__version__
    except ImportError:
        pass
    with contextlib.suppress(OSError):
        info["fdatasync_per_s"] = round(fdatasync_rate(1.0))
    return info


def code_state() -> dict[str, Any]:
    """Which kombu-pgskip was measured: HEAD, uncommitted changes, a digest of the package."""
    import hashlib

    out: dict[str, Any] = {}
    try:
        out["head"] = run_quiet(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
        ).stdout.strip()
        status = run_quiet(
            ["git", "-C", str(REPO), "status", "--porcelain", "kombu_pgskip", "migrations"]
        )
        out["uncommitted"] = [line[3:] for line in status.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    digest = hashlib.sha256()
    for path in sorted((REPO / "kombu_pgskip").rglob("*")):
        if path.suffix in (".py", ".sql"):
            digest.update(path.read_bytes())
    for path in sorted((REPO / "migrations").glob("*.sql")):
        digest.update(path.read_bytes())
    out["package_sha256"] = digest.hexdigest()[:16]
    return out


def run_quiet(cmd: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
