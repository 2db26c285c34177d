"""Run Celery's own integration suite (``t/integration`` of the celery sdist) against pgskip.

Usage (the venv needs ``pip install -e .[binary,test]`` plus the suite's plugins; see
``scripts/celery-integration.sh``, which sets everything up)::

    python -m tests.celery_integration.run [--configs pgskip/redis,pgskip/postgresql,...]
                                           [--out DIR] [-- extra pytest args]

What it does:

1. downloads the celery sdist of the installed version
   (``pip download --no-binary :all: --no-deps celery==X``) into a temporary directory and
   unpacks it;
2. starts a private ``redis-server`` per configuration (the suite's helper tasks and the
   Redis result backend need one; private so that configurations can run at once);
3. starts a throwaway PostgreSQL (:class:`kombu_pgskip.testing.embedded.EmbeddedPostgres`) and gives
   each configuration a fresh database for the broker (migrated) and one for results;
4. runs ``pytest t/integration`` once per configuration (``TEST_BROKER`` / ``TEST_BACKEND``),
   ``--parallel`` at a time, with a JUnit XML report each, and prints pass/fail/skip/error
   counts side by side, plus every test whose outcome differs between configurations.

Configurations are ``broker/backend`` pairs: broker ``pgskip`` or ``redis``, backend ``redis``
or ``postgresql`` (``db+postgresql://`` via SQLAlchemy). The default runs all four.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
from psycopg import sql

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from kombu_pgskip.migrate import migrate  # noqa: E402
from kombu_pgskip.testing.embedded import EmbeddedPostgres  # noqa: E402

DEFAULT_CONFIGS = ["pgskip/redis", "pgskip/postgresql", "redis/redis", "redis/postgresql"]

# Files not collected, and why (reported in docs/celery-compatibility.md).
IGNORED = {
    "t/integration/test_backend.py": "Azure Block Blob result backend: needs the azure SDK "
    "and an Azure storage account; nothing to do with the broker",
}


# pytest processes running now: stopped when the runner is (SIGTERM, Ctrl-C).
RUNNING: set[subprocess.Popen[bytes]] = set()


def _stop(signum: int, frame: object) -> None:
    for proc in list(RUNNING):
        proc.terminate()
    sys.exit(128 + signum)


# pgskip failures that are not transport bugs, with the reason (docs/celery-compatibility.md).
EXPECTED: dict[str, str] = {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A private ``redis-server`` for one configuration (so configurations can run at once:
    the suite's helper tasks use fixed keys in database 0 of ``$REDIS_HOST:$REDIS_PORT``)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(100):
            if redis_up(self.port):
                return
            time.sleep(0.1)
        self.stop()
        sys.exit(f"redis-server did not come up on 127.0.0.1:{self.port}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fetch_sdist(workdir: Path) -> Path:
    import celery

    version = celery.__version__
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
         "-q", f"celery=={version}", "-d", str(workdir)],
        check=True,
    )  # fmt: skip
    (archive,) = workdir.glob(f"celery-{version}.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / f"celery-{version}"


def create_db(server_dsn: str, name: str) -> str:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return server_dsn.rsplit("/", 1)[0] + "/" + name


def parse_junit(path: Path) -> dict[str, str]:
    """test id -> passed | failed | error | skipped (the last outcome of a rerun test)."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "skipped" and "xfail" in (child.get("type") or ""):
                    outcome = "xfailed"
                break
        outcomes[test] = outcome
    return outcomes


def skip_reasons(path: Path) -> dict[str, str]:
    reasons: dict[str, str] = {}
    if not path.exists():
        return reasons
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or "").strip()
                reasons[test] = message.splitlines()[0][:300] if message else ""
    return reasons


def run_config(
    name: str,
    suite: Path,
    pg: EmbeddedPostgres,
    out: Path,
    extra: list[str],
    only: list[str] | None = None,
) -> dict[str, object]:
    broker, backend = name.split("/")
    tag = uuid.uuid4().hex[:8]
    redis = RedisServer()
    env = dict(os.environ, REDIS_HOST="127.0.0.1", REDIS_PORT=str(redis.port))
    # test_worker.py runs `celery` by name: the virtualenv's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if broker == "pgskip":
        url = create_db(pg.dsn("postgres"), f"broker_{tag}")
        migrate(url)
        env["TEST_BROKER"] = url.replace("postgresql://", "pgskip://", 1)
    else:
        env["TEST_BROKER"] = f"redis://127.0.0.1:{redis.port}/1"
    if backend == "postgresql":
        env["TEST_BACKEND"] = "db+" + create_db(pg.dsn("postgres"), f"results_{tag}")
    else:
        env["TEST_BACKEND"] = f"redis://127.0.0.1:{redis.port}/2"
    env["PYTHONPATH"] = os.pathsep.join([str(suite), str(REPO_ROOT)])
    files = sorted(
        str(p.relative_to(suite))
        for p in (suite / "t" / "integration").glob("test_*.py")
        if str(p.relative_to(suite)) not in IGNORED
        and (not only or p.name in only or p.stem in only)
    )
    log = out / f"{broker}-{backend}.log"
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    exits: dict[str, int] = {}
    started = time.monotonic()
    try:
        # One pytest process per file: a crash (an INTERNALERROR, a wedged worker) costs one
        # file, not the rest of the suite; the session worker restarts per file (seconds).
        for path in files:
            junit = out / f"{broker}-{backend}-{Path(path).stem}.xml"
            argv = [
                sys.executable, "-m", "pytest", path,
                "-p", "celery.contrib.pytest",  # registers the `celery` marker the suite uses
                "-p", "kombu_pgskip",  # registers the pgskip:// scheme in the test process
                "-p", "no:cacheprovider",
                "--timeout", "300", "-q", "-rfEs", f"--junitxml={junit}",
                *extra,
            ]  # fmt: skip
            with open(log, "a") as fh:
                fh.write(f"\n===== {path}\n")
                fh.flush()
                proc = subprocess.Popen(
                    argv, cwd=suite, env=env, stdout=fh, stderr=subprocess.STDOUT
                )
                RUNNING.add(proc)
                try:
                    exits[path] = proc.wait()
                finally:
                    RUNNING.discard(proc)
            outcomes.update(parse_junit(junit))
            reasons.update(skip_reasons(junit))
            if exits[path] not in (0, 1, 5):  # 2 interrupted, 3 internal error, 4 usage
                outcomes[f"{path}::<pytest exit {exits[path]}>"] = "error"
    finally:
        redis.stop()
    elapsed = time.monotonic() - started
    counts = Counter(outcomes.values())
    rc = max(exits.values(), default=0)
    print(f"   {name}: {dict(sorted(counts.items()))} in {elapsed / 60:.1f} min", flush=True)
    return {"config": name, "exit": rc, "seconds": round(elapsed), "counts": dict(counts),
            "outcomes": outcomes, "reasons": reasons}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--out", default=None, help="where logs, JUnit XML and summary go")
    parser.add_argument("--suite", default=None, help="an unpacked celery sdist to use")
    parser.add_argument(
        "--parallel",
        type=int,
        default=2,
        help="configurations run at once (the suite mostly waits; default 2)",
    )
    parser.add_argument(
        "--files", default="", help="comma-separated test files to run (default: all)"
    )
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    only = [f.strip() for f in args.files.split(",") if f.strip()]
    for config in configs:
        broker, _, backend = config.partition("/")
        if broker not in ("pgskip", "redis") or backend not in ("redis", "postgresql"):
            parser.error(f"unknown configuration {config!r}")
    out = Path(args.out or tempfile.mkdtemp(prefix="celery-integration-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="celery-sdist-") as tmp:
        suite = Path(args.suite) if args.suite else fetch_sdist(Path(tmp))
        with EmbeddedPostgres(fsync=False) as pg, ThreadPoolExecutor(args.parallel) as pool:
            results = list(
                pool.map(lambda c: run_config(c, suite, pg, out, args.pytest_args, only), configs)
            )
    print(f"\nwall clock: {(time.monotonic() - started) / 60:.1f} min")
    summary = out / "summary.json"
    summary.write_text(json.dumps(results, indent=1, sort_keys=True))
    print("\nconfiguration          passed failed error skipped xfailed  minutes")
    for r in results:
        c: Counter[str] = Counter(r["counts"])  # type: ignore[arg-type]
        print(f"{r['config']:<22} {c['passed']:>6} {c['failed']:>6} {c['error']:>5} "
              f"{c['skipped']:>7} {c['xfailed']:>7}  {int(r['seconds']) / 60:7.1f}")  # type: ignore[call-overload]  # fmt: skip
    every = sorted({t for r in results for t in r["outcomes"]})  # type: ignore[attr-defined]
    differing = [
        t for t in every
        if len({r["outcomes"].get(t) for r in results}) > 1  # type: ignore[attr-defined]
    ]  # fmt: skip
    if differing:
        print("\ntests whose outcome differs between configurations:")
        for t in differing:
            cells = ", ".join(f"{r['config']}={r['outcomes'].get(t, '-')}" for r in results)  # type: ignore[attr-defined]
            print(f"  {t}: {cells}")
    print(f"\nlogs, JUnit XML and summary.json in {out}")
    (out / "summary.md").write_text(markdown(results))
    unexplained = unexplained_failures(results)
    if unexplained:
        print(
            "\npgskip failures that neither Redis shares nor docs/celery-compatibility.md explains:"
        )
        for config, test in unexplained:
            print(f"  {config}: {test}")
    return 1 if unexplained else 0


def markdown(results: list[dict[str, object]]) -> str:
    """Counts per configuration, then every test that did not pass somewhere, side by side."""
    kinds = ("passed", "failed", "error", "skipped", "xfailed")
    lines = ["| configuration | " + " | ".join(kinds) + " | minutes |", "|---" * 7 + "|"]
    for r in results:
        c: Counter[str] = Counter(r["counts"])  # type: ignore[arg-type]
        cells = " | ".join(str(c[k]) for k in kinds)
        lines.append(f"| {r['config']} | {cells} | {int(r['seconds']) / 60:.1f} |")  # type: ignore[call-overload]
    names = [str(r["config"]) for r in results]
    lines += ["", "| test | " + " | ".join(names) + " | reason (first config that did not pass) |",
              "|---" * (len(names) + 2) + "|"]  # fmt: skip
    every = sorted({t for r in results for t in r["outcomes"]})  # type: ignore[attr-defined]
    for test in every:
        outcomes = [r["outcomes"].get(test, "-") for r in results]  # type: ignore[attr-defined]
        if all(o == "passed" for o in outcomes):
            continue
        reason = next(
            (r["reasons"].get(test, "") for r in results  # type: ignore[attr-defined]
             if r["outcomes"].get(test) not in ("passed", None)),  # type: ignore[attr-defined]
            "",
        )  # fmt: skip
        reason = reason.replace("|", "\\|")[:160]
        short = test.removeprefix("t.integration.")
        lines.append(f"| `{short}` | " + " | ".join(outcomes) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def unexplained_failures(results: list[dict[str, object]]) -> list[tuple[str, str]]:
    """pgskip failures not in EXPECTED and not failing with Redis on the same backend too."""
    by_config = {str(r["config"]): r["outcomes"] for r in results}
    bad = ("failed", "error")
    found = []
    for config, outcomes in by_config.items():
        if not config.startswith("pgskip/"):
            continue
        redis = by_config.get("redis/" + config.split("/", 1)[1], {})
        for test, outcome in outcomes.items():  # type: ignore[attr-defined]
            if outcome not in bad or test in EXPECTED:
                continue
            if redis.get(test) in bad:  # type: ignore[attr-defined]
                continue  # not the broker's doing: Redis fails it the same way
            found.append((config, test))
    return sorted(found)


if __name__ == "__main__":
    sys.exit(main())
