"""Debian's ``pgbouncer`` in transaction pooling mode, in front of the test server.

Started as a subprocess (as the ``postgres`` OS user when we are root: pgbouncer refuses to run
as root) with a generated config; every database of the server is reachable through it. The
settings are the ones docs/reliability.md documents for running workers behind PgBouncer.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SETTINGS = {
    "pool_mode": "transaction",
    "auth_type": "trust",
    "max_client_conn": "1000",
    "default_pool_size": "20",
    "ignore_startup_parameters": "extra_float_digits",
    "server_reset_query": "",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PgBouncer:
    """``with PgBouncer(server_dsn) as bouncer: bouncer.url_for(db_url)``."""

    def __init__(self, server_dsn: str) -> None:
        target = urlsplit(server_dsn)
        self.server_host = target.hostname or "127.0.0.1"
        self.server_port = target.port or 5432
        self.user = target.username or "postgres"
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pgskip-pgbouncer-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / "pgbouncer.log"

    def url_for(self, url: str) -> str:
        """``url`` (same database and user) through the bouncer."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    def start(self) -> PgBouncer:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise RuntimeError("pgbouncer is not installed: run scripts/bootstrap.sh")
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_file": str(self.dir / "userlist.txt"),
            "logfile": str(self.log_path),
            **SETTINGS,
        }
        lines = [
            "[databases]",
            f"* = host={self.server_host} port={self.server_port} user={self.user}",
            "[pgbouncer]",
            *(f"{k} = {v}" for k, v in settings.items()),
        ]
        config = self.dir / "pgbouncer.ini"
        config.write_text("\n".join(lines) + "\n")
        argv = [binary, str(config)]
        if os.geteuid() == 0:
            shutil.chown(self.dir, user="postgres")
            for path in self.dir.iterdir():
                shutil.chown(path, user="postgres")
            argv[1:1] = ["-u", "postgres"]
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start:\n{self.log_tail()}") from None
                time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
