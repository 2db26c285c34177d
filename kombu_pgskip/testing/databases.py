"""Throwaway migrated databases for the test suites of applications that use kombu-pgskip.

What the pytest plugin's fixtures run (docs/testing.md); usable without pytest too::

    server = ThrowawayServer.start()            # an embedded cluster, or $PGSKIP_TEST_DSN's
    url = server.create_database()              # postgresql://... with the schema migrated
    ...
    server.drop_database(url)
    server.close()

A :class:`ThrowawayServer` is either an :class:`~kombu_pgskip.testing.embedded.EmbeddedPostgres`
started for it (superuser ``postgres``, no password, ``fsync`` off: never for data that
matters), or an existing server named by a URL, on which it only creates databases of its own
(``pgskip_test_<random>``) and drops them again; the URL's role needs ``CREATEDB``. The first
migrated database migrates a template once (``pgskip_template_<random>``); every later one is
a copy of it (``CREATE DATABASE ... TEMPLATE``), which takes a fraction of a second.

With ``keep=True`` nothing is dropped and the embedded cluster keeps running after the
process exits; :meth:`ThrowawayServer.close` returns the lines that say where it all is and
how to remove it.
"""

from __future__ import annotations

import os
import threading
import uuid
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ..migrate import DEFAULT_SCHEMA, migrate
from ..urls import mask_url
from .embedded import EmbeddedPostgres

__all__ = ["ThrowawayServer", "broker_url"]

#: The URL schemes a server may be given with.
_URL_SCHEMES = ("postgresql", "postgres", "pgskip")


def database_url(url: str, dbname: str) -> str:
    """``url`` (``postgresql://`` or ``pgskip://``) naming database ``dbname`` instead, as a
    ``postgresql://`` URL with the same user, password, host, port and parameters."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="postgresql", path="/" + quote(dbname, safe="")))


def broker_url(url: str) -> str:
    """The ``pgskip://`` broker URL of the database ``url`` names."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="pgskip"))


def _dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


class ThrowawayServer:
    """Where throwaway databases live; see the module docstring. Thread-safe."""

    def __init__(
        self,
        url: str,
        *,
        embedded: EmbeddedPostgres | None = None,
        keep: bool = False,
        schema: str = DEFAULT_SCHEMA,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in _URL_SCHEMES or not parts.netloc:
            raise ValueError(
                f"not a PostgreSQL URL: {mask_url(url)!r}; expected "
                "postgresql://user:password@host:5432/postgres"
            )
        self.url = database_url(url, _dbname(url) or "postgres")
        self.embedded = embedded
        self.keep = keep
        self.schema = schema
        self._template: str | None = None
        self._created: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        url: str | None = None,
        *,
        pg_cron: bool = False,
        keep: bool = False,
        schema: str = DEFAULT_SCHEMA,
    ) -> ThrowawayServer:
        """The server at ``url`` (a role that may create databases), else a new embedded
        cluster, with pg_cron preloaded if ``pg_cron`` (``cron.database_name = 'postgres'``).

        Raises :class:`RuntimeError` when the cluster cannot start (its message names the
        missing binaries or package) or ``url``'s server cannot be reached.
        """
        if url:
            server = cls(url, keep=keep, schema=schema)
            server._check_reachable()
            return server
        embedded = EmbeddedPostgres(fsync=False, pg_cron=pg_cron).start()
        return cls(embedded.dsn("postgres"), embedded=embedded, keep=keep, schema=schema)

    @property
    def kind(self) -> str:
        """``embedded`` or ``external``."""
        return "embedded" if self.embedded is not None else "external"

    def create_database(self, *, migrated: bool = True) -> str:
        """A new database of this server's own, with the schema migrated (``migrated``) or
        empty; returns its ``postgresql://`` URL."""
        template = self._migrated_template() if migrated else "template0"
        name = f"pgskip_test_{uuid.uuid4().hex[:12]}"
        self._create(name, template)
        return database_url(self.url, name)

    def drop_database(self, url: str) -> None:
        """Drop a database :meth:`create_database` made (even with sessions still connected);
        with ``keep`` it stays."""
        name = _dbname(url)
        with self._lock:
            if name not in self._created:
                raise ValueError(f"database {name!r} was not created by this server")
            if self.keep:
                return
            self._created.remove(name)
        self._drop(name)

    def close(self) -> list[str]:
        """Drop what is left (the template, databases not dropped yet) and stop the embedded
        cluster; with ``keep``, leave it all and return where it is."""
        with self._lock:
            names = [*self._created, *([self._template] if self._template else [])]
            self._created, self._template = [], None
        if self.keep:
            return self._kept(names)
        try:
            for name in names:
                self._drop(name)
        finally:
            if self.embedded is not None:
                self.embedded.cleanup()
        return []

    # -- internals ----------------------------------------------------------------------------

    def _kept(self, names: list[str]) -> list[str]:
        lines = [f"kombu-pgskip kept the test server: {mask_url(self.url)}"]
        if names:
            lines.append(f"  databases: {', '.join(names)}")
        if self.embedded is not None:
            self.embedded.keep()
            data = self.embedded.data_dir
            lines.append(f"  data directory: {data}")
            lines.append(
                f"  remove it: {self.embedded.bindir}/pg_ctl -D {data} -m fast stop "
                f"&& rm -rf {self.embedded.base_path}"
                + (" (pg_ctl as the postgres OS user)" if os.geteuid() == 0 else "")
            )
        elif names:
            lines.append("  remove them: DROP DATABASE <name> WITH (FORCE); for each")
        return lines

    def _check_reachable(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10):
                pass
        except psycopg.OperationalError as exc:
            raise RuntimeError(
                f"cannot connect to the test server {mask_url(self.url)} "
                f"(PGSKIP_TEST_DSN): {exc}".strip()
            ) from None

    def _migrated_template(self) -> str:
        with self._lock:
            if self._template is not None:
                return self._template
            name = f"pgskip_template_{uuid.uuid4().hex[:8]}"
            self._create(name, "template0", record=False)
            self._template = name
            try:
                migrate(database_url(self.url, name), schema=self.schema)
                # CREATE DATABASE ... TEMPLATE refuses while anyone is connected to the
                # template; migrate() has closed its connection, but a backend may take a
                # moment to exit.
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = %s AND pid <> pg_backend_pid()",
                        (name,),
                    )
            except BaseException:
                self._template = None
                self._drop(name)
                raise
            return name

    def _create(self, name: str, template: str, *, record: bool = True) -> None:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(query)
        except pg_errors.InsufficientPrivilege as exc:
            user = urlsplit(self.url).username or "the URL's role"
            raise RuntimeError(
                f"{user} may not create databases on {mask_url(self.url)} ({exc}): run "
                f"`ALTER ROLE {user} CREATEDB;` as a superuser, or point PGSKIP_TEST_DSN at a "
                "role that may"
            ) from None
        if record:
            with self._lock:
                self._created.append(name)

    def _drop(self, name: str) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
