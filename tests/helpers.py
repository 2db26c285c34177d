"""Test helpers: database URLs and real ``celery worker`` subprocesses."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import psycopg.sql
from psycopg import conninfo

if TYPE_CHECKING:
    from kombu_pgskip.store import Store

REPO_ROOT = Path(__file__).resolve().parent.parent

_READY_RE = re.compile(r"@\S+ ready\.")


def make_url(dsn: str, dbname: str) -> str:
    """``dsn`` pointing at database ``dbname`` on the same server.

    URLs (``postgresql://``, ``pgskip://`` ...) stay URLs with the same scheme, query string
    and credentials; key=value conninfo strings stay conninfo strings.
    """
    if "://" in dsn:
        parts = urlsplit(dsn)
        return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))
    params = conninfo.conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return conninfo.make_conninfo("", **params)


_live_workers: set[CeleryWorker] = set()


@atexit.register
def _kill_leftover_workers() -> None:
    for worker in list(_live_workers):
        worker.kill9()


class CeleryWorker:
    """A real ``celery -A <app_module> worker`` subprocess.

    The worker reads its broker URL from ``$PGSKIP_BROKER_URL`` (the test apps do). It runs in
    its own process group so that :meth:`kill9` and cleanup also reach prefork children; its
    stdout and stderr go to :attr:`log_path`. Use as a context manager, or call :meth:`start`
    and :meth:`stop`.
    """

    def __init__(
        self,
        app_module: str,
        broker_url: str,
        *,
        queues: list[str] | None = None,
        pool: str = "threads",
        concurrency: int = 2,
        hostname: str | None = None,
        extra_env: dict[str, str] | None = None,
        cwd: str | None = None,
        extra_args: list[str] | None = None,
        without: tuple[str, ...] = ("gossip", "mingle", "heartbeat"),
    ) -> None:
        self.app_module = app_module
        self.broker_url = broker_url
        self.queues = list(queues) if queues else None
        self.pool = pool
        self.concurrency = concurrency
        self.hostname = hostname or f"pgskip-{uuid.uuid4().hex[:8]}@%h"
        self.extra_env = dict(extra_env or {})
        self.cwd = cwd or str(REPO_ROOT)
        self.extra_args = list(extra_args or [])
        self.without = tuple(without)
        fd, path = tempfile.mkstemp(prefix="celery-worker-", suffix=".log")
        os.close(fd)
        self.log_path = path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "celery", "-A", self.app_module, "worker",
            "--loglevel=INFO",
            "-P", self.pool,
            "-c", str(self.concurrency),
            "-n", self.hostname,
        ]  # fmt: skip
        if self.queues:
            argv += ["-Q", ",".join(self.queues)]
        argv += [f"--without-{step}" for step in self.without]
        return argv + self.extra_args

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("worker not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """``None`` while running (or never started), else the exit status."""
        return None if self._proc is None else self._proc.poll()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, wait_ready: bool = True, timeout: float = 30) -> CeleryWorker:
        """Launch the worker; with ``wait_ready`` block until it logs ``<host> ready.``.

        Raises :class:`RuntimeError` with the worker's log when it exits or does not become
        ready within ``timeout`` seconds (it is killed in that case).
        """
        if self._proc is not None:
            raise RuntimeError("worker already started")
        env = dict(os.environ)
        env["PGSKIP_BROKER_URL"] = self.broker_url
        env["PYTHONUNBUFFERED"] = "1"
        # The repo must be importable even without an editable install.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.update(self.extra_env)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _live_workers.add(self)
        if wait_ready:
            try:
                self.wait_for_log(_READY_RE, timeout=timeout)
            except RuntimeError:
                self.kill9()
                raise
        return self

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout: float = 30) -> re.Match[str]:
        """Block until ``pattern`` (a regex) appears in the log; return the match."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text())
            if match:
                return match
            if not self.is_running():
                raise RuntimeError(
                    f"celery worker exited with {self.returncode} before logging "
                    f"{regex.pattern!r}; log:\n{self.log_text()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"celery worker did not log {regex.pattern!r} within {timeout}s; "
                    f"log:\n{self.log_text()}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 20) -> int | None:
        """Warm shutdown: SIGTERM to the main process, then SIGKILL the group after ``timeout``.

        Only the main process gets SIGTERM so that Celery's own warm shutdown (finish the
        running tasks, then exit) is what is exercised. Returns the exit status.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        return proc.returncode

    def kill9(self) -> None:
        """SIGKILL the whole process group at once, like a machine losing power."""
        self._kill_group()

    def _kill_group(self) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        # Prefork children are not ours to wait for; poll until the group is gone so that a
        # caller who goes on to check redelivery knows no worker process is still running.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
        _live_workers.discard(self)

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def remove_log(self) -> None:
        Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> CeleryWorker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        # Keep the log for post-mortems when the block failed.
        if exc_type is None:
            self.remove_log()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exit={self.returncode}"
        return f"<CeleryWorker {self.app_module} {self.hostname} {state}>"


def build_wheel(into: Path) -> Path:
    """Build the wheel (no dependencies, no build isolation) from a copy of the files it is
    made of, into ``into``, and return it: an in-tree build reuses build/lib, which keeps
    modules deleted from the source tree and ships them."""
    src = into / "src"
    for name in ("kombu_pgskip", "migrations", "build_backend"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("_kombu_pgskip_alias.py", "_kombu_pgskip_pytest.py", "pyproject.toml"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in ("README.md", "LICENSE"):
        shutil.copy2(REPO_ROOT / name, src / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(into), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = into.glob("kombu_pgskip-*.whl")
    return wheel


def seq_scanned_rows(conn: psycopg.Connection[Any], plan: str) -> list[str]:
    """The partitions of ``pgskip.jobs`` that hold rows and that ``plan`` (EXPLAIN text) reads
    sequentially. A slot of the ring that holds none is read sequentially at no cost, as the
    planner rightly chooses when its statistics say it is empty."""
    found = []
    for name in sorted(set(re.findall(r"Seq Scan on (jobs\w*)", plan))):
        row = conn.execute(
            psycopg.sql.SQL("SELECT EXISTS (SELECT FROM pgskip.{})").format(
                psycopg.sql.Identifier(name)
            )
        ).fetchone()
        if row and row[0]:
            found.append(name)
    return found


def finished_slot_behind(store: Store, db_url: str) -> None:
    """Slots of 10 ids, completed messages kept 0 s: slot 1 full of messages that ran, behind
    the current slot 2, for the next rotation to empty (a session holding its lock stops it)."""
    from kombu_pgskip.store import NewMessage

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 10, completed_retention = '0 s'")
    me = uuid.uuid4()
    store.register_consumer(me, hostname="h", queues=["q"], lease=60)
    store.publish_many([NewMessage("q", 0, "pending", None, "{}", None, None, None)] * 10)
    assert store.ack([r.tag for r in store.fetch(["q"], 10, me)], me) == 10
    assert store.rotate() == (0, 0, 2)


class FakeClock:
    """A monotonic clock a test moves by hand (``clock.now += 6``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plain_notes(
    listener: psycopg.Connection[Any], count: int, timeout: float = 2.0
) -> list[psycopg.Notify]:
    """The notifications ``listener`` hears within ``timeout`` s, up to the ``count``-th that
    names no message: those a worker of any version acts on. The one a single-message publish
    sends before its plain one, naming the message (queue, id and slot), is left out."""
    from kombu_pgskip.poller import NAME_SEPARATOR

    notes: list[psycopg.Notify] = []
    if count <= 0:
        return notes
    for note in listener.notifies(timeout=timeout):
        if NAME_SEPARATOR in note.payload:
            continue
        notes.append(note)
        if len(notes) >= count:
            break
    return notes


def woken(listener: psycopg.Connection[Any], count: int, timeout: float = 2.0) -> list[str]:
    """The payloads of :func:`plain_notes`."""
    return [n.payload for n in plain_notes(listener, count, timeout)]


def running_orphans(db_url: str, n: int = 1, queue: str = "q") -> list[int]:
    """``n`` running messages of ``queue`` whose consumer is no longer known (no consumers row:
    deleted by hand, or left by a sweep that reached its batch limit), as a superuser writes
    them; their ids."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload, status, locked_by, locked_at, attempts)"
            " SELECT %s, '{}'::json, 'running', gen_random_uuid(), now(), 1"
            "   FROM generate_series(1, %s) RETURNING id",
            (queue, n),
        ).fetchall()
    return [int(r[0]) for r in rows]
