"""A rolling deploy with real processes: the previous release, installed from git history into a
virtualenv of its own, keeps publishing and consuming while this release migrates and starts.

The pair: this checkout (the new release, built for its newest migration N) and the commit
before migration N was added (HEAD while N is not committed): the previous release, built for
the schema before N. When the window of schema N does not reach back to that release (a
migration in between breaks its code), there is no rolling deploy between the two, and the
tests that need the previous release skip, saying so.

A previous release that reads the window (the migrations' ``compatible-with`` claims recorded
in the database) starts against the newer schema like any process inside its window. One that
predates the window accepts exactly its own schema version: its processes already running when
the migration lands keep running (a process checks the schema once), but one that starts
afterwards refuses the newer schema (SchemaTooNew); that such a process works against the newer
schema, as the migration's header claims, is shown by starting one with ``check_schema`` off.
Starting the new release before migrating is refused (SchemaOutdated, saying to migrate
first), and the previous release goes on meanwhile. The window itself, a process of this release
starting against a newer schema inside it and refusing one outside it, is shown with this
release against migrations added to a copy of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from kombu_pgskip.migrate import compatible_range, load_migrations, migrate
from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

QUEUE = "rolling"

APP = """
import json
import os

import psycopg
from celery import Celery

import kombu_pgskip  # noqa: F401  (registers pgskip://)

app = Celery("rollapp", broker=os.environ["PGSKIP_BROKER_URL"])
app.conf.update(
    task_default_queue="rolling",
    worker_hijack_root_logger=True,
    broker_transport_options=json.loads(os.environ.get("ROLL_OPTIONS", "{}")),
)
_conn = None


@app.task(name="rollapp.record")
def record(key):
    global _conn
    if _conn is None:
        _conn = psycopg.connect(os.environ["ROLL_DB"], autocommit=True)
    _conn.execute(
        "INSERT INTO roll_runs (key, release) VALUES (%s, %s)", (key, os.environ["ROLL_RELEASE"])
    )
"""

PUBLISHER = """
import os
import sys
import time

from rollapp import app

stop, prefix, queue = os.environ["ROLL_STOP"], os.environ["ROLL_PREFIX"], sys.argv[1]
i = 0
while not os.path.exists(stop):
    key = f"{prefix}-{i}"
    app.send_task("rollapp.record", args=[key], queue=queue)
    print(key, flush=True)
    i += 1
    time.sleep(0.02)
print("stopped", flush=True)
"""


@dataclass(frozen=True)
class Release:
    name: str
    python: str
    version: int  # the schema version it is built for
    reads_window: bool = True  # it accepts a newer schema whose claims reach back to it


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def _newest_version_at(commit: str) -> int:
    names = _git("ls-tree", "--name-only", commit, "migrations/").split()
    found = [int(m.group(1)) for n in names if (m := re.match(r"migrations/(\d{4})_", n))]
    return max(found, default=0)


def _previous_commit() -> tuple[str, int]:
    """The newest commit built for an older schema than this checkout, and that schema."""
    newest = load_migrations()[-1]
    added = _git("log", "--format=%H", "--diff-filter=A", "--", f"migrations/{newest.label}.sql")
    commit = f"{added.split()[-1]}^" if added.strip() else "HEAD"
    commit = _git("rev-parse", commit).strip()
    version = _newest_version_at(commit)
    oldest, _ = compatible_range()
    if version >= newest.version or version < oldest:
        pytest.skip(
            f"no rolling deploy from {commit[:8]} (schema {version:04d}) to this checkout "
            f"(schema {newest.version:04d}): code built for {oldest:04d} or later runs against "
            f"the newest schema, so the previous release must stop before migrating"
        )
    return commit, version


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release, from git history, in a virtualenv that takes its dependencies from
    this test run's site-packages (appended to its path, so its own kombu_pgskip comes first)."""
    commit, version = _previous_commit()
    root = tmp_path_factory.mktemp("previous-release")
    src, venv = root / "src", root / "venv"
    src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", commit], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(src)],
        capture_output=True, check=True, cwd=root,
    )  # fmt: skip
    (site / "zz_test_run_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shown = subprocess.run(
        [str(python), "-c",
         "import importlib; m = importlib.import_module('kombu_pgskip.migrate'); "
         "print(m.__file__); print(m.latest_version()); print(hasattr(m, 'compatible_range'))"],
        capture_output=True, text=True, check=True, cwd=root,
    ).stdout.split()  # fmt: skip
    assert shown[0].startswith(str(site)) and int(shown[1]) == version, shown
    return Release(f"previous ({commit[:8]})", str(python), version, shown[2] == "True")


@pytest.fixture(scope="session")
def this_release() -> Release:
    return Release("this checkout", sys.executable, load_migrations()[-1].version)


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "app"
    directory.mkdir()
    (directory / "rollapp.py").write_text(APP)
    (directory / "publisher.py").write_text(PUBLISHER)
    return directory


class Process:
    """A subprocess of one release in its own process group, its output in a log file."""

    def __init__(self, release: Release, args: list[str], env: dict[str, str], log: Path) -> None:
        self.release, self.log = release, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [release.python, *args],
                cwd=env["PYTHONPATH"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.release.name} did not log {pattern!r}; log:\n{self.text()}"
                )
            time.sleep(0.1)

    def exited(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.release.name} did not exit; log:\n{self.text()}") from None

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL to the group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


class Deploy:
    """Workers and publishers of either release against one database, and what they did."""

    def __init__(self, db_url: str, app_dir: Path, tmp_path: Path) -> None:
        self.db_url, self.app_dir, self.tmp_path = db_url, app_dir, tmp_path
        self.broker = db_url.replace("postgresql://", "pgskip://", 1)
        self.processes: list[Process] = []
        self.published: list[Path] = []

    def env(self, release: Release, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(
            PYTHONPATH=str(self.app_dir),
            PYTHONUNBUFFERED="1",
            PGSKIP_BROKER_URL=self.broker,
            ROLL_DB=self.db_url,
            ROLL_RELEASE=release.name,
            **extra,
        )
        return env

    def run(self, release: Release, args: list[str], **extra: str) -> Process:
        log = self.tmp_path / f"process-{uuid.uuid4().hex[:8]}.log"
        process = Process(release, args, self.env(release, **extra), log)
        self.processes.append(process)
        return process

    def worker(
        self, release: Release, *, queue: str = QUEUE, wait: bool = True, **options: object
    ) -> Process:
        process = self.run(
            release,
            ["-m", "celery", "-A", "rollapp", "worker", "--loglevel=INFO", "-P", "threads",
             "-c", "4", "-Q", queue, "-n", f"roll-{uuid.uuid4().hex[:8]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            ROLL_OPTIONS=json.dumps(options),
        )  # fmt: skip
        if wait:
            process.wait_for(r"@\S+ ready\.")
        return process

    def publisher(self, release: Release, prefix: str, queue: str = QUEUE) -> tuple[Process, Path]:
        stop = self.tmp_path / f"stop-{prefix}"
        process = self.run(
            release, ["publisher.py", queue], ROLL_STOP=str(stop), ROLL_PREFIX=prefix
        )
        self.published.append(process.log)
        process.wait_for(rf"{prefix}-5\b")
        return process, stop

    def keys_published(self) -> set[str]:
        return {
            line.strip()
            for log in self.published
            for line in log.read_text().splitlines()
            if re.fullmatch(r"[\w.]+-\d+", line.strip())
        }

    def runs(self) -> dict[str, set[str]]:
        """Each release's name -> the keys its workers ran."""
        with psycopg.connect(self.db_url) as conn:
            rows = conn.execute("SELECT release, key FROM roll_runs").fetchall()
        found: dict[str, set[str]] = {}
        for release, key in rows:
            found.setdefault(str(release), set()).add(str(key))
        return found

    def wait_until_ran(self, keys: set[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ran = set().union(*self.runs().values())
            if keys <= ran:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(keys - ran)} messages not run: {sorted(keys - ran)}")
            time.sleep(0.2)

    def wait_for_runs(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(len(k) for k in self.runs().values()) < count:
            assert time.monotonic() < deadline, f"fewer than {count} runs in {timeout}s"
            time.sleep(0.1)

    def close(self) -> None:
        for process in self.processes:
            process.kill()


@pytest.fixture
def deploy(empty_db_url: str, app_dir: Path, tmp_path: Path) -> Iterator[Deploy]:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE roll_runs (key text NOT NULL, release text NOT NULL,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    d = Deploy(empty_db_url, app_dir, tmp_path)
    try:
        yield d
    finally:
        d.close()


def install_previous(deploy: Deploy, previous: Release) -> None:
    """The schema as the previous release's own `pgskip migrate` leaves it."""
    done = deploy.run(previous, ["-m", "kombu_pgskip", "migrate", "--url", deploy.db_url])
    assert done.exited() == 0, done.text()
    with psycopg.connect(deploy.db_url) as conn:
        assert conn.execute("SELECT max(version) FROM pgskip.migrations").fetchone() == (
            previous.version,
        )


def test_migrate_first_while_the_previous_release_publishes_and_consumes(
    deploy: Deploy, previous_release: Release, this_release: Release
) -> None:
    install_previous(deploy, previous_release)
    old_worker = deploy.worker(previous_release)
    old_publisher, stop = deploy.publisher(previous_release, "old")
    deploy.wait_for_runs(10)

    applied = migrate(deploy.db_url)  # this release's runner, while the previous one runs
    assert applied == [m.label for m in load_migrations() if m.version > previous_release.version]
    new_worker = deploy.worker(this_release)

    # A process of the previous release starting now runs against the newer schema: inside
    # its window if it reads the window; a release older than the window refuses it with its
    # exact check, and runs with the check off.
    if previous_release.reads_window:
        restarted = deploy.worker(previous_release, queue="rolling-restarted")
    else:
        refused = deploy.worker(previous_release, wait=False)
        assert refused.exited() != 0
        assert "newer than this kombu-pgskip knows" in refused.text()
        restarted = deploy.worker(previous_release, queue="rolling-restarted", check_schema=False)
    restarted_publisher, restarted_stop = deploy.publisher(
        this_release, "restarted", "rolling-restarted"
    )

    old_worker.stop()  # the rolling part: the previous release's worker goes
    before = len(deploy.keys_published())
    while len(deploy.keys_published()) < before + 25:
        time.sleep(0.1)
    stop.touch()
    restarted_stop.touch()
    assert old_publisher.exited() == 0 and restarted_publisher.exited() == 0
    published = deploy.keys_published()
    deploy.wait_until_ran(published)
    runs = deploy.runs()
    assert runs[this_release.name] & {k for k in published if k.startswith("old-")}
    assert {k for k in published if k.startswith("restarted-")} <= runs[previous_release.name]
    new_worker.stop()
    restarted.stop()


#: Run by a release: publish a message with a unique key until the key is held, fail the holder,
#: publish again, retry the failed one; prints what each step returned, as JSON.
KEYED = """
import json
import os
import sys

import psycopg
from kombu_pgskip.maintenance import FailedFilter, retry_failed
from kombu_pgskip.store import NewMessage, Store

url, key = os.environ["ROLL_DB"], sys.argv[1]
store = Store(url, check=os.environ.get("ROLL_CHECK") != "0")
keyed = NewMessage("keys", 0, "pending", None, "{}", "t", key, None, key)
try:
    first = store.publish(keyed)
    again = store.publish(keyed)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET status = 'failed' WHERE id = %s", (first,))
    second = store.publish(keyed)
finally:
    store.close()
retried = retry_failed(url, "pgskip", FailedFilter(queue="keys"))
print(json.dumps([first, again, second, retried]), flush=True)
"""


def test_unique_keys_hold_across_the_migration_for_the_previous_release(
    deploy: Deploy, previous_release: Release, this_release: Release
) -> None:
    """A key held before the migration stays held; the previous release's publish and
    retry-failed keep a key one message's after it, as this release's do."""
    if previous_release.version < 23:
        pytest.skip(f"the previous release (schema {previous_release.version:04d}) has no keys")
    install_previous(deploy, previous_release)
    (deploy.app_dir / "keyed.py").write_text(KEYED)
    check = "1" if previous_release.reads_window else "0"

    def keyed(release: Release, key: str) -> list[int | None]:
        done = deploy.run(release, ["keyed.py", key], ROLL_CHECK=check)
        assert done.exited() == 0, done.text()
        result: list[int | None] = json.loads(done.text().strip().splitlines()[-1])
        return result

    before = keyed(previous_release, "before")
    migrate(deploy.db_url)
    for release in (previous_release, this_release):
        first, again, second, retried = keyed(release, release.name)
        assert first is not None and again is None and second is not None and retried == 1
    with psycopg.connect(deploy.db_url) as conn:
        holders = conn.execute(
            "SELECT unique_key, count(*) FROM pgskip.jobs WHERE queue = 'keys'"
            " AND status IN ('pending', 'scheduled', 'running') AND unique_key IS NOT NULL"
            " GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert holders == sorted((k, 1) for k in ("before", previous_release.name, this_release.name))
    # The key held since before the migration: nobody writes it.
    assert before[2] is not None
    again = keyed(this_release, "before")
    assert again[0] is None and again[1] is None


def test_the_new_release_started_before_migrating_is_refused_and_the_previous_goes_on(
    deploy: Deploy, previous_release: Release, this_release: Release
) -> None:
    install_previous(deploy, previous_release)
    old_worker = deploy.worker(previous_release)
    old_publisher, stop = deploy.publisher(previous_release, "old")

    early = deploy.worker(this_release, wait=False)
    assert early.exited() != 0
    text = early.text()
    assert f"is at version {previous_release.version}, this kombu-pgskip needs " in text
    assert "so migrate first, then roll the new code out" in text
    deploy.wait_for_runs(10)

    migrate(deploy.db_url)
    new_worker = deploy.worker(this_release)
    old_worker.stop()
    before = len(deploy.keys_published())
    while len(deploy.keys_published()) < before + 25:
        time.sleep(0.1)
    stop.touch()
    assert old_publisher.exited() == 0
    published = deploy.keys_published()
    deploy.wait_until_ran(published)
    assert deploy.runs()[this_release.name]
    new_worker.stop()


def test_this_release_restarts_inside_the_window_and_refuses_outside_it(
    deploy: Deploy, this_release: Release, tmp_path: Path
) -> None:
    """The next releases, as migrations added to a copy of this one's: N + 1 keeps code built
    for N working, N + 2 does not."""
    n = this_release.version
    following = tmp_path / "following"
    following.mkdir()
    for m in load_migrations():
        (following / f"{m.label}.sql").write_text(m.sql)
    migrate(deploy.db_url)
    worker = deploy.worker(this_release)
    publisher, stop = deploy.publisher(this_release, "current")

    (following / f"{n + 1:04d}_rolling_note.sql").write_text(
        f"-- pgskip: compatible-with {n:04d}\nALTER TABLE jobs ADD COLUMN rolling_note text;\n"
    )
    assert migrate(deploy.db_url, directory=following) == [f"{n + 1:04d}_rolling_note"]
    restarted = deploy.worker(this_release)  # starts against N + 1: inside its window
    worker.stop()
    deploy.wait_for_runs(len(deploy.keys_published()) + 10)

    (following / f"{n + 2:04d}_rolling_break.sql").write_text(
        f"-- pgskip: compatible-with {n + 2:04d}\nCREATE TABLE rolling_marker (x int);\n"
    )
    assert migrate(deploy.db_url, directory=following) == [f"{n + 2:04d}_rolling_break"]
    refused = deploy.worker(this_release, wait=False)
    assert refused.exited() != 0
    assert (
        f"migration {n + 2:04d}_rolling_break needs code built for schema {n + 2:04d} or later"
        in refused.text()
    )
    stop.touch()
    assert publisher.exited() == 0
    published = deploy.keys_published()
    deploy.wait_until_ran(published)  # the worker started before N + 2 goes on
    restarted.stop()
